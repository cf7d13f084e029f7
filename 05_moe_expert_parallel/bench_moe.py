"""Chapter 05 benchmark: balance, dropping, bytes, memory and speed of the mixture of experts.

    python 05_moe_expert_parallel/bench_moe.py                    # every part (about 10 minutes on 2 cores)
    python 05_moe_expert_parallel/bench_moe.py --only load|capacity|ep
    python 05_moe_expert_parallel/bench_moe.py --quick            # fewer steps and repeats

Writes 05_moe_expert_parallel/results/:
  expert_load.png, load_balance.md   expert load per step, layers × experts, with no balancing, with the
                                     aux loss, and with the aux-loss-free bias (1 rank: the statistics do
                                     not depend on the layout)
  capacity.md                        dropped fraction against the capacity factor, and its cost in loss
  ep_bytes.md                        all-to-all bytes per step against the formula; expert bytes per rank
  throughput.md                      tokens/s: MoE vs the dense model of the same active size, EP 1/2/4
Every number comes from train_moe.py's metrics files.
"""
import argparse
import os
import statistics
import sys
import tempfile
from importlib import import_module
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.launch import launch  # noqa: E402
from common.metrics import read_metrics  # noqa: E402
from common.moe_routing import expert_capacity  # noqa: E402

ep_layers = import_module("05_moe_expert_parallel.expert_parallel")      # the all-to-all bytes formula

RESULTS = Path(__file__).parent / "results"
SCRIPT = "05_moe_expert_parallel/train_moe.py"


def run(tmp, name, nproc, flags) -> list[dict]:
    path = Path(tmp) / f"{name}.jsonl"
    launch(SCRIPT, nproc, flags + ["--quiet", "--metrics", str(path)], echo=False, quiet=True)
    return read_metrics(path)


def command(part: str) -> str:
    return f"Command: `python 05_moe_expert_parallel/bench_moe.py --only {part}{' --quick' * QUICK}`."


def load_balance(tmp, machine):
    steps = 20 if QUICK else 50
    shape = ["--steps", str(steps), "--seq-len", "64", "--global-batch", "16"]
    configs = {"no balancing (α = 0)": ["--aux-loss-coef", "0"],
               "aux loss (α = 0.01, the default)": [],
               "bias, no aux loss (α = 0, γ = 0.02)": ["--aux-loss-coef", "0", "--router-bias-rate", "0.02"]}
    runs = {label: run(tmp, f"load{i}", 1, shape + flags) for i, (label, flags) in enumerate(configs.items())}
    plot = import_plot()
    plot.plot_expert_load({label: Path(tmp) / f"load{i}.jsonl" for i, label in enumerate(runs)},
                          RESULTS / "expert_load.png", note=f"tiny-moe, {' '.join(shape)}, 1 rank. {machine}")
    marks = [10, steps // 2, steps]
    lines = [f"| {label} | " + " | ".join(f"{rows[m - 1]['max_over_mean_load']:.2f}" for m in marks) +
             f" | {statistics.mean(r['max_over_mean_load'] for r in rows[-10:]):.2f} | "
             f"{max(max(map(max, r['expert_load'])) for r in rows[-10:])} | {rows[-1]['loss']:.4f} | "
             f"{rows[-1]['aux_loss']:.4f} |" for label, rows in runs.items()]
    T = 16 * 64 * 2 // 8
    (RESULTS / "load_balance.md").write_text(
        f"Expert load of tiny-moe (8 layers × 8 experts, top-2), {' '.join(shape)}, 1 rank. {machine}\n"
        f"{command('load')} Plot: [expert_load.png](expert_load.png).\n\n"
        f"max/mean load: per layer, the busiest expert's slots over the mean ({T} = 16·64·2/8 per step), then the "
        "mean over the 8 layers; 1.00 is perfect balance, 8.00 one expert taking everything.\n\n"
        f"| run | max/mean at step {marks[0]} | at step {marks[1]} | at step {marks[2]} | mean of the last 10 steps "
        f"| busiest expert, last 10 steps (slots) | loss at step {steps} | aux_loss at step {steps} |\n"
        "|---|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n")


def capacity(tmp, machine):
    steps = 15 if QUICK else 30
    shape = ["--steps", str(steps), "--seq-len", "64", "--global-batch", "16"]
    factors = [None, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0]
    rows = {cf: run(tmp, f"cf{cf}", 1, shape + ([] if cf is None else ["--capacity-factor", str(cf)]))
            for cf in factors}
    last = lambda rs: statistics.mean(r["loss"] for r in rs[-5:])
    base = last(rows[None])
    lines = []
    for cf, rs in rows.items():
        capacity_slots = "-" if cf is None else str(expert_capacity(cf, 64, 2, 8))
        lines.append(f"| {'dropless' if cf is None else cf} | {capacity_slots} | "
                     f"{100 * statistics.mean(r['dropped_fraction'] for r in rs):.1f}% | "
                     f"{100 * rs[-1]['dropped_fraction']:.1f}% | {last(rs):.4f} | {last(rs) - base:+.4f} |")
    (RESULTS / "capacity.md").write_text(
        f"Dropped slots against the capacity factor, tiny-moe, {' '.join(shape)}, aux loss on (α = 0.01), 1 rank. "
        f"{machine}\n{command('capacity')}\n\n"
        "Capacity per expert per sequence = ⌈CF·S·k/E⌉ = ⌈CF·64·2/8⌉ slots; a dropped slot adds nothing to its "
        "token (residual only for that choice).\n\n"
        f"| capacity factor | capacity (slots per sequence) | dropped, mean over {steps} steps | dropped at step "
        f"{steps} | loss, mean of the last 5 steps | cost vs dropless |\n|---|---|---|---|---|---|\n"
        + "\n".join(lines) + "\n")


def expert_parallel(tmp, machine, repeats):
    """4 ranks at EP 1, 2, 4, and 1 rank MoE and dense: bytes, expert bytes per rank, tokens/s."""
    steps = 4 if QUICK else 6
    shape = ["--steps", str(steps), "--seq-len", "64", "--global-batch", "16"]
    configs = {"tiny (dense), 1 rank": (1, ["--model", "tiny"]), "tiny-moe, 1 rank": (1, []),
               "tiny (dense), dp 4": (4, ["--model", "tiny"]),
               "tiny-moe, dp 4 = edp 4 × ep 1": (4, ["--ep", "1"]), "tiny-moe, dp 4 = edp 2 × ep 2": (4, ["--ep", "2"]),
               "tiny-moe, dp 4 = edp 1 × ep 4": (4, ["--ep", "4"])}
    speed, metrics = {label: [] for label in configs}, {}
    for rep in range(repeats):                      # interleaved: every configuration once per round
        for i, (label, (nproc, flags)) in enumerate(configs.items()):
            rows = run(tmp, f"ep{i}_{rep}", nproc, shape + flags)
            speed[label].append(statistics.median(r["tokens_per_s"] for r in rows[1:]))   # step 1: warm-up
            metrics[label] = rows
    L, D, E, k = 8, 128, 8, 2
    byte_lines, param_lines = [], []
    whole = metrics["tiny-moe, 1 rank"][-1]["expert_param_bytes"]
    for label in ("tiny-moe, 1 rank", "tiny-moe, dp 4 = edp 4 × ep 1", "tiny-moe, dp 4 = edp 2 × ep 2", "tiny-moe, dp 4 = edp 1 × ep 4"):
        rows, nproc = metrics[label], configs[label][0]
        ep = rows[-1]["ep"]
        T_rank = 16 * 64 // nproc
        formula = ep_layers.expected_ep_bytes(L, T_rank, k, D, E, ep)
        measured = statistics.mean(r["comm_bytes_ep"] for r in rows)
        byte_lines.append(f"| {label} | {ep} | {T_rank} | {formula / 2**20:.3f} | {measured / 2**20:.3f} | "
                          f"{f'{measured / formula:.3f}' if formula else '-'} | "
                          f"{statistics.mean(r['comm_bytes_dp'] for r in rows) / 2**20:.2f} |")
        mine = rows[-1]["expert_param_bytes"]
        param_lines.append(f"| {label} | {ep} | {mine:,} | {whole / ep:,.0f} | {mine / whole:.4f} | "
                           f"{rows[-1]['param_bytes']:,} |")
    (RESULTS / "ep_bytes.md").write_text(
        f"All-to-all bytes per step on rank 0 (sent + received), tiny-moe, {' '.join(shape)}, dropless, "
        f"mean over {steps} steps. {machine}\n{command('ep')}\n\n"
        "Formula, routing that ignores where a token lives: per layer 4 exchanges (dispatch and combine, forward "
        "and backward), each moving (ep−1)/ep·T·k rows of D fp32 out of the rank and as many in, plus the counts "
        "(E/ep int64 to and from each other rank, forward only): L·(8·(ep−1)/ep·T·k·D·4 + 16·(ep−1)·E/ep) bytes, "
        "T = tokens per rank per step.\n\n"
        "| run | EP | T per rank | formula (MiB) | measured on rank 0 (MiB) | measured / formula | gradient "
        "all-reduce bytes (MiB) |\n|---|---|---|---|---|---|---|\n" + "\n".join(byte_lines) + "\n\n"
        "Expert parameter bytes per rank against 1/EP (fp32):\n\n"
        "| run | EP | expert bytes on rank 0 | all experts / EP | fraction | all parameter bytes on rank 0 |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(param_lines) + "\n")
    base = statistics.median(speed["tiny (dense), 1 rank"])
    lines = [f"| {label} | {configs[label][0]} | {statistics.median(v):,.0f} | {statistics.median(v) / base:.2f} |"
             for label, v in speed.items()]
    (RESULTS / "throughput.md").write_text(
        f"Tokens/s, {' '.join(shape)}, median over steps 2..{steps} and over {repeats} interleaved repeats. "
        f"tiny and tiny-moe have the same active parameters per token (tiny-moe adds the routers). {machine}\n"
        f"{command('ep')}\n\n| run | ranks | tokens/s | vs dense 1 rank |\n|---|---|---|---|\n"
        + "\n".join(lines) + "\n")


def import_plot():
    return import_module("05_moe_expert_parallel.plot_expert_load")


def main():
    global QUICK
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["load", "capacity", "ep"], default=None, help="run one part only")
    p.add_argument("--quick", action="store_true", help="fewer steps and one repeat")
    p.add_argument("--machine", default=f"Machine: {os.cpu_count()}-core CPU, gloo, fp32, one process per rank.",
                   help="how the tables describe the machine")
    args = p.parse_args()
    QUICK = args.quick
    RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "load"):
            load_balance(tmp, args.machine)
        if args.only in (None, "capacity"):
            capacity(tmp, args.machine)
        if args.only in (None, "ep"):
            expert_parallel(tmp, args.machine, 1 if QUICK else 3)
    for f in sorted(RESULTS.glob("*.md")):
        print(f"--- {f.name}\n{f.read_text()}")


QUICK = False

if __name__ == "__main__":
    main()
