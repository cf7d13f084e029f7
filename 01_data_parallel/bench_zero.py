"""Measure ZeRO: memory per rank against the formulas, and throughput against PyTorch's own.

    python 01_data_parallel/bench_zero.py            # ~2½ minutes on an idle 2-core CPU

Writes 01_data_parallel/results/zero_memory.md, zero_memory.png and zero_throughput.md.
For each world size N in 1, 2, 4 it launches one `torchrun --nproc_per_node=N` of this file in
worker mode, which runs every configuration inside one process group, one after another:
  memory      ours, stages 1-3, a few steps: bytes at rest per rank from the metrics (and PyTorch's
              local shard sizes for comparison);
  throughput  (N > 1) ours stages 1-3, PyTorch's stages 1-3 and bucketed DP, interleaved:
              every repeat runs every configuration once, so slow moments of a shared machine hit
              them all alike; each configuration's median step time over all repeats is reported.
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
from common.launch import launch  # noqa: E402

train_zero = import_module("01_data_parallel.train_zero")
zero_accounting = import_module("01_data_parallel.zero_accounting")

RESULTS = Path(__file__).parent / "results"
MACHINE = f"{os.cpu_count()}-core CPU, gloo, fp32"
ALPHA = 2


def worker(args):
    """Inside torchrun: run every configuration in one process group; rank 0 writes the JSON."""
    import torch.distributed as dist
    from common.distributed import init_distributed
    rt = init_distributed("cpu", 120)
    train_dp = import_module("01_data_parallel.train_dp")
    shape = ["--model", args.model, "--seq-len", str(args.seq_len), "--global-batch", str(args.global_batch),
             "--quiet"]
    out = {"world": rt.world_size, "memory": {}, "throughput": {}}
    for impl in ("ours", "torch"):
        for s in (1, 2, 3):
            hist = train_zero.main(shape + ["--steps", "2", "--zero-stage", str(s), "--impl", impl])
            out["memory"][f"{impl}-{s}"] = hist[-1]
    if rt.world_size > 1:
        configs = {f"{impl}-{s}": (train_zero.main, ["--zero-stage", str(s), "--impl", impl])
                   for s in (1, 2, 3) for impl in ("ours", "torch")}
        configs["dp-bucketed"] = (train_dp.main, ["--impl", "bucketed"])
        times = {k: [] for k in configs}
        for _ in range(args.repeats):
            for name, (fn, flags) in configs.items():
                hist = fn(shape + ["--steps", str(args.steps)] + flags)
                times[name] += [row["step_time_s"] for row in hist[2:]]      # skip warm-up steps
        out["throughput"] = {k: statistics.median(v) for k, v in times.items()}
    if rt.rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def mib(n) -> str:
    return f"{n / 2**20:.2f}"


def write_memory(runs: dict, M: int, args) -> None:
    lines = [f"# ZeRO memory per rank (bytes at rest) — {MACHINE}", "",
             f"Model `{args.model}`: M = {mib(M)} MiB of fp32 parameters, α = {ALPHA} (AdamW's two moments). "
             "Plain DP holds M(1+1+α) = " f"{mib(zero_accounting.zero_memory_bytes(0, M, 1))} MiB per rank at any N. "
             "Measured = `param_bytes + grad_bytes + optim_bytes` from the metrics of "
             "`train_zero.py` (ours; padding to a multiple of N included). "
             "PyTorch's column: sizes of its local parameter / gradient shards and optimizer state.", "",
             f"Command: `python 01_data_parallel/bench_zero.py` (model {args.model}, seq-len {args.seq_len}, "
             f"global batch {args.global_batch}).", "",
             "| N | stage | formula | formula MiB | ours params | ours grads | ours optim | ours total MiB "
             "| ours − formula (B) | stage-3 peak gathered MiB | comm sent/step MiB (formula) | PyTorch total MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    comm_formula = {1: 3, 2: 2, 3: 3}          # × (N-1)/N·M sent per step
    for N, run in sorted(runs.items()):
        for s in (1, 2, 3):
            row, trow = run["memory"][f"ours-{s}"], run["memory"][f"torch-{s}"]
            total = row["param_bytes"] + row["grad_bytes"] + row["optim_bytes"]
            ttotal = trow["param_bytes"] + trow["grad_bytes"] + trow["optim_bytes"]
            peak = mib(row["peak_param_bytes"]) if s == 3 else "-"
            formula = zero_accounting.zero_memory_bytes(s, M, N)
            lines.append(f"| {N} | {s} | {train_zero.FORMULAS[s]} | {mib(formula)} | {mib(row['param_bytes'])} | "
                         f"{mib(row['grad_bytes'])} | {mib(row['optim_bytes'])} | {mib(total)} | "
                         f"{total - formula:,.0f} | {peak} | {mib(row['comm_bytes_sent'])} "
                         f"({mib(comm_formula[s] * (N - 1) / N * M)}) | {mib(ttotal)} |")
    lines += ["", "ours − formula: the padding of each of the 10 units to a multiple of N (fewer than N "
              "elements per unit, in params, grads and both moments as the stage keeps them); 0 for `tiny`, whose "
              "units all hold a multiple of 4 elements.", "",
              "Notes: stage 3's comm is a little under 3(N-1)/N·M because the embedding's weights are "
              "not needed by its backward, so it is not gathered again. PyTorch's ZeroRedundancyOptimizer "
              "(stage 1) shards by whole tensors, so its shards are uneven; FSDP2 with "
              "reshard_after_forward=False (our stand-in for stage 2) still holds only parameter shards "
              "between steps, so at rest it looks like stage 3. Not measured for PyTorch: transient "
              "gathered parameters, DDP's gradient buckets (another M), communication buffers."]
    (RESULTS / "zero_memory.md").write_text("\n".join(lines) + "\n")


def plot_memory(runs: dict, M: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels, parts, formulas = [], {"params": [], "grads": [], "optimizer": []}, []
    for N, run in sorted(runs.items()):
        for s in (1, 2, 3):
            row = run["memory"][f"ours-{s}"]
            labels.append(f"N={N}\nstage {s}")
            formulas.append(zero_accounting.zero_memory_bytes(s, M, N) / 2**20)
            for key, k in zip(parts, ("param_bytes", "grad_bytes", "optim_bytes")):
                parts[key].append(row[k] / 2**20)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    bottom = [0.0] * len(labels)
    for (key, vals), color in zip(parts.items(), ("#4c72b0", "#dd8452", "#55a868")):
        ax.bar(range(len(labels)), vals, bottom=bottom, label=key, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.scatter(range(len(labels)), formulas, marker="_", s=900, color="k", zorder=3, label="formula")
    ax.axhline(zero_accounting.zero_memory_bytes(0, M, 1) / 2**20, color="k", ls="--", lw=1, label="plain DP  M(1+1+α)")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("MiB per rank at rest")
    ax.set_title(f"ZeRO: memory per rank by stage, measured ({MACHINE})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "zero_memory.png", dpi=110)


def write_throughput(runs: dict, args) -> None:
    tokens = args.global_batch * args.seq_len
    lines = [f"# ZeRO throughput: ours vs PyTorch — {MACHINE}", "",
             f"Command: `python 01_data_parallel/bench_zero.py` (model {args.model}, seq-len {args.seq_len}, "
             f"global batch {args.global_batch}, {args.repeats} interleaved repeats × {args.steps} steps, "
             "first 2 steps of each run dropped; median step time over all repeats).", "",
             "| N | configuration | PyTorch's equivalent | ours tokens/s | PyTorch tokens/s | ours / PyTorch |",
             "|---|---|---|---|---|---|"]
    torch_name = {1: "ZeroRedundancyOptimizer + DDP", 2: "FSDP2, reshard_after_forward=False",
                  3: "FSDP2 fully_shard"}
    for N, run in sorted(runs.items()):
        if not run["throughput"]:
            continue
        t = run["throughput"]
        for s in (1, 2, 3):
            ours, theirs = tokens / t[f"ours-{s}"], tokens / t[f"torch-{s}"]
            lines.append(f"| {N} | ZeRO stage {s} | {torch_name[s]} | {ours:,.0f} | {theirs:,.0f} | "
                         f"{ours / theirs:.2f} |")
        lines.append(f"| {N} | plain DP, bucketed (`train_dp.py --impl bucketed`) | - | "
                     f"{tokens / t['dp-bucketed']:,.0f} | - | - |")
    (RESULTS / "zero_throughput.md").write_text("\n".join(lines) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=6, help="steps per throughput run")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every configuration")
    p.add_argument("--render", action="store_true",
                   help="only rewrite the tables and plot from results/zero_raw.json (no runs)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 3:
        p.error("--steps must be at least 3: the first 2 steps of every run are warm-up and not timed")
    if args.worker:
        return worker(args)
    RESULTS.mkdir(exist_ok=True)
    raw = RESULTS / "zero_raw.json"
    runs = {}
    if args.render:
        saved = json.loads(raw.read_text())
        runs = {int(k): v for k, v in saved["runs"].items()}
        vars(args).update(saved["settings"])
    for N in ([] if args.render else (int(n) for n in args.worlds.split(","))):
        out = RESULTS / f".zero_bench_{N}.json"
        launch(__file__, N, ["--worker", "--out", out, "--model", args.model, "--seq-len", args.seq_len,
                             "--global-batch", args.global_batch, "--steps", args.steps, "--repeats", args.repeats])
        runs[N] = json.loads(out.read_text())
        out.unlink()
    if not args.render:                                # the measurements behind the tables
        settings = {k: getattr(args, k) for k in ("model", "seq_len", "global_batch", "steps", "repeats")}
        raw.write_text(json.dumps({"settings": settings, "runs": runs}, indent=1))
    from common.model import PRESETS, count_parameters
    M = count_parameters(PRESETS[args.model]) * 4
    write_memory(runs, M, args)
    plot_memory(runs, M)
    write_throughput(runs, args)
    for name in ("zero_memory.md", "zero_throughput.md"):
        print((RESULTS / name).read_text())


if __name__ == "__main__":
    from common.errors import run_main
    run_main(main)       # its workers, too, leave the way the training scripts do
