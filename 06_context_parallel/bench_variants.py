"""Chapter 06 benchmark: the four context-parallel attentions side by side, bytes, work and time per rank.

    python 06_context_parallel/bench_variants.py        # launches itself on 8 ranks (about 2 minutes on 2 cores)

Writes 06_context_parallel/results/variants.md (and variants.png, the bytes against cp at S 512): for cp 2, 4, 8 and S 128, 256, 512, one attention call (forward
and backward) of the tiny preset's shapes (8 heads, 4 KV heads, head_dim 16, one sequence, fp32) with each of
ring, allgather, alltoall and alltoall+ring (K = 2): the bytes one rank sends + receives under "cp", counted by
common/comm.py and checked equal to attention_bookkeeping.cp_bytes; the attention work (score entries, forward
and backward: attention_bookkeeping.call_entries), max / min over the CP ranks; and the median time of 3 calls on
the slowest rank. The CP group is ranks 0..cp−1; the other ranks wait.
Bytes and work are the same on every machine; times are this machine's (8 processes sharing its cores).
"""
import argparse
import os
import statistics
import sys
import time
from importlib import import_module
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import comm  # noqa: E402
from common.distributed import init_distributed, shutdown  # noqa: E402
from common.errors import ConfigError  # noqa: E402
from common.launch import launch  # noqa: E402
from common.model import PRESETS  # noqa: E402

context_parallel = import_module("06_context_parallel.context_parallel")       # this chapter: the variants
alltoall_attention = import_module("06_context_parallel.alltoall_attention")   # this chapter: the hybrid's groups
attention_bookkeeping = import_module("06_context_parallel.attention_bookkeeping")  # bytes formula, work
bench_3d = import_module("04_3d_combined.bench_3d")                            # chapter 04: write

WORLD, CPS, SEQS, K, REPEATS = 8, (2, 4, 8), (128, 256, 512), 2, 3
VARIANTS = context_parallel.ATTENTIONS                 # ring, allgather, alltoall, alltoall+ring


def measure(variant: str, cp: int, S: int, group, hybrid) -> dict | None:
    """One variant at one (cp, S) on a CP rank: bytes, work and seconds per call; None where refused."""
    cfg = PRESETS["tiny"]
    args = argparse.Namespace(cp_attention=variant, cp_alltoall=K if variant == "alltoall+ring" else None)
    try:
        context_parallel.check_alltoall(args, cp, cfg)
    except ConfigError:
        return None
    split = context_parallel.sequence_split(argparse.Namespace(seq_len=S, cp_split="zigzag", **vars(args)), cp)
    gen = torch.Generator().manual_seed(S)
    h, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, k, v = (torch.randn(1, n, S // cp, hd, generator=gen, requires_grad=True) for n in (h, kv, kv))
    attention = context_parallel.build_attention(variant, hybrid if variant == "alltoall+ring" else group, split)
    seconds = []
    for _ in range(REPEATS):
        comm.COUNTER.reset()
        dist.barrier(group)
        start = time.perf_counter()
        out = attention(q, k, v)
        out.backward(torch.ones_like(out))
        seconds.append(time.perf_counter() - start)
    counted = comm.COUNTER.total("cp")
    formula = attention_bookkeeping.cp_bytes(variant, 1, S, cp, kv, hd, 4, h=h, K=K)
    assert counted == formula, (variant, cp, S, counted, formula)
    work = 2 * attention_bookkeeping.call_entries(variant, split, dist.get_rank(group), 1, h)   # forward, backward
    stats = torch.tensor([statistics.median(seconds), work, -work], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)            # slowest rank, most and least work
    return {"bytes": counted, "imbalance": stats[1].item() / -stats[2].item(), "seconds": stats[0].item()}


def table(results: dict) -> list[str]:
    lines = ["Command: `python 06_context_parallel/bench_variants.py` (8 ranks; one attention call, forward + "
             "backward, tiny's 8 heads / 4 KV heads / head_dim 16, one sequence, fp32, zig-zag; hybrid K = 2). "
             "Bytes: sent + received by one rank under \"cp\", counted = attention_bookkeeping.cp_bytes on every "
             "rank. Work: max / min over the CP ranks. Time: median of 3 calls, slowest rank, this machine "
             f"({os.cpu_count()} cores shared by 8 processes).", "",
             "| cp | S | " + " | ".join(f"{v} bytes" for v in VARIANTS) + " | alltoall / ring | "
             + " | ".join(f"{v}: work max/min, ms" for v in VARIANTS) + " |",
             "|" + "---|" * (3 + 2 * len(VARIANTS))]
    for (cp, S), row in results.items():
        cells = [f"{row[v]['bytes']:,}" if row[v] else "refused" for v in VARIANTS]
        ratio = (f"{row['alltoall']['bytes'] / row['ring']['bytes']:.2f}" if row["alltoall"] else
                 f"({attention_bookkeeping.cp_bytes('alltoall', 1, S, cp, 4, 16, 4, h=8) / row['ring']['bytes']:.2f} "
                 "by the formula)")
        timing = [f"{row[v]['imbalance']:.2f}, {1e3 * row[v]['seconds']:.1f}" if row[v] else "–" for v in VARIANTS]
        lines.append(f"| {cp} | {S} | " + " | ".join(cells) + f" | {ratio} | " + " | ".join(timing) + " |")
    return lines


def plot(results: dict, path: Path) -> None:
    """Bytes per rank against cp at the longest S, one line per variant (the all-to-all at cp 8 by the formula,
    hollow: tiny's 4 KV heads refuse it there)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    S = SEQS[-1]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for v in VARIANTS:
        got = [(cp, results[cp, S][v]["bytes"]) for cp in CPS if results[cp, S][v]]
        ax.plot(*zip(*got), marker="o", label=v + (f" (K = {K})" if v == "alltoall+ring" else ""))
        missing = [cp for cp in CPS if not results[cp, S][v]]
        if missing:
            ax.plot(missing, [attention_bookkeeping.cp_bytes(v, 1, S, cp, 4, 16, 4, h=8, K=K) for cp in missing],
                    marker="o", mfc="none", ls="none", color=ax.lines[-1].get_color(), label=f"{v}: formula (refused)")
    ax.set(xlabel="cp", ylabel="bytes sent + received per rank", xticks=CPS,
           title=f"one attention call, S {S}, tiny's heads (8, 4 KV)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    if "LOCAL_RANK" not in os.environ:                      # the command a reader types: launch 8 ranks
        launch(Path(__file__).relative_to(HERE.parent), WORLD, [])
        return
    rt = init_distributed("cpu")
    results = {}
    for cp in CPS:
        groups = [dist.new_group(list(range(s, s + cp))) for s in range(0, rt.world_size, cp)]   # every rank, all
        group = groups[rt.rank // cp]
        hybrid = alltoall_attention.HybridGroups(group, K)
        for S in SEQS:
            if rt.rank < cp:                                # CP group 0 measures; the others wait
                results[cp, S] = {v: measure(v, cp, S, group, hybrid) for v in VARIANTS}
            dist.barrier()
    if rt.rank == 0:
        bench_3d.write(HERE / "results" / "variants.md", table(results))
        plot(results, HERE / "results" / "variants.png")
    shutdown(rt)


if __name__ == "__main__":
    main()
