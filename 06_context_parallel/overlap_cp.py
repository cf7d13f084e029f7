"""Does the ring's transfer hide under its compute on this machine? One ring step's compute against one hop.

    torchrun --nproc_per_node=2 06_context_parallel/overlap_cp.py --out runs/overlap.json
    (bench_cp.py runs it and writes results/overlap.md and ring_timeline.png from the file)

Two ranks, a ring of cp 2, each with an equal share of the machine's cores (cores ÷ 2 threads, at least one:
common/distributed.py): what a ring step does on a CPU. For every block size c (the positions one rank
holds, S/cp), with the model's heads (h query heads, kv K/V heads of hd each) and `rows` sequences:

    compute  one block pair's attention forward, c queries against c keys, unmasked: ring_attention's own
             attend_block. 4·rows·h·c²·hd FLOPs (q·kᵀ and P·v, 2 FLOPs per multiply-add)
    hop      one K/V block to the next rank while receiving the previous rank's: comm.exchange, the ring's
             own hop. 2·rows·kv·c·hd·4 bytes each way (K and V, fp32)

Compute grows as c², a hop as c (plus a fixed latency), so from some c on a step's compute covers the next
hop: with F the FLOP rate and B the bandwidth, 4·rows·h·c²·hd/F ≥ 8·rows·kv·c·hd/B, that is c ≥ (2·kv/h)·F/B,
the ring-attention paper's c ≥ F/B with this model's K/V size per query head. Then, at every c, a few real
ring forwards (zig-zag, cp 2, S = 2c) record each ring step's posting, compute and wait
(attention_bookkeeping.RingSpans, handed to the ring): the wait is the part of the hop that did not hide under
the compute.
"""
import json
import math
import sys
import time
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters

import torch
import torch.distributed as dist

from common import comm
from common.cli import measurement_parser
from common.distributed import env_world_size, init_distributed, shutdown
from common.errors import require, run_main
from common.model import PRESETS
from common.timeline import Timeline

cp_split = import_module("06_context_parallel.cp_split")              # this chapter: the zig-zag split
ring_attention = import_module("06_context_parallel.ring_attention")  # this chapter: attend_block, the ring
attention_bookkeeping = import_module("06_context_parallel.attention_bookkeeping")  # this chapter: the ring's spans

SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)    # block sizes c swept
MIN_SECONDS = 0.1                            # time each measurement for about this long


def parse_args(argv=None):
    p = measurement_parser(__doc__.splitlines()[0], rows=2, rows_help="sequences in the batch",
                           model_help="whose heads")
    p.add_argument("--layers", type=int, default=6, help="ring forwards in each timeline (default 6)")
    return p.parse_args(argv)


def best_time(fn, tries: int = 5) -> float:
    """Seconds of one `fn()`: the best of `tries` timings of n calls back to back (n from a warm-up call: about
    MIN_SECONDS in all), each divided by n, on the slower of the two ranks (so both hold the same numbers).
    Back to back, the two ranks' calls pace each other as a ring's steps do, and the time one rank leaves a
    barrier before the other is spread over n calls. The best, not the median: on a shared machine another
    process taking a core for a few ms lands in some timings, and the best is what this hardware does."""
    start = time.perf_counter()
    fn()
    first = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(first, op=dist.ReduceOp.MAX)                  # both ranks make the same number of calls
    n = max(1, min(100, math.ceil(MIN_SECONDS / tries / first.item())))
    times = []
    for _ in range(tries):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - start) / n)
    slower = torch.tensor([min(times)])
    dist.all_reduce(slower, op=dist.ReduceOp.MAX)                 # the slower rank's: a ring step waits for it
    return slower.item()


def measure(c: int, rows: int, h: int, kv: int, hd: int, other: int) -> dict:
    q = torch.randn(rows, h, c, hd)                                       # (rows, h, c, hd)
    kv_block = torch.randn(2, rows, kv, c, hd)                            # K and V: (2, rows, kv, c, hd)
    full = [cp_split.Pair(slice(0, c), slice(0, c), None)]                # every query against every key

    def compute():
        out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
        ring_attention.attend_block(q, kv_block, full, out, lse)

    def hop():
        incoming = torch.empty_like(kv_block)
        ring_attention.wait(comm.exchange([(kv_block, incoming)], other, other, None, "cp"))

    return {"c": c, "compute_s": best_time(compute), "hop_s": best_time(hop),
            "flops": 4 * rows * h * c * c * hd, "bytes": kv_block.numel() * kv_block.element_size()}


def crossover(sweep: list[dict]) -> float | None:
    """The c where compute first reaches the hop, interpolated on log scales between the swept sizes."""
    for a, b in zip(sweep, sweep[1:]):
        if a["compute_s"] < a["hop_s"] and b["compute_s"] >= b["hop_s"]:
            ra, rb = (math.log(x["compute_s"] / x["hop_s"]) for x in (a, b))
            return a["c"] * (b["c"] / a["c"]) ** (-ra / (rb - ra))
    return sweep[0]["c"] if sweep[0]["compute_s"] >= sweep[0]["hop_s"] else None


def ring_timeline(c: int, rows: int, h: int, kv: int, hd: int, layers: int, timeline: Timeline) -> list[dict]:
    """`layers` ring forwards (cp 2, zig-zag, S = 2c), each ring step's parts timed; every rank's spans on rank 0."""
    split = cp_split.SequenceSplit(2 * c, 2, "zigzag")
    q, k, v = torch.randn(rows, h, c, hd), torch.randn(rows, kv, c, hd), torch.randn(rows, kv, c, hd)
    ring_attention.ring_attention(q, k, v, dist.group.WORLD, split)      # warm-up, untraced
    timeline.events.clear()
    spans = attention_bookkeeping.RingSpans(timeline)
    for layer in range(layers):
        dist.barrier()              # each forward starts together: what one rank waits for is then the hop,
        timeline.begin_step(layer + 1)   # not the other rank still finishing the previous one
        ring_attention.ring_attention(q, k, v, dist.group.WORLD, split, spans)
    return timeline.gather()


def main(argv=None):
    args = parse_args(argv)
    require(env_world_size() == 2, "a ring of 2 ranks: launch with torchrun --nproc_per_node=2 "
            "06_context_parallel/overlap_cp.py --out PATH")
    rt = init_distributed("cpu")
    cfg = PRESETS[args.model]
    heads = dict(rows=args.rows, h=cfg.n_heads, kv=cfg.n_kv_heads, hd=cfg.head_dim)
    torch.manual_seed(rt.rank)
    with torch.no_grad():
        sweep = [measure(c, **heads, other=1 - rt.rank) for c in SIZES]
        timeline = Timeline(rt.rank)
        timelines = {c: ring_timeline(c, **heads, layers=args.layers, timeline=timeline) for c in SIZES}
    if rt.is_main:
        out = {"model": args.model, **heads, "threads_per_rank": torch.get_num_threads(), "layers": args.layers,
               "sweep": sweep, "crossover_c": crossover(sweep), "timelines": timelines}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    shutdown(rt)


if __name__ == "__main__":
    run_main(main)
