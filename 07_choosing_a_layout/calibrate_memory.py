"""The planner's working set, calibrated on every tensor the course's runs hold here.

    python 07_choosing_a_layout/calibrate_memory.py            # runs them (~7 min on 2 cores), fits, checks
    python 07_choosing_a_layout/calibrate_memory.py --fit-only # the committed runs, fitted and checked again

Each run is chapter 04's train_3d.py for 2 steps with --measure-memory: rank 0 counts every byte its
tensors hold at once during the second step (common/live_memory.py), weights, gradients, AdamW, the saved
activations and the rest. The planner predicts the first four exactly (bytes equal the runs', activations
the ledger's); what it measures beyond them, less the receive buffers chapter 03's executor has posted, is
the working set's transients, which working_set.py writes as copies of a micro-batch's [tokens, width]
tensors: a · t·D + b · t·F/tp. This file fits a and b by least squares on the relative error of the
total, over chapter 04's ten 8-rank layouts of its bench (16 × 128 tokens, 2·pp micro-batches)
and four more whose micro-batches change the tokens per width (the bench's all have t·F/tp equal);
HELD_OUT (recomputation, ZeRO-1 to 3) are measured and compared, never fitted.
The head's moment, h copies of [t, V], is fitted on HEAD_SHAPES: the course's model with a vocabulary far
wider than its blocks, one forward and backward in this process, every tensor counted (no optimizer:
the planner's AdamW bytes are left out of its total there). Each run's predicted total is printed against
the measured one. → results/cpu_working_set.json
"""
import argparse
import json
import math
import sys
from dataclasses import replace
from importlib import import_module
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from common.live_memory import LiveTensors, held_tensors  # noqa: E402
from common.model import PRESETS, build_model, loss_sum  # noqa: E402

bench_3d = import_module("04_3d_combined.bench_3d")                   # chapter 04: the 8-rank layouts
check_layouts = import_module("07_choosing_a_layout.check_layouts")   # this chapter: a short run's last row
layout_costs = import_module("07_choosing_a_layout.layout_costs")
layout_memory = import_module("07_choosing_a_layout.layout_memory")
schedule_costs = import_module("07_choosing_a_layout.schedule_costs")
working_set = import_module("07_choosing_a_layout.working_set")

HEAD_SHAPES = [dict(vocab=4096, dim=64, ffn=128), dict(vocab=8192, dim=64, ffn=96)]   # 2 blocks, 2 × 128 tokens
EXTRA = [dict(dp=8, tp=1, pp=1, m=1), dict(dp=1, tp=8, pp=1, m=8), dict(dp=2, tp=2, pp=2, m=2),
         dict(dp=4, tp=1, pp=2, m=2)]
# measured and checked, never fitted: recomputation and ZeRO, which the fit's runs do not have
HELD_OUT = [dict(dp=2, tp=2, pp=2, m=4, recompute="selective"), dict(dp=2, tp=2, pp=2, m=4, recompute="full"),
            dict(dp=4, tp=1, pp=2, m=4, zero=1), dict(dp=4, tp=2, pp=1, m=2, zero=2),
            dict(dp=4, tp=2, pp=1, m=2, zero=3)]


def layouts() -> list[dict]:
    """Every run: the bench's 8-rank layouts with its micro-batches, then EXTRA (16 × 128 tokens each)."""
    bench = [dict(degrees, m=int(bench_3d.microbatches(degrees)[1])) for ranks, degrees in bench_3d.LAYOUTS.values()
             if ranks == 8]
    return [dict(dp=d["dp"], tp=d["tp"], pp=d["pp"], m=d["m"]) for d in bench] + EXTRA


def name(layout: dict) -> str:
    return (f"{layout['dp']} × {layout['tp']} × {layout['pp']}, m={layout['m']}"
            + (f", recompute {layout['recompute']}" if layout.get("recompute") else "")
            + (f", ZeRO-{layout['zero']}" if layout.get("zero") else ""))


def measure(layout: dict) -> int:
    """Rank 0's most bytes held at once in the second step of a 2-step run of the layout."""
    flags = ["--microbatches", layout["m"], "--dp", layout["dp"], "--tp", layout["tp"], "--pp", layout["pp"],
             "--recompute", layout.get("recompute", "none"), "--zero-stage", layout.get("zero", 0), "--measure-memory"]
    return check_layouts.last_row(flags, 2)["live_peak_bytes"]


def parts(layout: dict) -> tuple[float, tuple, float]:
    """(what the planner holds on rank 0 besides the transients, the two widths, the receives)."""
    run = layout_costs.Run(PRESETS["tiny"], 16, 128, "fp32")
    mode = layout.get("recompute", "none")
    c = layout_costs.Candidate(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], zero_stage=layout.get("zero", 0),
                               recompute=mode, microbatches=layout["m"])
    message = c.layout().message_shape(run.cfg, 16, 128, False)                 # (rows, S, D): one pipeline message
    rows, e = message[0], c.layout().element_size
    peaks = dict(schedule_costs.activation_peaks(run.cfg, mode, "1f1b", c.pp, c.microbatches, 1, rows, 128, 128,
                                                 c.tp, False, "fp32", None))
    memory = layout_memory.rank_memory(run, c, schedule_costs.specs_for(run.cfg, c.pp, 1, 128, "1f1b"), 0, peaks[0],
                                      gloo=True)
    widths = working_set.terms(run.cfg, rows, 128, layout["tp"], e)
    received = working_set.receives(math.prod(message) * e, layout["m"], layout["pp"] == 1, gloo=True)
    backward = sum(memory[k] for k in ("params", "grads", "optim_bytes", "peak_activation_bytes"))   # its moment
    return backward + working_set.recomputed(run, c, rows, 128), widths, received


def head_config(shape: dict):
    return replace(PRESETS["tiny"], vocab_size=shape["vocab"], dim=shape["dim"], ffn_hidden=shape["ffn"], n_layers=2)


def measure_head(shape: dict) -> int:
    """The most bytes one forward and backward of a wide-vocabulary model holds at once, weights included."""
    torch.manual_seed(0)
    cfg = head_config(shape)
    model = build_model(cfg, 0)
    x, y = torch.randint(0, cfg.vocab_size, (2, 128)), torch.randint(0, cfg.vocab_size, (2, 128))
    with LiveTensors(held_tensors(model) + [x, y]) as meter:
        loss_sum(model(x), y).backward()
    return meter.peak


def head_parts(shape: dict) -> tuple[float, int]:
    """(what the planner holds on one device besides the working set and AdamW, one [t, V] in fp32)."""
    cfg = head_config(shape)
    run = layout_costs.Run(cfg, 2, 128, "fp32")
    c = layout_costs.Candidate()                                       # one device
    peaks = dict(schedule_costs.activation_peaks(cfg, "none", "1f1b", 1, 1, 1, 2, 128, 128, 1, False, "fp32", None))
    memory = layout_memory.rank_memory(run, c, schedule_costs.specs_for(cfg, 1, 1, 128), 0, peaks[0], gloo=True)
    return sum(memory[k] for k in ("params", "grads", "peak_activation_bytes")), working_set.logits(cfg, 2, 128, 1)


def fit_head(head_runs: list[dict]) -> float:
    """h: the mean of each run's copies of [t, V] beyond what the planner holds."""
    copies = [(r["live_peak_bytes"] - held) / width for r in head_runs for held, width in [head_parts(r["shape"])]]
    return sum(copies) / len(copies)


def fit(runs: list[dict]) -> tuple[float, float]:
    """(a, b) minimising the relative error of each run's predicted total."""
    rows, targets = [], []
    for r in runs:
        held, widths, received = parts(r["layout"])
        rows.append([w / r["live_peak_bytes"] for w in widths])
        targets.append((r["live_peak_bytes"] - held - received) / r["live_peak_bytes"])
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(targets), rcond=None)
    return tuple(float(x) for x in coef)


def predicted_head(shape: dict, h: float) -> float:
    held, width = head_parts(shape)
    return held + h * width


def predicted(layout: dict, coef) -> float:
    held, widths, received = parts(layout)
    return held + sum(k * w for k, w in zip(coef, widths)) + received


def table(runs: list[dict], head_runs: list[dict], held_out: list[dict], a: float, b: float, h: float) -> list[str]:
    lines = ["| run | measured (rank 0, every tensor) | predicted | error |", "|---|---|---|---|"]
    cases = [(name(r["layout"]), r["live_peak_bytes"], predicted(r["layout"], (a, b))) for r in runs]
    cases += [(name(r["layout"]) + " (held out)", r["live_peak_bytes"], predicted(r["layout"], (a, b)))
              for r in held_out]
    cases += [(f"V {r['shape']['vocab']}, D {r['shape']['dim']}, F {r['shape']['ffn']} (one process)",
               r["live_peak_bytes"], predicted_head(r["shape"], h)) for r in head_runs]
    return lines + [f"| {n} | {m:,} | {p:,.0f} | {p / m - 1:+.1%} |" for n, m, p in cases]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fit-only", action="store_true", help="fit the committed runs again, run nothing")
    args = p.parse_args(argv)
    if args.fit_only:
        committed = json.loads(working_set.COEF_FILE.read_text())
        runs, head_runs, held_out = committed["runs"], committed["head_runs"], committed["held_out"]
    else:
        torch.set_num_threads(1)
        head_runs = [{"shape": shape, "live_peak_bytes": measure_head(shape)} for shape in HEAD_SHAPES]
        runs, held_out = [], []
        for layout in layouts() + HELD_OUT:
            peak = measure(layout)
            (held_out if layout in HELD_OUT else runs).append({"layout": layout, "live_peak_bytes": peak})
            print(f"measured {name(layout)}: {peak:,} bytes", flush=True)
    (a, b), h = fit(runs), fit_head(head_runs)
    working_set.COEF_FILE.write_text(json.dumps({
        "command": "python 07_choosing_a_layout/calibrate_memory.py", "a": a, "b": b, "h": h, "runs": runs,
        "head_runs": head_runs, "held_out": held_out}, indent=1) + "\n")
    print(f"working set: the larger of {a:.2f} · t·D + {b:.2f} · t·F/tp (× element bytes) and, on the head's "
          f"rank, {h:.2f} · t·V/tp (fp32)")
    print("\n".join(table(runs, head_runs, held_out, a, b, h)))


if __name__ == "__main__":
    main()
