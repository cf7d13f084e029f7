"""The planner's step time on this CPU, calibrated on runs the course measured here.

    python 07_choosing_a_layout/calibrate_cpu.py     # → results/cpu_time_model.json and its check (seconds)

On a CPU every rank of a run shares a few cores, so a step is not "compute, then the messages": the
operating system slices the cores between W ranks, and a collective can only finish once each of its
members has had its slice. The model is therefore one rank's work, stretched by the W/C ranks each core
carries:

    step = (W / C) · ( FLOPs of one rank · s_flop  +  its collectives · s_call  +  its bytes · s_byte )

    s_flop   seconds per model FLOP on one core (1 / (the probed peak × an efficiency): the share of the
             probe's best matmul that a run's many small kernels reach)
    s_call   seconds one collective or message costs a rank, mostly waiting for its partners' slices: far
             more than gloo's latency between two idle processes (common/mfu's link probe)
    s_byte   seconds per byte a rank sends + receives, the copies through shared memory included

FLOPs, collectives and bytes per rank are the planner's own (common/mfu.flops_per_token,
layout_costs.rank_traffic), so the three constants are all this file fits. It fits them on chapter 04's
8-rank bench (results/3d_bench.md: ten layouts of dp × tp × pp and the 1-rank run, median step times) by
least squares on the relative error, and checks them on runs it did not see: chapter 06's context-parallel
timings (results/time.md: S 128–512, cp 1, 2, 4). Both tables come from commands their headers name; rerun
those benches on another machine, then this file, and the planner's CPU times follow that machine.
"""
import json
import re
import sys
from importlib import import_module
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from common import mfu  # noqa: E402
from common.model import PRESETS  # noqa: E402

layout_costs = import_module("07_choosing_a_layout.layout_costs")
schedule_costs = import_module("07_choosing_a_layout.schedule_costs")
MODEL_FILE = HERE / "results" / "cpu_time_model.json"
BENCH_3D = HERE.parent / "04_3d_combined" / "results" / "3d_bench.md"
TIME_CP = HERE.parent / "06_context_parallel" / "results" / "time.md"
CORES = 2                                                   # the machine both tables were measured on


def bench_3d_runs() -> list[tuple[str, dict, float]]:
    """(name, layout, measured seconds per step) of chapter 04's bench: tiny, 16 × 128 tokens, 1F1B."""
    out = []
    for name, ranks, step in re.findall(r"^\| (\d × \d × \d) \| (\d+) \| ([\d.]+) \|", BENCH_3D.read_text(), re.M):
        dp, tp, pp = (int(x) for x in name.split(" × "))
        m = 2 * pp if 16 % (dp * 2 * pp) == 0 else 16 // dp            # bench_3d.microbatches
        out.append((name, dict(model="tiny", dp=dp, tp=tp, pp=pp, cp=1, m=m, batch=16, seq=128), float(step)))
    return out


def time_cp_runs() -> list[tuple[str, dict, float]]:
    """(name, layout, measured seconds per step) of chapter 06's time table: small, 2 sequences, zig-zag ring."""
    out = []
    for S, *cells in re.findall(r"^\| (\d+) \| ([\d.]+) \([\d,]+\) \| ([\d.]+) \([\d,]+\) \| ([\d.]+) \(",
                                TIME_CP.read_text(), re.M):
        for cp, step in zip((1, 2, 4), cells):
            out.append((f"cp {cp}, S {S}", dict(model="small", dp=1, tp=1, pp=1, cp=cp, m=1, batch=2, seq=int(S)),
                        float(step)))
    return out


def per_rank_work(layout: dict) -> tuple[float, float, float, float]:
    """(W / C, one rank's model FLOPs, its collectives and messages, its bytes sent + received) per step."""
    cfg, L = PRESETS[layout["model"]], layout
    run = layout_costs.Run(cfg, L["batch"], L["seq"], "fp32")
    c = layout_costs.Candidate(dp=L["dp"], tp=L["tp"], pp=L["pp"], cp=L["cp"], microbatches=L["m"])
    nbytes, msgs = layout_costs.rank_traffic(run, c, schedule_costs.specs_for(cfg, L["pp"], 1, L["seq"]))
    world = c.layout().world
    flops = mfu.flops_per_token(cfg, L["seq"]) * L["batch"] * L["seq"] / world
    return world / CORES, flops, sum(msgs.values()), sum(nbytes.values())


def predict(coef, layout: dict) -> float:
    stretch, flops, calls, nbytes = per_rank_work(layout)
    return stretch * (coef[0] * flops + coef[1] * calls + coef[2] * nbytes)


def fit(runs) -> list[float]:
    """(s_flop, s_call, s_byte) minimising the squared relative error of the predicted step times."""
    X = np.array([[s * f, s * c, s * b] for s, f, c, b in (per_rank_work(layout) for _, layout, _ in runs)])
    y = np.array([t for *_, t in runs])
    coef, *_ = np.linalg.lstsq(X / y[:, None], np.ones(len(y)), rcond=None)
    return [float(x) for x in coef]


def main() -> dict:
    fitted_on, held_out = bench_3d_runs(), time_cp_runs()
    s_flop, s_call, s_byte = coef = fit(fitted_on)
    peak = mfu.peak_flops("cpu", "fp32") / torch.get_num_threads()      # one core's, as layout_inputs.cpu
    model = {"cpu": mfu.cpu_model(), "cores": CORES, "seconds_per_flop": s_flop, "seconds_per_call": s_call,
             "seconds_per_byte": s_byte, "efficiency": 1 / (s_flop * peak),
             "fitted_on": str(BENCH_3D.relative_to(HERE.parent)), "checked_on": str(TIME_CP.relative_to(HERE.parent)),
             "command": "python 07_choosing_a_layout/calibrate_cpu.py",
             "runs": [{"run": name, "set": part, "measured_s": t, "predicted_s": predict(coef, layout)}
                      for part, runs in (("fitted", fitted_on), ("held out", held_out)) for name, layout, t in runs]}
    MODEL_FILE.parent.mkdir(exist_ok=True)
    MODEL_FILE.write_text(json.dumps(model, indent=1) + "\n")
    print(f"s_flop {s_flop:.3g} s (efficiency {model['efficiency']:.2f} of the probed peak), s_call {s_call * 1e3:.2f} "
          f"ms, s_byte {s_byte * 1e9:.2f} ns ({1 / s_byte / 1e9:.2f} GB/s)")
    for r in model["runs"]:
        print(f"  {r['set']:8s} {r['run']:12s} measured {r['measured_s']:.3f} s, predicted {r['predicted_s']:.3f} s "
              f"({r['predicted_s'] / r['measured_s']:.2f}×)")
    return model


def load() -> dict | None:
    """The calibration, if this CPU has one (results/cpu_time_model.json for the CPU it names)."""
    try:
        model = json.loads(MODEL_FILE.read_text())
    except (OSError, ValueError):
        return None
    return model if model["cpu"] == mfu.cpu_model() else None


if __name__ == "__main__":
    main()
