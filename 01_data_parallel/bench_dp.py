"""Measure data parallelism: throughput of naive, bucketed and torch DDP, and bytes per step.

    python 01_data_parallel/bench_dp.py              # ~2½ minutes on a 2-core CPU

Writes 01_data_parallel/results/dp_bench.md and dp_bench.json.
For each world size N in 1, 2, 4 it launches one `torchrun --nproc_per_node=N` of this file in
worker mode, which runs every implementation inside one process group, interleaved: each round runs
naive, bucketed and torch DDP once, so a slow moment of a shared machine hits all three alike. A
configuration's figure is its median step time over every round (the first steps of each run, which
pay for warm-up, are skipped). Every rank gets one CPU thread: a rank stands for one device, and
1 → 2 ranks on a 2-core machine doubles the cores used, as adding a GPU would.
"""
import argparse
import json
import os
import statistics
import sys
from importlib import import_module
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = Path(__file__).parent / "results"
IMPLS = ("naive", "bucketed", "torch")
SKIP = 2                                      # warm-up steps left out of each run's timings


def worker(args):
    """Inside torchrun: every implementation, `rounds` times, in one process group; rank 0 writes JSON."""
    import torch.distributed as dist
    from common import distributed
    # One thread per rank whatever the world size (the scripts' default gives each rank cores/N).
    os.environ["THREADS_PER_RANK"] = "1"                  # read by init_distributed (set_cpu_threads)
    rt = distributed.init_distributed("cpu", 300)
    train_dp = import_module("01_data_parallel.train_dp")
    flags = ["--steps", str(args.steps), "--bucket-mb", str(args.bucket_mb), "--quiet",
             "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len)]
    times = {impl: [] for impl in IMPLS}
    comm = {}
    for _ in range(args.rounds):
        for impl in IMPLS:
            history = train_dp.main(flags + ["--impl", impl])
            times[impl] += [row["step_time_s"] for row in history[SKIP:]]
            comm[impl] = {"comm_bytes": history[-1]["comm_bytes"], "comm_bytes_sent": history[-1]["comm_bytes_sent"],
                          "loss": history[-1]["loss"]}
    if rt.rank == 0:
        tokens = args.global_batch * args.seq_len
        out = {impl: {"median_step_s": statistics.median(t), "tokens_per_s": tokens / statistics.median(t),
                      **comm[impl]} for impl, t in times.items()}
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int, args) -> dict:
    out = RESULTS / f".dp_bench_w{world}.json"
    from common.launch import launch
    print(f"world {world}: {args.rounds} rounds × {len(IMPLS)} implementations × {args.steps} steps", flush=True)
    launch(__file__, world, ["--worker", "--out", out, "--steps", args.steps, "--rounds", args.rounds,
                             "--bucket-mb", args.bucket_mb, "--global-batch", args.global_batch,
                             "--seq-len", args.seq_len], echo=False)
    result = json.loads(out.read_text())
    out.unlink()
    return result


def report(results: dict, args, argv: list[str]) -> str:
    from common.model import PRESETS, count_parameters
    M = count_parameters(PRESETS["tiny"]) * 4                       # fp32 gradient bytes
    lines = [
        "# Data parallel: throughput and bytes per step", "",
        f"Machine: {os.cpu_count()}-core CPU, gloo backend, fp32, one thread per rank; tiny preset "
        f"({M / 2**20:.2f} MiB of gradients), global batch {args.global_batch} × {args.seq_len} tokens, "
        f"--bucket-mb {args.bucket_mb}; median step time over {args.rounds} interleaved rounds × "
        f"{args.steps - SKIP} timed steps.", "",
        "Command: `python 01_data_parallel/bench_dp.py`" + (" " + " ".join(argv) if argv else ""), "",
        "## Throughput (tokens/s, whole job)", "",
        "| ranks | naive | bucketed | torch DDP | naive / DDP | bucketed / DDP |",
        "|---:|---:|---:|---:|---:|---:|"]
    for world, res in results.items():
        tps = {impl: res[impl]["tokens_per_s"] for impl in IMPLS}
        lines.append(f"| {world} | {tps['naive']:,.0f} | {tps['bucketed']:,.0f} | {tps['torch']:,.0f} | "
                     f"{tps['naive'] / tps['torch']:.2f} | {tps['bucketed'] / tps['torch']:.2f} |")
    lines += ["", "## Bytes per rank per step (from the metrics files' `comm_bytes`)", "",
              "`comm_bytes` counts what a rank sends **plus** what it receives; the ring all-reduce formula "
              "2(N-1)/N·M is one direction, so the measured total is twice the formula.", "",
              "| ranks | formula 2(N-1)/N·M (one way) | measured sent | measured sent + received | = 2 × formula? |",
              "|---:|---:|---:|---:|:---:|"]
    for world, res in results.items():
        formula = 2 * (world - 1) / world * M
        for impl in IMPLS:
            sent, total = res[impl]["comm_bytes_sent"], res[impl]["comm_bytes"]
            same = "yes" if abs(total - 2 * formula) <= 1e-6 * M else "no"
            lines.append(f"| {world} ({impl}) | {formula / 2**20:.3f} MiB | {sent / 2**20:.3f} MiB | "
                         f"{total / 2**20:.3f} MiB | {same} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="1,2,4", help="comma-separated world sizes")
    p.add_argument("--steps", type=int, default=12, help="steps per run (the first 2 are not timed)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per world size")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="bucket size for bucketed and torch DDP")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    RESULTS.mkdir(exist_ok=True)
    results = {int(w): launch(int(w), args) for w in args.worlds.split(",")}
    (RESULTS / "dp_bench.json").write_text(json.dumps(results, indent=1))
    text = report(results, args, sys.argv[1:])
    (RESULTS / "dp_bench.md").write_text(text)
    print(text)


if __name__ == "__main__":
    from common.errors import run_main
    run_main(main)       # its workers, too, leave the way the training scripts do
