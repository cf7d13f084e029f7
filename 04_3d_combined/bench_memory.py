"""What a rank holds per --recompute mode: measured bytes against the activation ledger, and step time.

    python 04_3d_combined/bench_memory.py --rounds 2 --steps 4    # → results/memory.md, .json, .png; ~10 min on 2 cores

Layouts: 1 rank (train_dp.py), TP 2 and TP 2 + SP (train_tp.py), 1F1B over 2 stages with 4
micro-batches (train_pp.py; rank 0 = stage 0), each in the three modes, at two sequence lengths with
the same tokens per step: the default run (tiny, S = 128, global batch 16) and a 4× longer sequence
(S = 512, global batch 4; tiny's RoPE tables stop at 256 positions, so this one runs the small preset).
Bytes are counts of tensors (the same on any machine); the step times are paired: in each round the
three modes of a layout run back to back, and the table gives the median over rounds of each mode's
median step (step 1 left out) divided by that of `none`.
"""
import json
import statistics
from importlib import import_module
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from common.launch import launch  # noqa: E402
from common.model import PRESETS  # noqa: E402
from common.plots import plt  # noqa: E402
from common.recompute import MODES  # noqa: E402

from bench_3d import bench_args, write  # noqa: E402

pipeline_stages = import_module("03_pipeline_parallel.pipeline_stages")   # chapter 03's FLOP model

LAYOUTS = {  # name: (script, ranks, flags)
    "1 rank": ("01_data_parallel/train_dp.py", 1, []),
    "TP 2": ("02_tensor_parallel/train_tp.py", 2, ["--tp", "2"]),
    "TP 2 + SP": ("02_tensor_parallel/train_tp.py", 2, ["--tp", "2", "--sequence-parallel"]),
    "1F1B pp 2": ("03_pipeline_parallel/train_pp.py", 2, ["--pp", "2", "--schedule", "1f1b", "--microbatches", "4"]),
}
RUNS = {"default, S = 128": ["--model", "tiny", "--seq-len", "128", "--global-batch", "16"],
        "S × 4 = 512": ["--model", "small", "--seq-len", "512", "--global-batch", "4"]}
PARTS = ("param_bytes", "grad_bytes", "optim_bytes", "peak_activation_bytes")


def first(value):
    """Rank 0's value: a pipeline row holds one per stage."""
    return value[0] if isinstance(value, list) else value


def measure(rounds: int, steps: int) -> dict:
    """{run: {layout: {mode: {"row": last metrics row, "times": [median step per round]}}}}"""
    out = {run: {name: {m: {"times": []} for m in MODES} for name in LAYOUTS} for run in RUNS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for run, run_flags in RUNS.items():
                for name, (script, ranks, flags) in LAYOUTS.items():
                    for mode in MODES:                         # paired: the three modes back to back
                        path = Path(tmp) / "m.jsonl"
                        path.unlink(missing_ok=True)
                        launch(script, ranks, [*run_flags, *flags, "--recompute", mode, "--steps", str(steps),
                                               "--quiet", "--metrics", str(path)], echo=False, quiet=True)
                        rows = [json.loads(line) for line in path.read_text().splitlines()]
                        cell = out[run][name][mode]
                        cell["row"] = rows[-1]
                        cell["times"].append(statistics.median(h["step_time_s"] for h in rows[1:]))
                    print(f"round {r + 1}: {run}: {name}", flush=True)
    return out


def time_prediction(run_flags: list[str]) -> float:
    """Full recompute's step time over none's: it reruns the blocks' forward, F_blocks / (3·F) more
    work in a step whose backward costs two forwards (chapter 03's FLOP model); selective adds only
    elementwise work, counted as nothing."""
    cfg, seq = PRESETS[run_flags[run_flags.index("--model") + 1]], int(run_flags[run_flags.index("--seq-len") + 1])
    cost = pipeline_stages.layer_costs(cfg, seq)
    blocks = cfg.n_layers * cost["layer"]
    return 1 + blocks / (3 * (blocks + cost["head"]))


def table(results: dict, rounds: int, steps: int) -> list[str]:
    mib = lambda b: f"{b / 2**20:.2f}"      # noqa: E731
    lines = ["Activation bytes of rank 0 at its peak (a pipeline: stage 0), measured and predicted by "
             "common/activation_ledger.py; saved = 1 − mode/none. Bytes: the same on every machine.", "",
             "| run | layout | mode | measured MiB | predicted MiB | pred./meas. − 1 | saved vs none |",
             "|---|---|---|---|---|---|---|"]
    for run, layouts in results.items():
        for name, modes in layouts.items():
            none = first(modes["none"]["row"]["peak_activation_bytes"])
            for mode, cell in modes.items():
                got, want = first(cell["row"]["peak_activation_bytes"]), first(cell["row"]["activation_bytes_predicted"])
                lines.append(f"| {run} | {name} | {mode} | {mib(got)} | {mib(want)} | {want / got - 1:+.1e} "
                             f"| {1 - got / none:.0%} |")
    lines += ["", f"Step time over `none`'s (paired runs, median of {rounds} round(s) × {steps} steps, step 1 left "
              "out; times vary by machine). Predicted: full reruns every block's forward (chapter 03's FLOP "
              "model: blocks / (3 × model)); selective only elementwise work (1.00).", "",
              "| run | layout | none s/step | selective / none | full / none | full predicted |", "|---|---|---|---|---|---|"]
    for run, layouts in results.items():
        for name, modes in layouts.items():
            base = modes["none"]["times"]
            ratio = lambda m: statistics.median(t / b for t, b in zip(modes[m]["times"], base))   # noqa: E731
            lines.append(f"| {run} | {name} | {statistics.median(base):.3f} | {ratio('selective'):.2f} "
                         f"| {ratio('full'):.2f} | {time_prediction(RUNS[run]):.2f} |")
    return lines


def plot(results: dict, path: Path) -> None:
    """Stacked bars: rank 0's parameters, gradients, AdamW state and peak activations, per layout and mode."""
    runs = list(results)
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.2), sharey=False)
    for ax, run in zip(axes, runs):
        labels, bottoms = [], []
        for name, modes in results[run].items():
            for mode, cell in modes.items():
                labels.append(f"{name}\n{mode}")
                bottoms.append([first(cell["row"][p]) / 2**20 for p in PARTS])
        base = [0.0] * len(labels)
        for i, part in enumerate(("parameters", "gradients", "AdamW state", "activations (peak)")):
            heights = [b[i] for b in bottoms]
            ax.bar(range(len(labels)), heights, bottom=base, label=part)
            base = [x + h for x, h in zip(base, heights)]
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
        ax.set_title(run)
        ax.set_ylabel("MiB on rank 0")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main():
    args = bench_args(__doc__.splitlines()[0])
    results = measure(args.rounds, args.steps)
    out = Path(args.out or HERE / "results" / "memory.md")
    command = f"python 04_3d_combined/bench_memory.py --rounds {args.rounds} --steps {args.steps}"
    write(out, [f"Command: `{command}`", ""] + table(results, args.rounds, args.steps))
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
