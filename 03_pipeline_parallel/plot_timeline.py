"""Draw pipeline timelines: per-rank Gantt charts, several schedules stacked, bubble vs theory.

    # real runs, stacked for comparison: traces written with --timeline PATH by train_pp.py,
    # train_1f1b.py, train_gpipe.py (chapter 03), 04_3d_combined/train_3d.py or 05_moe_expert_parallel/train_4d.py
    python 03_pipeline_parallel/plot_timeline.py runs/gpipe.json runs/1f1b.json --out runs/compare.png
    # on paper: unit costs F=1, B=2 (zero-bubble: B=1, W=1); nothing runs
    python 03_pipeline_parallel/plot_timeline.py --simulate gpipe:4:8 1f1b:4:8 interleaved:4:8:2 zb-h1:4:8 --out sim.png
    python 03_pipeline_parallel/plot_timeline.py --simulate 1f1b:4:8 zb-h1:4:8 zb-v:4:8 dualpipev:4:8 --out v.png

Each box is one action with its micro-batch number (F blue, B green, W orange); grey is idle time
inside the step (no F, B, W or BW running). Real runs also show, as thin strips under the boxes, the
time a rank was blocked waiting for a message (recv, red) and spent posting sends (send, purple).
The legend lists only the kinds the figure shows (no W without zero bubble). Stacked panels share
one time axis, so a schedule with a shorter step is visibly shorter. The title of each panel gives
the bubble measured on that timeline (idle share of ranks × step time) next to the theory
(p-1)/(m+p-1), or (p-1)/(v·m+p-1) for interleaved.
"""
import argparse
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib

matplotlib.use("Agg") if __name__ == "__main__" else None
import matplotlib.pyplot as plt  # noqa: E402

from common.timeline import COMPUTE, bubble_fraction, idle_events, load_trace  # noqa: E402

pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")
schedule_simulator = import_module("03_pipeline_parallel.schedule_simulator")
COLORS = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452", "BW": "#8c8c3c", "idle": "#dddddd", "recv": "#c44e52", "send": "#8172b3"}
LABELS = {"F": "forward F", "B": "backward B", "W": "weight-grad W", "BW": "whole backward BW", "idle": "idle",
          "recv": "waiting for a recv", "send": "posting / waiting for sends"}
MESSAGES = ("send", "recv")


def simulated_events(name: str, p: int, m: int, v: int = 1) -> tuple[list[dict], dict]:
    """A schedule's timeline on paper (unit costs), as timeline events + metadata."""
    v = pipeline_schedules.stages_per_rank(name, v)            # the V schedules: always two stages per rank
    sim = schedule_simulator.simulate(pipeline_schedules.build_schedule(name, p, m, v), p * v)
    scale = 1 / v                                  # a chunk is 1/v of a stage: same total work for any v
    events = [{"rank": r, "step": 1, "kind": a.kind, "mb": a.mb, "stage": a.stage,
               "start": s * scale, "end": e * scale} for r, a, s, e in sim["events"]]
    return events, {"schedule": name, "pp": p, "microbatches": m, "virtual_stages": v, "impl": "simulated",
                    "theory_bubble": pipeline_schedules.theory_bubble(name, p, m, v)}


def step_of(events: list[dict], step: int | None) -> list[dict]:
    """The compute and message spans of one step (default: the last), shifted so that its first
    compute starts at 0 (every rank's times are on one clock: see common/timeline.py)."""
    steps = sorted({e["step"] for e in events if e["kind"] in COMPUTE})
    step = steps[-1] if step is None else step
    evs = [e for e in events if e["step"] == step and e["kind"] in COMPUTE + MESSAGES]
    t0 = min(e["start"] for e in evs if e["kind"] in COMPUTE)
    return [{**e, "start": e["start"] - t0, "end": e["end"] - t0} for e in evs]


def draw(ax, events: list[dict], meta: dict, unit: str = "ms") -> float:
    """One panel: a row per rank. Returns the measured bubble fraction."""
    scale = 1e3 if unit == "ms" else 1.0
    ranks = sorted({e["rank"] for e in events})
    for e in idle_events(events):
        ax.barh(e["rank"], (e["end"] - e["start"]) * scale, left=e["start"] * scale, color=COLORS["idle"],
                hatch="//", edgecolor="#bbbbbb", linewidth=0)
    v = meta.get("virtual_stages", 1)
    p = meta.get("pp", len(ranks))
    for e in events:
        width = (e["end"] - e["start"]) * scale
        if e["kind"] in MESSAGES:                  # a thin strip along the bottom of the rank's row
            ax.barh(e["rank"] + 0.3, width, left=e["start"] * scale, height=0.2, color=COLORS[e["kind"]])
            continue
        ax.barh(e["rank"], width, left=e["start"] * scale, color=COLORS[e["kind"]], edgecolor="white",
                alpha=1.0 if v == 1 or e.get("stage", 0) // p == 0 else 0.65)
        ax.text((e["start"] + e["end"]) / 2 * scale, e["rank"], str(e.get("mb", "")), ha="center",
                va="center", fontsize=7, color="white")
    bubble = bubble_fraction(events)
    title = (f"{meta.get('schedule')} ({meta.get('impl', 'ours')}): p={p} m={meta.get('microbatches')}"
             + (f" v={v}" if v > 1 else "")
             + f" — bubble {'simulated' if meta.get('impl') == 'simulated' else 'measured'} {bubble:.3f},"
             + f" theory {meta.get('theory_bubble', float('nan')):.3f}")
    ax.set_title(title, fontsize=9, loc="left")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)        # rank 0 on top
    ax.set_xlabel("time (ms)" if unit == "ms" else "time (units: F = 1)", fontsize=8)
    return bubble


def plot(panels: list[tuple[list[dict], dict]], out, unit: str = "ms", suptitle: str | None = None):
    """Stack several timelines (each (events, metadata)) in one figure, on ONE time axis, and save it."""
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False, figsize=(12, 1.0 + 0.45 * sum(
        len({e["rank"] for e in ev}) + 1.5 for ev, _ in panels)))
    for ax, (events, meta) in zip(axes[:, 0], panels):
        draw(ax, events, meta, unit)
        ax.xaxis.set_tick_params(labelbottom=True)          # every panel keeps its tick labels
    kinds = legend_kinds(panels)
    labels = {**LABELS, "B": "backward B (input-grad only where W follows)"} if "W" in kinds else LABELS
    fig.legend([plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in kinds], [labels[k] for k in kinds],
               loc="lower center", ncol=len(kinds), fontsize=8)
    if suptitle:
        fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def legend_kinds(panels: list[tuple[list[dict], dict]]) -> list[str]:
    """The kinds of box and strip the panels show, in COLORS order: a legend lists nothing else."""
    shown = {e["kind"] for events, _ in panels for e in events}
    if any(idle_events(events) for events, _ in panels):
        shown.add("idle")
    return [k for k in COLORS if k in shown]


def plot_bubble(measured: dict[int, tuple[list[int], list[float]]], out, title: str, schedule: str = "1f1b"):
    """Measured bubble against micro-batches, one colour per p: measured solid, theory dashed.
    measured: {p: (ms, bubble fractions)}."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, (p, (ms, values)) in enumerate(sorted(measured.items())):
        color = f"C{i}"
        ax.plot(ms, values, "o-", color=color, label=f"measured p={p}")
        ax.plot(ms, [pipeline_schedules.theory_bubble(schedule, p, m) for m in ms], "--", color=color,
                label=f"theory (p−1)/(m+p−1), p={p}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble fraction")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*", help="trace JSON files written with --timeline PATH by train_pp.py, "
                    "train_1f1b.py, train_gpipe.py, 04_3d_combined/train_3d.py or 05_moe_expert_parallel/train_4d.py")
    ap.add_argument("--simulate", nargs="*", default=[], metavar="NAME:P:M[:V]",
                    help="schedules to draw from unit costs, e.g. 1f1b:4:8 interleaved:4:8:2")
    ap.add_argument("--step", type=int, default=None, help="which step of the traces (default: the last)")
    ap.add_argument("--out", default="runs/timeline.png")
    args = ap.parse_args(argv)
    if not args.traces and not args.simulate:
        ap.error("give trace files or --simulate schedules")
    if args.traces and args.simulate:
        ap.error("real runs (ms) and simulated schedules (units) share no time axis: draw them in two figures")
    panels = []
    for path in args.traces:
        events, meta = load_trace(path)
        panels.append((step_of(events, args.step), meta))
    for spec in args.simulate:
        name, *nums = spec.split(":")
        panels.append(simulated_events(name, *map(int, nums)))
    unit = "ms" if args.traces else "units"
    print(plot(panels, args.out, unit, "simulated, unit costs" if not args.traces else None))


if __name__ == "__main__":
    main()
