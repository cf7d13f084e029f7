"""The links inside a node, measured: all-reduces among every rank of a torchrun, the way nccl-tests counts them.

    torchrun --nproc_per_node=8 07_choosing_a_layout/gpu_efficiency.py      # make gpu-efficiency GPUS=8

For each size, `reps` all-reduces of an fp32 tensor of that many bytes after one to warm up (NCCL builds its
rings on the first); a size's time is the slowest rank's mean. Its bus bandwidth is nccl-tests' busbw:

    busbw = size / time · 2(n − 1)/n

what a ring all-reduce moves over each link, each way. That is the rate a device file's tier holds (its line rate
× its efficiency): step_time.link_seconds takes (sent + received) / 2 over it, and a ring all-reduce sends and
receives 2(n − 1)/n of the tensor. The best busbw over the line rate is the tier's efficiency, the smallest
size's time its latency (nothing to move: the cost of one collective). gpu_efficiency.py writes them into the
measured file's first tier; the second (across nodes) stays described unless the ranks span nodes, which this
does not measure. tests/test_gpu_efficiency.py runs it on two CPU ranks with gloo.
"""
import time

import torch
import torch.distributed as dist

GPU_SIZES = (8, 2**20, 2**24, 2**28, 2**30)          # bytes: the latency, then 1 MiB to 1 GiB
GPU_REPS = 20


def busbw(nbytes: int, seconds: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce of `nbytes` that took `seconds` among `ranks` (bytes/s)."""
    return nbytes / seconds * 2 * (ranks - 1) / ranks


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def all_reduce_seconds(sizes, reps: int, device) -> list[tuple[int, float]]:
    """[(bytes, seconds of one all-reduce of them: the slowest rank's mean over `reps`)] for each size."""
    out = []
    for size in sizes:
        t = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        dist.all_reduce(t)
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(t)
        _sync(device)
        slowest = torch.tensor([(time.perf_counter() - start) / reps], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out.append((t.numel() * 4, slowest.item()))
    return out


def summary(times: list[tuple[int, float]], ranks: int) -> dict:
    """{"busbw": the best bus bandwidth (bytes/s), "at": the size it was reached at (bytes), "latency": the
    smallest size's seconds, "ranks": ranks, "sizes": every (bytes, seconds)}."""
    best = max(times[1:] or times, key=lambda row: busbw(*row, ranks))
    return {"busbw": busbw(*best, ranks), "at": best[0], "latency": min(times)[1], "ranks": ranks, "sizes": times}


def measure(sizes=GPU_SIZES, reps: int = GPU_REPS, device="cuda") -> dict:
    """summary() of all-reduces among every rank of the process group."""
    return summary(all_reduce_seconds(sizes, reps, device), dist.get_world_size())
