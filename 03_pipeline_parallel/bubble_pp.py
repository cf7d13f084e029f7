"""Chapter 03: the bubble to the millisecond. Theory, a simulation fed with the run's own costs, measurement.

    python 03_pipeline_parallel/bubble_pp.py                          # p = 2: 19 short runs, ~1 min on 2 cores
    python 03_pipeline_parallel/bubble_pp.py --pp 2 4                 # also p = 4 (4 ranks on 2 cores: see README)
    python 03_pipeline_parallel/bubble_pp.py --traces runs/bubble     # keep the traces there
    python 03_pipeline_parallel/bubble_pp.py --traces runs/bubble --reuse   # re-read them, run nothing
    python 03_pipeline_parallel/bubble_pp.py --pp 2 4 --schedules 1f1b zb-v dualpipev --ms 4 8 16   # the V's

Writes 03_pipeline_parallel/results/pp_bubble.md and pp_bubble.png (with --schedules: pp_bubble_v.md and
pp_bubble_v.png, so the classic table stays).
Every schedule (gpipe, 1f1b, interleaved v = 2, zb-h1) runs with m = 1, 2, 4, 8, 16 micro-batches of one
128-token sequence (interleaved: m a multiple of p), 8 steps each with `--timeline`; one torchrun launch
per p runs them all. Steps 2..8 of each trace are read (step 1 warms up). For each step,
pipeline_costs.fit_costs measures what the theory leaves out: the mean F, B, W time of each stage,
each rank's executor gap between two actions, and its hand-over of a message it waited for. Then
schedule_simulator.simulate runs the same schedule on paper three ways, each adding one term:
    stage costs   each action takes its stage's mean time for its kind; messages and gaps are free
    + gaps        and each rank pays its mean executor gap between two actions
    + hand-overs  and each message its receiver waited for costs that rank's mean hand-over: the model,
                  a handful of numbers per run, that the README sets beside the measurement
    own times     the model, but each action takes its own measured time: what the spread adds
and the measured bubble (common/timeline.py's definition, the same as simulate's) is set beside them.
"""
import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.launch import launch  # noqa: E402

HERE = Path(__file__).resolve().parent
OUT = HERE / "results"
SCHEDS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]
MS = (1, 2, 4, 8, 16)
STEPS = 8
COLUMNS = ("theory", "stage costs", "+ gaps", "+ hand-overs", "own times", "measured")


def configs(p: int, scheds=SCHEDS, ms=MS) -> list[tuple[str, int, int]]:
    """(schedule, v, m) of every run at p ranks that its schedule accepts (interleaved needs m a multiple of
    p, dualpipev m ≥ 2p: pipeline_schedules.check_schedule)."""
    schedules = import_module("03_pipeline_parallel.pipeline_schedules")
    return [(name, v, m) for name, v in scheds for m in ms if schedules.accepts(name, p, m, v)]


def chosen(names) -> list[tuple[str, int]]:
    """(schedule, v) of the --schedules names, in the order given (None: the classic four): the stages per
    rank of the schedule (two for the V's), v = 2 for one that takes --virtual-stages."""
    schedules = import_module("03_pipeline_parallel.pipeline_schedules")
    return SCHEDS if not names else [(name, schedules.stages_per_rank(name, 2 if schedules.SCHEDULES[name].virtual
                                                                      else 1)) for name in names]


def trace_path(traces: Path, p: int, name: str, m: int) -> Path:
    return traces / f"p{p}_{name}_m{m}.json"


def worker(p: int, traces: Path, scheds=SCHEDS, ms=MS) -> None:
    """Runs inside torchrun: every configuration in turn, each leaving its trace."""
    import torch.distributed as dist
    from common.distributed import init_distributed
    train_pp = import_module("03_pipeline_parallel.train_pp")
    init_distributed()
    for name, v, m in configs(p, scheds, ms):
        train_pp.main(["--schedule", name, "--virtual-stages", str(v), "--microbatches", str(m),
                       "--global-batch", str(m), "--seq-len", "128", "--steps", str(STEPS), "--warmup", "2",
                       "--quiet", "--timeline", str(trace_path(traces, p, name, m))])
    dist.barrier()
    dist.destroy_process_group()


def analyse(path: Path, name: str, p: int, m: int, v: int) -> dict:
    """Mean over steps 2.. of each column's bubble, and of the fitted costs (ms)."""
    from common.timeline import bubble_fraction, load_trace
    schedules = import_module("03_pipeline_parallel.pipeline_schedules")
    simulator = import_module("03_pipeline_parallel.schedule_simulator")
    costs = import_module("03_pipeline_parallel.pipeline_costs")
    events, _ = load_trace(path)
    plan, n = schedules.build_schedule(name, p, m, v), p * v
    rows = []
    for step in sorted({e["step"] for e in events})[1:]:
        fit = costs.fit_costs(events, step, n)
        rows.append({"theory": schedules.theory_bubble(name, p, m, v),
                     **{col: simulator.simulate(plan, n, **model(fit))["bubble"] for col, model in (
                         ("stage costs", costs.stage_costs), ("+ gaps", partial(costs.mean_costs, handovers=False)),
                         ("+ hand-overs", costs.mean_costs), ("own times", costs.own_times))},
                     **(zero_bubble_what_ifs(fit, p, m) if name == "zb-h1" else {}),
                     "measured": bubble_fraction(events, step),
                     **{f"gap{r}": 1e3 * t for r, t in fit["gap"].items()},
                     **{f"hand-over{r}": 1e3 * t for r, t in fit["handover"].items()},
                     **{f"{k}{s}": 1e3 * t for (k, s), t in fit["cost"].items()}})
    return {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}


def command(pps: list[int], names=None, ms=MS) -> str:
    return ("python 03_pipeline_parallel/bubble_pp.py" + (f" --pp {' '.join(map(str, pps))}" if pps != [2] else "")
            + (f" --schedules {' '.join(names)}" if names else "")
            + (f" --ms {' '.join(map(str, ms))}" if tuple(ms) != MS else ""))


def report(results: dict, run_s: float, names=None, ms=MS) -> str:
    lines = ["# Chapter 03 — the bubble to the millisecond", "",
             f"Command: `{command(sorted(results), names, ms)}` (the runs took {run_s:.0f} s; the simulations, a few seconds)",
             "", "2-core CPU, gloo, fp32, one thread per rank; `tiny` model, m micro-batches of one 128-token "
             f"sequence, {STEPS} steps per run, each column the mean over steps 2..{STEPS}. Measured bubbles and "
             "milliseconds are this machine's, at the moment of the run: other jobs on the machine move them.", "",
             "## Bubble: theory, simulated with the run's own costs, measured", "",
             "| p | schedule | m | " + " | ".join(COLUMNS) + " | measured − model (+ hand-overs) | measured − own times |",
             "|---" * (len(COLUMNS) + 5) + "|"]
    for p, res in sorted(results.items()):
        for (name, v, m), r in res.items():
            lines.append(f"| {p} | {label(name, v)} | {m} | " + " | ".join(f"{r[c]:.3f}" for c in COLUMNS)
                         + f" | {r['measured'] - r['+ hand-overs']:+.3f} | {r['measured'] - r['own times']:+.3f} |")
    lines += ["", "![bubble](pp_bubble.png)", "",
              "## What the simulation was fed (ms, mean over the steps): F, B, W per stage, gap and hand-over per rank", ""]
    for p, res in sorted(results.items()):
        kinds = [f"{k}{s}" for k in "FBW" for s in range(2 * p) if any(f"{k}{s}" in r for r in res.values())]
        kinds += [f"{k}{r}" for k in ("gap", "hand-over") for r in range(p)]
        lines += ["| p | schedule | m | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 3) + "|"]
        for (name, v, m), r in res.items():
            cells = [f"{r[k]:.2f}" if k in r else "" for k in kinds]
            lines.append(f"| {p} | {label(name, v)} | {m} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += zero_bubble_section(results)
    return "\n".join(lines) + "\n"


ZB_STEPS = ("measured costs", "stage 0 split like the last", "+ equal stages", "+ B = W", "+ F = B = W")


def zero_bubble_what_ifs(fit: dict, p: int, m: int) -> dict:
    """The ratio ZB-H1 / 1F1B on ZB-H1's measured compute costs (no gaps, no hand-overs; 1F1B's
    backward is B + W), then with the theory's assumptions put back one at a time, each on top of
    the one before (ZB_STEPS): stage 0's backward split in the last stage's B : W proportion (here its
    B is empty: nobody waits for the gradient of the tokens); every stage costing the mean of the
    stages; B = W, each half of the backward; F = B = W. The last one is the theory's ratio."""
    schedules = import_module("03_pipeline_parallel.pipeline_schedules")
    simulator = import_module("03_pipeline_parallel.schedule_simulator")
    stages = range(p)
    c = dict(fit["cost"])
    chain = [dict(c)]
    w_share = c[("W", p - 1)] / (c[("B", p - 1)] + c[("W", p - 1)])
    back0 = c[("B", 0)] + c[("W", 0)]
    c.update({("B", 0): (1 - w_share) * back0, ("W", 0): w_share * back0})
    chain.append(dict(c))
    c = {(k, s): sum(c[(k, t)] for t in stages) / p for k in "FBW" for s in stages}
    chain.append(dict(c))
    c.update({(k, s): (c[("B", s)] + c[("W", s)]) / 2 for k in "BW" for s in stages})
    chain.append(dict(c))
    c = {(k, s): (c[("F", s)] + c[("B", s)] + c[("W", s)]) / 3 for k in "FBW" for s in stages}
    chain.append(c)

    def bubble(name, cost):
        if name == "1f1b":                                   # the same work, backward not split
            cost = {**cost, **{("B", s): cost[("B", s)] + cost[("W", s)] for s in stages}}
        return simulator.simulate(schedules.build_schedule(name, p, m), p,
                                  lambda r, a: cost[(a.kind, a.stage)])["bubble"]
    return {label: bubble("zb-h1", cost) / bubble("1f1b", cost) for label, cost in zip(ZB_STEPS, chain)}


def zero_bubble_section(results: dict) -> list[str]:
    """ZB-H1 against 1F1B, the same m: the theory's ratio, and what the measured costs make of it."""
    lines = ["## ZB-H1 against 1F1B: bubble ratio zb-h1 / 1f1b", "",
             "\"measured costs\" simulates ZB-H1's run on its own mean compute costs (no gaps, no hand-overs) and "
             "divides by 1F1B on the same costs (its backward = B + W); each next column puts one of the theory's "
             "assumptions back, on top of the previous ones (bubble_pp.zero_bubble_what_ifs); the last column of "
             "them must equal the theory. \"model\" and \"measured\" divide the two runs' bubbles (simulated with "
             "gaps and hand-overs, and measured).", "",
             "| p | m | theory | " + " | ".join(ZB_STEPS) + " | model | measured | F ms per stage | "
             "B, W ms per stage | W / (B + W), last stage |", "|---" * (len(ZB_STEPS) + 8) + "|"]
    for p, res in sorted(results.items()):
        for m in MS:
            zb, one = res.get(("zb-h1", 1, m)), res.get(("1f1b", 1, m))
            if zb is None or one is None:
                continue
            last = p - 1
            cells = [zb["theory"] / one["theory"], *(zb[k] for k in ZB_STEPS),
                     zb["+ hand-overs"] / one["+ hand-overs"], zb["measured"] / one["measured"]]
            lines.append(f"| {p} | {m} | " + " | ".join(f"{c:.2f}" for c in cells)
                         + " | " + ", ".join(f"{zb[f'F{s}']:.1f}" for s in range(p))
                         + " | " + "; ".join(f"{zb[f'B{s}']:.1f}, {zb[f'W{s}']:.1f}" for s in range(p))
                         + f" | {zb[f'W{last}'] / (zb[f'B{last}'] + zb[f'W{last}']):.2f} |")
    return lines


def label(name: str, v: int) -> str:
    return name + (f" v={v}" if v > 1 else "")


def plot(results: dict, out: Path, scheds=SCHEDS, shown_command: str = "") -> None:
    """Bubble against m, one panel per schedule and p: theory, the model, the measurement."""
    from common.plots import save_figure
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(results), len(scheds), figsize=(3.2 * len(scheds), 2.8 * len(results)),
                             squeeze=False, sharey=True)
    for row, (p, res) in zip(axes, sorted(results.items())):
        for ax, (name, v) in zip(row, scheds):
            ms = [m for (n, _, m) in res if n == name]
            for col, style in (("theory", "k--"), ("+ hand-overs", "s:"), ("measured", "o-")):
                ax.plot(ms, [res[(name, v, m)][col] for m in ms], style, label=col if col != "+ hand-overs"
                        else "simulated: stage costs + gaps + hand-overs")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ms, [str(m) for m in ms])
            ax.set_title(f"p = {p}, {label(name, v)}", fontsize=9)
            ax.set_xlabel("micro-batches m")
    axes[0][0].set_ylabel("bubble fraction")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, out, shown_command or command(sorted(results)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2], help="pipeline sizes to run (default: 2)")
    ap.add_argument("--traces", default=None, help="folder for the traces (default: a temporary one)")
    ap.add_argument("--reuse", action="store_true", help="read the traces already in --traces, run nothing")
    ap.add_argument("--schedules", nargs="+", default=None,
                    choices=list(import_module("03_pipeline_parallel.pipeline_schedules").SCHEDULES),
                    help="run only these (default: gpipe 1f1b interleaved zb-h1; results then go to pp_bubble_v.*)")
    ap.add_argument("--ms", type=int, nargs="+", default=list(MS), help="micro-batch counts (default: 1 2 4 8 16)")
    ap.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    traces = Path(args.traces) if args.traces else Path(tempfile.mkdtemp(prefix="bubble_pp_"))
    scheds, ms = chosen(args.schedules), tuple(args.ms)
    if args.worker:
        return worker(args.worker, traces, scheds, ms)
    traces.mkdir(parents=True, exist_ok=True)
    if not args.reuse:
        start = time.perf_counter()
        for p in args.pp:
            launch(__file__, p, ["--worker", p, "--traces", traces, "--ms", *ms]
                   + (["--schedules", *args.schedules] if args.schedules else []))
        (traces / "run_s.txt").write_text(f"{time.perf_counter() - start:.1f}\n")
    results = {p: {(name, v, m): analyse(trace_path(traces, p, name, m), name, p, m, v)
                   for name, v, m in configs(p, scheds, ms)} for p in args.pp}
    OUT.mkdir(exist_ok=True)
    stem = "pp_bubble_v" if args.schedules else "pp_bubble"
    text = report(results, float((traces / "run_s.txt").read_text()), args.schedules, ms)
    (OUT / f"{stem}.md").write_text(text.replace("pp_bubble.png", f"{stem}.png"))
    plot(results, OUT / f"{stem}.png", scheds, command(sorted(results), args.schedules, ms))
    print(text)


if __name__ == "__main__":
    from common.errors import run_main
    run_main(main)
