"""What the layout planner is worth: its predictions against measured runs here, and published runs at scale.

    python 07_choosing_a_layout/check_layouts.py              # → results/layouts_here.md, layouts_published.md,
                                                             #   layouts_memory.png, layouts_predicted_vs_measured.png
    python 07_choosing_a_layout/check_layouts.py --published  # only the published table and the memory plot (minutes)
    python 07_choosing_a_layout/check_layouts.py --here       # only the runs here (about 3 minutes)
    python 07_choosing_a_layout/check_layouts.py --only gpt3-175b-full   # one published run's row again

Here: every 8-rank layout of chapter 04's bench_3d.py runs 2 steps of train_3d.py with the bench's batch
and micro-batches (~3 min on 2 cores); its metrics hold the bytes each group moved (comm_bytes_*, rank 0),
AdamW's bytes and every stage's measured activation peak, which the planner predicts for the same layout.
The step times are the bench's own (results/3d_bench.md in chapter 04: medians over 11 steps), against
the planner's CPU model (calibrate_cpu.py, fitted on those same runs), and chapter 06's measured CP step
times (its results/time.md), which the fit never saw: Spearman rank correlation and the ratios.
At scale: each published configuration is planned on its cluster; the table gives the planner's memory
per GPU for the published layout (the closest one the planner enumerates), where it ranks, and the
planner's own first choice. Where the authors published a step's memory (torchtitan's Llama 3.1 8B on 8
GPUs, FSDP: the allocator's most reserved GiB per GPU), that is the target: the planner's total for the
layout, its fullest rank at the peak of a step, stands against it, and beside it the same run as
torchtitan's own code holds it and what the caching allocator reserves for that (torchtitan_memory.py).
The last column ranks the published layout again among the layouts its framework is known to fit: those
that hold no more, by the course's count, than a run of that framework held as its source says it ran
(check_published.known_to_fit: Llama 3's 8K layout without activation checkpointing), by the textbook's
bubble and with each schedule run on paper (pipeline_time.fastest_on_paper).
"""
import argparse
import json
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
layout_costs = import_module("07_choosing_a_layout.layout_costs")
layout_memory = import_module("07_choosing_a_layout.layout_memory")
schedule_costs = import_module("07_choosing_a_layout.schedule_costs")
layout_inputs = import_module("07_choosing_a_layout.layout_inputs")
choose_layout = import_module("07_choosing_a_layout.choose_layout")
RESULTS = HERE / "results"
GROUPS = ("dp", "tp", "pp")

published = import_module("07_choosing_a_layout.published")           # this chapter: the published runs
check_published = import_module("07_choosing_a_layout.check_published")   # this chapter: the published table
calibrate_cpu = import_module("07_choosing_a_layout.calibrate_cpu")   # this chapter: the CPU's time model
working_set = import_module("07_choosing_a_layout.working_set")       # this chapter: beyond the ledger


def last_row(flags: list, steps: int) -> dict:
    """The last metrics row of a short 8-rank train_3d.py run of the tiny model on the bench's batch."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "m.jsonl"
        argv = ["--model", "tiny", *bench_3d.BATCH, *flags, "--steps", steps, "--quiet", "--sample-tokens", "0",
                "--val-every", "0", "--metrics", out]
        launch(HERE.parent / "04_3d_combined" / "train_3d.py", 8, argv, echo=False, quiet=True)
        return json.loads(out.read_text().splitlines()[-1])


def measured_here(steps: int) -> dict:
    """{layout name: last metrics row} of a short train_3d.py run per 8-rank layout of bench_3d.py."""
    rows = {}
    for name, (ranks, degrees) in bench_3d.LAYOUTS.items():
        if ranks == 8:
            rows[name] = last_row([*bench_3d.microbatches(degrees),
                                   *(x for k, v in degrees.items() for x in (f"--{k}", v))], steps)
            print(f"measured {name}", flush=True)
    return rows


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
    c = layout_costs.Candidate(dp=dp, tp=tp, pp=pp, microbatches=m)
    specs, plan = schedule_costs.specs_for(run.cfg, pp, 1, 128), schedule_costs.plan_for("1f1b", pp, m, 1)
    peaks = activation_ledger.pipeline_peaks(run.cfg, "none", plan, specs, 16 // dp // m, 128, tp)
    return layout_costs.predict(run, c, dev, 8), peaks, layout_memory.rank_memory(run, c, specs, 0, peaks[0], gloo=True)


def check_here(steps: int) -> tuple[list[str], list[tuple]]:
    measured = measured_here(steps)
    step = {name: t for name, _, t in calibrate_cpu.bench_3d_runs()}
    dev = layout_inputs.device_for("cpu", "fp32", 8)
    lines = ["| dp × tp × pp | bytes dp / tp / pp: predicted | measured | AdamW bytes pred. / meas. | "
             "peak activations per stage: predicted | measured | worst error | step (s) predicted | "
             "measured (bench) | ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
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
                     f"{pred['step_time_s']:.3f} | {step[name]:.3f} | {pred['step_time_s'] / step[name]:.2f}× |")
        points.append((name, pred["step_time_s"], step[name]))
    return lines + ["", time_words(points, "chapter 04's 8-rank layouts (the calibration's own runs)")], points


def check_time() -> tuple[list[str], list[tuple]]:
    """The planner's step times against chapter 06's measured ones, which the CPU calibration did not see."""
    points = [(name, cp_prediction(layout), t) for name, layout, t in calibrate_cpu.time_cp_runs()]
    lines = ["Chapter 06's context-parallel timings (small model, 2 sequences, zig-zag ring; its results/time.md), "
             "which the calibration did not see:", "", "| run | step (s) predicted | measured | ratio |",
             "|---|---|---|---|"] + [f"| {n} | {p:.3f} | {t:.3f} | {p / t:.2f}× |" for n, p, t in points]
    return lines + ["", time_words(points, "chapter 06's runs")], points


def cp_prediction(layout: dict) -> float:
    """The planner's step time for one of chapter 06's timed runs (its world is cp ranks)."""
    run = layout_costs.Run(PRESETS[layout["model"]], layout["batch"], layout["seq"], "fp32")
    c = layout_costs.Candidate(cp=layout["cp"])
    return layout_costs.predict(run, c, layout_inputs.device_for("cpu", "fp32", layout["cp"]), layout["cp"])[
        "step_time_s"]


def time_words(points, what: str) -> str:
    ratios = [p / t for _, p, t in points]
    rho = spearman([p for _, p, _ in points], [t for *_, t in points])
    return (f"Step times on {what}: Spearman rank correlation of predicted with measured {rho:.2f} "
            f"({len(points)} runs); predicted ÷ measured {min(ratios):.2f}–{max(ratios):.2f}.")


def memory_bars(ax, shown: list[dict], labels: list[str], unit: float = 2**30) -> None:
    """One horizontal bar per row: its fullest rank's memory by component, in `unit` bytes."""
    left = [0.0] * len(shown)
    for part in ("params", "grads", "optim_bytes", "peak_activation_bytes", "working"):
        vals = [r["memory_bytes"][part] / unit for r in shown]
        ax.barh(range(len(shown)), vals, left=left, label=part.replace("_", " "))
        left = [b + v for b, v in zip(left, vals)]
    beyond = [working_set.sync_beyond(r["memory_bytes"]) / unit for r in shown]   # the gradient sync's peak, if higher
    if any(beyond):
        ax.barh(range(len(shown)), beyond, left=left, label="gradient copy (sync peak)", hatch="//")
    ax.set_yticks(range(len(shown)), labels, fontsize=7)
    ax.invert_yaxis()


def plot_memory(case, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    name, fitting, mine = case
    shown = fitting[:8] + ([mine] if mine and mine not in fitting[:8] else [])
    fig, ax = plt.subplots(figsize=(10, 5))
    memory_bars(ax, shown, [choose_layout.describe(r) + (" (published)" if r is mine else "") for r in shown])
    ax.axvline(80, color="k", ls="--", lw=1, label="80 GiB: one H100")
    ax.axvline(80 * (1 - working_set.HEADROOM), color="k", ls=":", lw=1, label="less the headroom")
    ax.set_xlabel("GiB per GPU (the fullest pipeline rank)")
    ax.set_title(f"{name}:\nthe planner's fastest layouts that fit, and the published one", loc="right")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")         # the long layout names and the title whole


def plot_here(points, cp_points, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 5))
    for shown, marker, label in ((points, "o", "chapter 04, 8 ranks (calibrated on)"),
                                 (cp_points, "^", "chapter 06, cp ranks (held out)")):
        ax.scatter([p for _, p, _ in shown], [t for *_, t in shown], marker=marker, label=label)
        for name, pred, meas in shown:
            ax.annotate(name, (pred, meas), fontsize=6)
    top = max(t for _, p, t in points + cp_points) * 1.1
    ax.plot([0, top], [0, top], "k--", lw=0.8, label="predicted = measured")
    ax.plot([0, top], [0, top / 2], "k:", lw=0.8, label="2× either way")
    ax.plot([0, top / 2], [0, top], "k:", lw=0.8)
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("measured step time (s), median")
    ax.set_title("This CPU: the planner's step time against the runs'")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--published", action="store_true", help="only the published configurations (no runs)")
    p.add_argument("--here", action="store_true", help="only the runs here (not the published configurations)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--only", choices=list(published.BY_NAME), default=None,
                   help="plan this published run again and replace its row of results/layouts_published.md")
    args = p.parse_args()
    RESULTS.mkdir(exist_ok=True)
    if args.only:
        print(check_published.replace_published_line(args.only, RESULTS / "layouts_published.md"))
        return
    if not args.here:
        lines, case = check_published.table()
        (RESULTS / "layouts_published.md").write_text("Command: `python 07_choosing_a_layout/check_layouts.py`\n\n"
                                                       + "\n".join(lines) + "\n")
        plot_memory(case, RESULTS / "layouts_memory.png")
        print("\n".join(lines))
    if not args.published:
        lines, points = check_here(args.steps)
        more, cp_points = check_time()
        lines += ["", *more]
        (RESULTS / "layouts_here.md").write_text("Command: `python 07_choosing_a_layout/check_layouts.py`; model tiny, "
                                                 "16 × 128 tokens, 1F1B, fp32, 2 steps per layout (bytes and memory of "
                                                 "the last); measured step times: chapter 04's bench_3d.py (medians), "
                                                 "the CPU's time model: calibrate_cpu.py\n\n" + "\n".join(lines) + "\n")
        plot_here(points, cp_points, RESULTS / "layouts_predicted_vs_measured.png")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
