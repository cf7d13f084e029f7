"""What the layout planner is worth: its predictions against measured runs here, and published runs at scale.

    python 06_context_parallel/check_layouts.py              # → results/layouts_here.md, layouts_published.md,
                                                             #   layouts_memory.png, layouts_predicted_vs_measured.png
    python 06_context_parallel/check_layouts.py --published  # only the published table and the memory plot (seconds)

Here: every 8-rank layout of chapter 04's bench_3d.py runs 2 steps of train_3d.py with the bench's batch
and micro-batches (~3 min on 2 cores); its metrics hold the bytes each group moved (comm_bytes_*, rank 0),
AdamW's bytes and every stage's measured activation peak, which the planner predicts for the same layout.
The tokens/s order is the bench's own table (results/3d_bench.md in chapter 04: medians over 11 steps),
against the order of the planner's step times: their Spearman rank correlation.
At scale: each published configuration is planned on its cluster; the table gives the planner's memory
per GPU for the published layout (the closest one the planner enumerates), where it ranks, and the
planner's own first choice.
"""
import argparse
import json
import re
import sys
import tempfile
from importlib import import_module
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from common import activation_ledger  # noqa: E402
from common.launch import launch  # noqa: E402
from common.model import PRESETS  # noqa: E402

bench_3d = import_module("04_3d_combined.bench_3d")                   # chapter 04: the 8-rank layouts
layout_costs = import_module("06_context_parallel.layout_costs")
layout_inputs = import_module("06_context_parallel.layout_inputs")
choose_layout = import_module("06_context_parallel.choose_layout")
RESULTS = HERE / "results"
GROUPS = ("dp", "tp", "pp")

# (name, planner arguments, the published layout as the planner spells it, source)
PUBLISHED = [
    ("Llama 3 405B, 8K sequences", ["--model", "llama3-405b", "--world", "16384", "--device", "h100", "--dtype", "bf16",
                                    "--global-batch", "2048", "--seq-len", "8192"],
     dict(dp=128, tp=8, pp=16, cp=1, ep=1, zero_stage=2, sequence_parallel=True, schedule="interleaved"),
     "Llama 3 Herd of Models, Table 4: 16,384 H100s, TP 8 × CP 1 × PP 16 × DP 128, 16M tokens per batch; FSDP "
     "shards gradients and optimizer state (ZeRO-2 here)"),
    ("GPT-3 175B (Megatron-LM)", ["--model", "gpt3-175b", "--world", "1024", "--device", "a100", "--dtype", "bf16",
                                  "--global-batch", "1536", "--seq-len", "2048"],
     dict(dp=8, tp=8, pp=16, cp=1, ep=1, zero_stage=0, recompute="full", sequence_parallel=False,
          schedule="interleaved"),
     "Narayanan et al. 2021, Table 1: 1,024 A100s, TP 8 × PP 16, batch 1,536, interleaved, full recomputation"),
    ("DeepSeek-V3", ["--model", "deepseek-v3", "--world", "2048", "--device", "h100", "--dtype", "bf16",
                     "--global-batch", "15360", "--seq-len", "4096"],
     dict(dp=128, tp=1, pp=16, cp=1, ep=64, zero_stage=1),
     "DeepSeek-V3 report §3.2: 2,048 H800s, PP 16 × EP 64 (over 8 nodes) × ZeRO-1 DP, no TP; batch 15,360 × 4K "
     "(H800 planned as H100: same FLOP/s, NVLink 400 GB/s instead of 900)"),
]


def measured_here(steps: int) -> dict:
    """{layout name: last metrics row} of a short train_3d.py run per 8-rank layout of bench_3d.py."""
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (ranks, degrees) in bench_3d.LAYOUTS.items():
            if ranks != 8:
                continue
            out = Path(tmp) / "m.jsonl"
            argv = ["--model", "tiny", *bench_3d.BATCH, *bench_3d.microbatches(degrees),
                    *(x for k, v in degrees.items() for x in (f"--{k}", v)), "--steps", steps, "--quiet",
                    "--sample-tokens", "0", "--val-every", "0", "--metrics", out]
            launch(HERE.parent / "04_3d_combined" / "train_3d.py", ranks, argv, echo=False, quiet=True)
            rows[name] = json.loads(out.read_text().splitlines()[-1])
            print(f"measured {name}", flush=True)
    return rows


def bench_tokens_per_s() -> dict:
    """{layout name: tokens/s} from chapter 04's results/3d_bench.md."""
    text = (HERE.parent / "04_3d_combined" / "results" / "3d_bench.md").read_text()
    return {m[0]: float(m[1].replace(",", "")) for m in re.findall(r"^\| (\d × \d × \d) \| 8 \| [\d.]+ \| ([\d,]+) \|",
                                                                  text, re.M)}


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0] * len(x)
        for i, j in enumerate(order):
            r[j] = i
        return r
    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def predicted_here(name: str, dev) -> tuple[dict, list[int], dict]:
    """The planner's row for a bench layout, every stage's ledger peak, rank 0's memory."""
    dp, tp, pp = (int(x) for x in name.split(" × "))
    m = int(bench_3d.microbatches({"dp": dp, "pp": pp})[1])
    run = layout_costs.Run(PRESETS["tiny"], 16, 128, "fp32")
    c = layout_costs.Candidate(dp, tp, pp, 1, 1, 0, "none", False, "1f1b", m)
    specs, plan = layout_costs.specs_for(run.cfg, pp, 1, 128), layout_costs.plan_for("1f1b", pp, m, 1)
    peaks = activation_ledger.pipeline_peaks(run.cfg, "none", plan, specs, 16 // dp // m, 128, tp)
    return layout_costs.predict(run, c, dev, 8), peaks, layout_costs.rank_memory(run, c, specs, 0, peaks[0])


def check_here(steps: int) -> tuple[list[str], list[tuple]]:
    measured, speed = measured_here(steps), bench_tokens_per_s()
    dev = layout_inputs.device_for("cpu", "fp32", 8)
    lines = ["| dp × tp × pp | bytes dp / tp / pp: predicted | measured | AdamW bytes pred. / meas. | "
             "peak activations per stage: predicted | measured | worst error | step (s) predicted | "
             "tokens/s measured |", "|---|---|---|---|---|---|---|---|---|"]
    points = []
    for name, row in measured.items():
        pred, peaks, rank0 = predicted_here(name, dev)
        got = [row[f"comm_bytes_{g}"] for g in GROUPS]
        want = [pred["comm_bytes"][g] for g in GROUPS]
        errors = [abs(p - q) / q for p, q in zip(peaks, row["peak_activation_bytes"])]
        errors.append(abs(rank0["optim_bytes"] - row["optim_bytes"]) / row["optim_bytes"])
        lines.append(f"| {name} | {' / '.join(f'{b:,}' for b in want)} | "
                     f"{' / '.join(f'{b:,}' for b in got)}{'' if got == want else ' ≠'} | "
                     f"{int(rank0['optim_bytes']):,} / {row['optim_bytes']:,} | {', '.join(f'{b:,}' for b in peaks)} | "
                     f"{', '.join(f'{b:,}' for b in row['peak_activation_bytes'])} | {max(errors):.2%} | "
                     f"{pred['step_time_s']:.3f} | {speed[name]:,.0f} |")
        points.append((name, pred["step_time_s"], 16 * 128 / speed[name]))
    rho = spearman([-p[1] for p in points], [1 / p[2] for p in points])
    lines += ["", f"Spearman rank correlation of the predicted step times' order with the measured tokens/s "
                  f"order: {rho:.2f} ({len(points)} layouts)."]
    return lines, points


def published_rows(argv: list[str], layout: dict) -> tuple[str, list[dict], dict | None, int | None]:
    """(device name, every row the planner made, the published layout's row or None, its rank among the
    rows that fit or None)."""
    args = choose_layout.parse_args(argv)
    rows, dev = choose_layout.plan(args)
    fitting = [r for r in rows if r["fits"]]
    matches = [r for r in rows if all(r[k] == v for k, v in layout.items())]
    mine = min(matches, key=lambda r: (not r["fits"], r["step_time_s"])) if matches else None
    rank = fitting.index(mine) + 1 if mine in fitting else None
    return dev.name, rows, mine, rank


def plain_dp_bytes(argv: list[str]) -> int:
    """What plain data parallelism would hold per GPU: the whole model's state and one sequence's activations."""
    args = choose_layout.parse_args(argv)
    cfg = layout_inputs.model_for(args.model)
    run = layout_costs.Run(cfg, args.world, args.seq_len, args.dtype)
    dev = layout_inputs.device_for(args.device, args.dtype, args.world)
    return layout_costs.predict(run, layout_costs.Candidate(args.world, 1, 1, 1, 1, 0, "none", False, "1f1b", 1),
                                dev, 8)["memory_bytes"]["total"]


def check_published() -> tuple[list[str], tuple]:
    lines = ["| configuration | published layout (as planned) | planner's memory per GPU | fits | its rank among "
             "the layouts that fit | planner's first choice | plain DP per GPU |", "|---|---|---|---|---|---|---|"]
    plot_case = None
    for name, argv, layout, source in PUBLISHED:
        device, rows, mine, rank = published_rows(argv, layout)
        fitting = [r for r in rows if r["fits"]]
        best = fitting[0] if fitting else None
        plain = plain_dp_bytes(argv)
        memory = f"{mine['memory_bytes']['total'] / 2**30:,.1f} GiB" if mine else "-"
        first = f"{choose_layout.describe(best)}, {best['step_time_s']:.2f} s" if best else "-"
        versus = f" vs {mine['step_time_s']:.2f} s" if best and mine else ""
        lines.append(f"| {name} ({device}) | {choose_layout.describe(mine) if mine else 'not enumerated'} | "
                     f"{memory} | {'yes' if mine and mine['fits'] else 'no'} | "
                     f"{rank or '-'} of {len(fitting)} | {first}{versus} | {plain / 2**30:,.0f} GiB |")
        plot_case = plot_case or (name, fitting, mine)
    lines += ["", "Sources:"] + [f"- {name}: {source}" for name, _, _, source in PUBLISHED]
    return lines, plot_case


def plot_memory(case, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    name, fitting, mine = case
    shown = fitting[:8] + ([mine] if mine and mine not in fitting[:8] else [])
    parts = ("params", "grads", "optim_bytes", "peak_activation_bytes")
    fig, ax = plt.subplots(figsize=(10, 5))
    left = [0.0] * len(shown)
    for part in parts:
        vals = [r["memory_bytes"][part] / 2**30 for r in shown]
        ax.barh(range(len(shown)), vals, left=left, label=part.replace("_", " "))
        left = [b + v for b, v in zip(left, vals)]
    ax.set_yticks(range(len(shown)), [choose_layout.describe(r) + (" (published)" if r is mine else "") for r in shown],
                  fontsize=7)
    ax.invert_yaxis()
    ax.axvline(80, color="k", ls="--", lw=1, label="80 GiB: one H100")
    ax.set_xlabel("GiB per GPU (the fullest pipeline rank)")
    ax.set_title(f"{name}: the planner's fastest layouts that fit, and the published one")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_here(points, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 5))
    for name, pred, meas in points:
        ax.scatter(pred, meas)
        ax.annotate(name, (pred, meas), fontsize=7)
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("measured step time (s), bench_3d.py")
    ax.set_title("8 ranks on this CPU: predicted against measured")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--published", action="store_true", help="only the published configurations (no runs)")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    RESULTS.mkdir(exist_ok=True)
    lines, case = check_published()
    (RESULTS / "layouts_published.md").write_text("Command: `python 06_context_parallel/check_layouts.py`\n\n"
                                                   + "\n".join(lines) + "\n")
    plot_memory(case, RESULTS / "layouts_memory.png")
    print("\n".join(lines))
    if not args.published:
        lines, points = check_here(args.steps)
        (RESULTS / "layouts_here.md").write_text("Command: `python 06_context_parallel/check_layouts.py`; model tiny, "
                                                 "16 × 128 tokens, 1F1B, fp32, 2 steps per layout (bytes and memory of "
                                                 "the last); bench_3d.py's tokens/s\n\n" + "\n".join(lines) + "\n")
        plot_here(points, RESULTS / "layouts_predicted_vs_measured.png")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
