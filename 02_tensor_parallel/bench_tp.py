"""Chapter 02 benchmark: what tensor parallelism communicates, what it saves, how fast it runs.

    python 02_tensor_parallel/bench_tp.py            # a few minutes on a 2-core CPU
    python 02_tensor_parallel/bench_tp.py --quick    # fewer repeats
    python 02_tensor_parallel/bench_tp.py --only comm|throughput|overlap

Writes 02_tensor_parallel/results/:
  comm_per_call.md   every TP collective of one training step, logged call by call, against B·S·D
  param_bytes.md     parameter bytes on each rank against full/N
  sp_memory.md       sequence parallelism's trade: activation bytes kept and TP bytes sent, for TP,
                     SP keeping each gathered input (keep_gathered) and SP re-gathering it (the default)
  throughput.md      tokens/s of this chapter's layers and of DTensor (--impl torch) at 1, 2, 4 ranks,
                     interleaved repeats, medians and ratios
  tp_overlap.md      exposed TP communication per step with and without --tp-overlap at tp 2 and 4, and
  tp_timeline.png    one step of every rank (overlap_tp.py measures, overlap_tp_report.py writes)
(a), (b) and the SP table come from `bench_tp.py --probe` run under torchrun, which logs each call
(common/comm.py's COUNTER.logging_calls) and measures the bytes autograd keeps (common/activation_meter.py);
(c) from train_tp.py's metrics files.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import Counter
from importlib import import_module
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = Path(__file__).parent / "results"
MACHINE = f"{os.cpu_count()}-core CPU, gloo backend, fp32, one process per rank"


def probe(sp: bool, keep_gathered: bool, out: str):
    """Under torchrun: one forward + backward of the tiny model with every tp collective logged and the
    activation bytes autograd keeps measured (--recompute none)."""
    import torch.distributed as dist
    from common import activation_ledger, comm
    from common.activation_meter import parameter_storages, saved_storages, storages
    from common.data import TextData
    from common.distributed import init_distributed
    from common.mesh import Mesh
    from common.model import PRESETS, build_model, count_parameters
    tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")
    rt = init_distributed("cpu")
    mesh = Mesh(rt.rank, rt.world_size, tp=rt.world_size)
    cfg, B, S = PRESETS["tiny"], 4, 64
    model = tensor_parallel.parallelize_model(build_model(cfg, 1337), mesh.group("tp"), sp, keep_gathered)
    x, y = TextData(None, S, 1337).global_batch(1, B)
    with comm.COUNTER.logging_calls() as logged:                       # every collective, call by call
        with saved_storages(parameter_storages(model) | storages((x, y))) as kept:
            h = model.embed(x)
            for layer in model.layers:
                h = layer(h, model.rope_cos, model.rope_sin)
            tensor_parallel.tp_loss_sum(model.head(h), y, mesh.group("tp")).backward()
        tensor_parallel.sync_tp_gradients(model, mesh.group("tp"))
    # the TP collectives, each with its full-size tensor's shape (the gathered output, the scattered input)
    calls = [(kind, tuple(shape), nbytes) for kind, shape, name, nbytes in logged
             if name == "tp" and kind in ("all_reduce", "all_gather_into", "reduce_scatter_into")]
    predicted = activation_ledger.microbatch_bytes(cfg, "none", B, S, cfg.n_layers, tp=rt.world_size,
                                                   sequence_parallel=sp)
    sizes = [None] * rt.world_size
    dist.all_gather_object(sizes, sum(p.numel() * 4 for p in model.parameters()))
    if rt.rank == 0:
        Path(out).write_text(json.dumps({"N": rt.world_size, "sp": sp, "B": B, "S": S, "D": cfg.dim,
                                         "L": cfg.n_layers, "calls": calls, "param_bytes": sizes,
                                         "full_bytes": count_parameters(cfg) * 4, "kept": sum(kept.values()),
                                         "predicted": None if keep_gathered else predicted}))
    dist.destroy_process_group()


def torchrun(n, args, env_extra=None):
    from common.launch import launch
    launch(args[0], n, args[1:], echo=False, quiet=True, env=env_extra)


# the SP table's runs: (label, --sp, --keep-gathered); only the first two go into comm_per_call.md
VARIANTS = (("TP", False, False), ("TP + SP", True, False), ("TP + SP, gathered inputs kept", True, True))


def comm_tables(tmp):
    rows_calls, rows_params, rows_sp = [], [], []
    for n in (2, 4):
        for label, sp, keep in VARIANTS:
            out = Path(tmp) / f"probe_{n}_{sp}_{keep}.json"
            torchrun(n, [__file__, "--probe", "--out", str(out)] + ["--sp"] * sp + ["--keep-gathered"] * keep)
            r = json.loads(out.read_text())
            bsd = r["B"] * r["S"] * r["D"]
            gathers = sum(kind == "all_gather_into" for kind, _, _ in r["calls"])
            predicted = "—" if r["predicted"] is None else f"{r['predicted']:,}"
            rows_sp.append(f"| {n} | {label} | {r['kept']:,} | {predicted} | {gathers} | "
                           f"{sum(nbytes for _, _, nbytes in r['calls']):,} |")
            if keep:
                continue
            groups = Counter((kind, tuple(shape), nbytes) for kind, shape, nbytes in r["calls"])
            for (kind, shape, nbytes), count in sorted(groups.items(), key=lambda kv: -kv[0][2]):
                numel = 1
                for s in shape:
                    numel *= s
                rows_calls.append(f"| {n} | {'SP' if sp else '-'} | {kind} | {count} | {list(shape)} | "
                                  f"{numel / bsd:.3g} | {nbytes:,} | {_theory(kind, n, numel * 4):,.0f} |")
            if not sp:
                full = r["full_bytes"]
                for rank, b in enumerate(r["param_bytes"]):
                    rows_params.append(f"| {n} | {rank} | {b:,} | {full / n:,.0f} | {b / full:.4f} | {1 / n:.4f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "comm_per_call.md").write_text(
        f"TP collectives of one training step (forward + backward), tiny model, B=4 S=64 D=128 "
        f"(B·S·D = 32,768 floats), 8 layers. Machine: {MACHINE}.\n"
        "Command: `python 02_tensor_parallel/bench_tp.py` (probe: `torchrun --nproc_per_node=N "
        "02_tensor_parallel/bench_tp.py --probe [--sp]`).\n\n"
        "| N | SP | collective | calls | tensor shape | elements / B·S·D | bytes sent+received per call (counted) "
        "| ring formula |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows_calls) + "\n\n"
        "Ring formula: all-reduce 2·2(N-1)/N·n, all-gather and reduce-scatter 2·(N-1)/N·n bytes (sent + received), "
        "n = 4·elements of the full tensor. Shapes are as the collective sees them: sequence-parallel collectives "
        "move the sequence dimension first, (S, B, D). 34 = 4L + 2: per block a g after attention and after the MLP "
        "(forward) and an f before each (backward), plus the embedding (forward) and the head (backward). With SP "
        "each all-reduce becomes a reduce-scatter + an all-gather of half its bytes, and 51 = 34 + 17 all-gathers: "
        "each of the 2L + 1 = 17 column-parallel entrances (attention, MLP, head) all-gathers its input again in "
        "backward; the 17 = 2L + 1 small all-reduces are the norm gains' partial gradients, the 3 of 256 floats the "
        "vocab-parallel loss (max, sum of exps, target logit).\n")
    (RESULTS / "param_bytes.md").write_text(
        f"Parameter bytes per rank (fp32), tiny model (1,640,576 parameters). Machine: {MACHINE}.\n"
        "Command: `python 02_tensor_parallel/bench_tp.py`.\n\n"
        "| N | rank | bytes on this rank | full / N | fraction of full | 1/N |\n|---|---|---|---|---|---|\n"
        + "\n".join(rows_params) + "\n\nThe excess over 1/N is the norm gains, replicated on every rank.\n")
    (RESULTS / "sp_memory.md").write_text(
        f"Sequence parallelism's trade: one forward + backward of the tiny model, B=4 S=64 D=128, 8 layers, "
        f"--recompute none, rank 0. Machine: {MACHINE}.\n"
        "Command: `python 02_tensor_parallel/bench_tp.py --only comm` (probe: `torchrun --nproc_per_node=N "
        "02_tensor_parallel/bench_tp.py --probe [--sp [--keep-gathered]]`).\n\n"
        "| N | run | activation bytes kept (measured) | ledger | all-gathers of B·S·D | TP bytes sent + received |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(rows_sp) + "\n\n"
        "Measured: the bytes autograd saves for backward (common/activation_meter.py, parameters and token ids "
        "left out); ledger: common/activation_ledger.microbatch_bytes (it counts the default only). TP bytes: "
        "every \"tp\" collective of the forward, the backward and sync_tp_gradients. \"Gathered inputs kept\" "
        "is parallelize_model(..., keep_gathered=True): each column-parallel entrance keeps the all-gathered "
        "(B, S, D) for backward, as all-gather then nn.Linear would; the default keeps the (B, S/N, D) shard and "
        "all-gathers it again in backward. Per step the difference is exactly (2L + 1)·B·(S − S/N)·D·4 bytes kept "
        "and 2L + 1 all-gathers of 2·(N−1)/N·B·S·D·4 bytes sent + received.\n")


def _theory(kind, N, n):
    return 4 * (N - 1) / N * n if kind == "all_reduce" else 2 * (N - 1) / N * n


def throughput(repeats, steps):
    flags = ["--steps", str(steps), "--seq-len", "128", "--global-batch", "8", "--quiet"]
    samples = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(repeats):                      # interleaved: every configuration once per round
            for n in (1, 2, 4):
                for impl in ("ours", "torch"):
                    path = Path(tmp) / f"{n}_{impl}_{rep}.jsonl"
                    torchrun(n, [str(ROOT / "02_tensor_parallel" / "train_tp.py"), "--impl", impl,
                                 "--metrics", str(path)] + flags)
                    rows = [json.loads(line) for line in path.read_text().splitlines()][1:]   # skip warm-up step
                    samples.setdefault((n, impl), []).append(statistics.median(r["tokens_per_s"] for r in rows))
    rate = {key: statistics.median(s) for key, s in samples.items()}
    tokens = 8 * 128                                     # one step: --global-batch × --seq-len
    lines = []
    for n in (1, 2, 4):
        ours, torch_ = rate[(n, "ours")], rate[(n, "torch")]
        lines.append(f"| {n} | {ours:,.0f} | {torch_:,.0f} | {1e3 * tokens / ours:.0f} | {1e3 * tokens / torch_:.0f} | "
                     f"{ours / torch_:.2f} | {ours / rate[(1, 'ours')]:.2f} | {torch_ / rate[(1, 'torch')]:.2f} |")
    (RESULTS / "throughput.md").write_text(
        f"Tokens/s, tiny model, --seq-len 128 --global-batch 8, {steps} steps (first dropped), median over "
        f"{repeats} interleaved repeats. TP degree = ranks. Machine: {MACHINE}.\n"
        f"Command: `{' '.join(['python 02_tensor_parallel/bench_tp.py'] + sys.argv[1:])}`.\n\n"
        "| ranks (TP) | ours tok/s | DTensor tok/s | ours ms/step | DTensor ms/step | ours / DTensor "
        "| ours vs its 1 rank | DTensor vs its 1 rank |\n|---|---|---|---|---|---|---|---|\n"
        + "\n".join(lines) + "\n\nms/step = 1,024 tokens ÷ the median tokens/s. Times and ratios are this "
        "machine's: another CPU gives other values.\n")


def overlap_tables(tmp):
    """overlap_tp.py at tp 2 and 4, then its table and timeline picture."""
    overlap_tp_report = import_module("02_tensor_parallel.overlap_tp_report")
    runs = []
    for n in (2, 4):
        out = Path(tmp) / f"overlap_tp{n}.json"
        torchrun(n, [str(Path(__file__).parent / "overlap_tp.py"), "--out", str(out)])
        runs.append(json.loads(out.read_text()))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tp_overlap.md").write_text(overlap_tp_report.table(runs, "python 02_tensor_parallel/bench_tp.py "
                                                                          "--only overlap"))
    overlap_tp_report.plot_timeline(runs, RESULTS / "tp_timeline.png")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--probe", action="store_true", help="(internal) log every collective of one step")
    p.add_argument("--sp", action="store_true")
    p.add_argument("--keep-gathered", action="store_true", help="(with --sp) keep each gathered input for backward")
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="2 repeats of 4 steps instead of 3 of 6")
    p.add_argument("--only", choices=["comm", "throughput", "overlap"], default=None, help="run one part only")
    args = p.parse_args()
    if args.probe:
        return probe(args.sp, args.keep_gathered, args.out)
    if args.only in (None, "comm"):
        with tempfile.TemporaryDirectory() as tmp:
            comm_tables(tmp)
    if args.only in (None, "throughput"):
        throughput(*((2, 4) if args.quick else (3, 6)))
    if args.only in (None, "overlap"):
        with tempfile.TemporaryDirectory() as tmp:
            overlap_tables(tmp)
    for f in ("comm_per_call.md", "param_bytes.md", "sp_memory.md", "throughput.md", "tp_overlap.md"):
        print(f"--- {f}\n{(RESULTS / f).read_text()}")


if __name__ == "__main__":
    from common.errors import run_main
    run_main(main)       # its workers, too, leave the way the training scripts do
