"""How much of tensor parallelism's communication stays exposed, with and without --tp-overlap, on this machine.

    torchrun --nproc_per_node=2 02_tensor_parallel/overlap_tp.py --out runs/overlap_tp2.json
    (bench_tp.py --only overlap runs it at tp 2 and 4; overlap_tp_report.py writes results/tp_overlap.md and
    results/tp_timeline.png from its files)

Each rank builds the model with sequence parallelism twice from the same seed, plain and --tp-overlap, and runs
`--steps` forward + backward passes of each, alternating (no optimizer: nothing a step does differs), with
a timer handed to every TP layer (tp_trace.TPSpans). Per step and rank it sums what the rank spent on TP
communication doing nothing else, the exposed time:

    plain        every all-gather and reduce-scatter (tp_operators.py): a blocking collective is exposed whole
    --tp-overlap each ring step's post and wait (tp_overlap.py): the part of a hop its chunk's matmuls did not cover
                 (the embedding's reduce-scatter, not before a matmul, stays a blocking collective)

Both in wall-clock seconds and in this thread's CPU seconds (cpu_s): ranks that share cores are descheduled
mid-span, which the wall clock counts and the CPU seconds do not. What a CPU can show is limited: gloo moves
the bytes with CPU threads, the same cores the matmuls need (the GPU's copy engines and NVLink are free of
the SMs), so here a hidden hop still costs a core some time.
"""
import json
import os
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters

import torch
import torch.distributed as dist

from common.cli import measurement_parser
from common.data import TextData
from common.distributed import init_distributed, shutdown
from common.errors import run_main
from common.model import PRESETS, build_model
from common.timeline import Timeline

tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")
tp_trace = import_module("02_tensor_parallel.tp_trace")

VARIANTS = {"plain": False, "overlap": True}


def parse_args(argv=None):
    p = measurement_parser(__doc__.splitlines()[0], rows=4, rows_help="sequences per step", model_help="preset")
    p.add_argument("--seq-len", type=int, default=256, help="positions per sequence (default 256)")
    p.add_argument("--steps", type=int, default=3, help="timed steps of each variant (default 3)")
    return p.parse_args(argv)


def forward_backward(model, x, y, group) -> None:
    h = model.embed(x)                                  # (B, S/tp, D)
    for layer in model.layers:
        h = layer(h, model.rope_cos, model.rope_sin)    # the ring (or the collectives) twice per block
    tensor_parallel.tp_loss_sum(model.head(h), y, group).backward()


def exposed_per_step(events: list[dict]) -> dict:
    """{variant: {rank: [(exposed wall s, exposed cpu s, step wall s, step cpu s) per step]}} from the spans."""
    out = {}
    for e in events:
        if e["kind"] == "step":
            out.setdefault(e["variant"], {}).setdefault(e["rank"], {})[e["step"]] = [0.0, 0.0, e["end"] - e["start"],
                                                                                      e["cpu_s"]]
    for e in events:
        if e["kind"] in tp_trace.EXPOSED:
            row = out[e["variant"]][e["rank"]][e["step"]]
            row[0] += e["end"] - e["start"]
            row[1] += e["cpu_s"]
    return {v: {r: [tuple(s[k]) for k in sorted(s)] for r, s in ranks.items()} for v, ranks in out.items()}


def main(argv=None):
    args = parse_args(argv)
    rt = init_distributed("cpu")
    group, cfg = dist.group.WORLD, PRESETS[args.model]
    timeline = Timeline(rt.rank, enabled=False)     # off for the warm-up
    spans = tp_trace.TPSpans(timeline)              # every TP layer's timer, on this timeline
    models = {v: tensor_parallel.parallelize_model(build_model(cfg, 1337), group, True, overlap=o, span=spans)
              for v, o in VARIANTS.items()}
    x, y = TextData(None, args.seq_len, 1337).global_batch(1, args.rows)      # (rows, S), the same on every rank
    for v, model in models.items():                                            # warm-up, untraced
        forward_backward(model, x, y, group)
    timeline.enabled = True
    for step in range(1, args.steps + 1):
        for v, model in models.items():                 # alternating: both see the same machine load
            model.zero_grad(set_to_none=True)
            dist.barrier()                              # each step starts together on every rank
            timeline.begin_step(step)
            first = len(timeline.events)
            with spans("step"):
                forward_backward(model, x, y, group)
            for e in timeline.events[first:]:
                e["variant"] = v
    timeline.enabled = False
    events = timeline.gather()
    if rt.is_main:
        out = {"model": args.model, "tp": rt.world_size, "rows": args.rows, "seq_len": args.seq_len,
               "D": cfg.dim, "layers": cfg.n_layers, "steps": args.steps, "cpu_count": os.cpu_count(),
               "load_average": os.getloadavg()[0],
               "cores_usable": len(os.sched_getaffinity(0)), "threads_per_rank": torch.get_num_threads(),
               "exposed": exposed_per_step(events), "events": events}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out))
    shutdown(rt)


if __name__ == "__main__":
    run_main(main)
