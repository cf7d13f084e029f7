"""The table and the timeline picture of overlap_tp.py's runs: exposed TP communication with and without --tp-overlap.

    python 02_tensor_parallel/bench_tp.py --only overlap     # runs overlap_tp.py at tp 2 and 4, then this
    python 02_tensor_parallel/overlap_tp_report.py A.json [B.json ...] [--png PATH]   # the table of your own runs

Writes results/tp_overlap.md (medians over steps and ranks) and results/tp_timeline.png (one step of every rank,
plain above, --tp-overlap below: the blocking collectives in red; the ring's chunk matmuls in blue with the
hops' posting and waiting in grey and orange).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common`
import common.plots  # noqa: E402,F401  (first: it picks the plot backend, files when headless)
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"collective": "#d62728", "compute": "#1f77b4", "post": "#7f7f7f", "wait": "#ff7f0e"}
LABELS = {"collective": "blocking all-gather / reduce-scatter", "compute": "ring step: chunk matmuls",
          "post": "ring step: post the next hop", "wait": "ring step: wait (exposed)"}


def medians(run: dict, variant: str) -> dict:
    """Median over every (rank, step) of exposed wall s, exposed cpu s, step wall s, step cpu s."""
    rows = [row for per_rank in run["exposed"][variant].values() for row in per_rank]
    keys = ("exposed_s", "exposed_cpu_s", "step_s", "step_cpu_s")
    return {k: statistics.median(r[i] for r in rows) for i, k in enumerate(keys)}


def table(runs: list[dict], command: str) -> str:
    lines = []
    for run in runs:
        plain, ring = medians(run, "plain"), medians(run, "overlap")
        for name, m in (("plain SP", plain), ("--tp-overlap", ring)):
            lines.append(f"| {run['tp']} | {name} | {1e3 * m['exposed_s']:,.0f} | {1e3 * m['step_s']:,.0f} | "
                         f"{m['exposed_s'] / m['step_s']:.2f} | {1e3 * m['step_cpu_s']:,.0f} | "
                         f"{run['load_average']:.1f} |")
    first = runs[0]
    return (f"Exposed TP communication per step (forward + backward, no optimizer), {first['model']} preset "
            f"(D {first['D']}, {first['layers']} layers), {first['rows']} sequences × {first['seq_len']} positions, "
            f"sequence parallelism, fp32, gloo. Machine: {first['cpu_count']}-core CPU ({first['cores_usable']} usable), "
            f"{first['threads_per_rank']} thread per rank: tp 2 gives each rank a core, tp 4 puts two ranks on each "
            f"core. Median over {first['steps']} steps × every rank.\nCommand: `{command}` (from `torchrun "
            "--nproc_per_node=N 02_tensor_parallel/overlap_tp.py` runs).\n\n"
            "| tp | run | exposed TP comm ms / step | step ms | exposed fraction | step CPU ms (this thread) "
            "| load average (1 min) |\n|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n\n"
            "Exposed: wall-clock time inside a blocking all-gather or reduce-scatter (plain), or inside a ring "
            "step's post and wait (--tp-overlap; the embedding's reduce-scatter, before no matmul, stays blocking). "
            "The machine was shared with other work while this ran (the load average column): wall-clock times "
            "then include time a rank waited for a core, and vary from run to run; the step's CPU seconds do not "
            "(the same work in both runs). On a GPU the ring's hops run on copy engines and NVLink while the "
            "SMs multiply; here gloo moves the bytes with CPU threads on the cores the matmuls use.\n")


def plot_timeline(runs: list[dict], out: Path, step: int = 2) -> Path:
    """One step of every rank for each run (tp), plain and --tp-overlap stacked, one colour per span kind."""
    fig, axes = plt.subplots(2 * len(runs), 1, figsize=(12, 1.2 + 0.5 * sum(2 * r["tp"] for r in runs)),
                             gridspec_kw={"height_ratios": [r["tp"] for r in runs for _ in range(2)]})
    for i, run in enumerate(runs):
        for j, variant in enumerate(("plain", "overlap")):
            ax = axes[2 * i + j]
            events = [e for e in run["events"] if e.get("variant") == variant and e["step"] == step]
            t0 = min(e["start"] for e in events)
            for e in events:
                if e["kind"] in COLORS:
                    ax.barh(e["rank"], e["end"] - e["start"], left=e["start"] - t0, height=0.7,
                            color=COLORS[e["kind"]], linewidth=0)
            ax.set_yticks(range(run["tp"]), [f"rank {r}" for r in range(run["tp"])])
            ax.invert_yaxis()
            ax.set_title(f"tp {run['tp']}, {'plain sequence parallelism' if variant == 'plain' else '--tp-overlap'}"
                         f" (step {step})", fontsize=9, loc="left")
            ax.tick_params(labelsize=8)
    axes[-1].set_xlabel("seconds from the step's first span")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, LABELS.values(), loc="upper center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="overlap_tp.py --out files")
    p.add_argument("--png", default=None, help="also draw the timeline picture here")
    args = p.parse_args(argv)
    runs = [json.loads(Path(f).read_text()) for f in args.runs]
    print(table(runs, " ".join(["python 02_tensor_parallel/overlap_tp_report.py"] + args.runs)))
    if args.png:
        print("timeline:", plot_timeline(runs, Path(args.png)))


if __name__ == "__main__":
    main()
