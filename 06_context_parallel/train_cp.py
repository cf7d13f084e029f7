"""Chapter 06 — context parallelism. Every rank holds S/cp positions of each sequence in its rows.

    python 06_context_parallel/train_cp.py                                    # world size 1: the reference
    torchrun --nproc_per_node=4 06_context_parallel/train_cp.py               # CP=4 (ring attention, zig-zag)
    torchrun --nproc_per_node=4 06_context_parallel/train_cp.py --cp 2        # CP=2 × DP=2
    torchrun --nproc_per_node=4 06_context_parallel/train_cp.py --cp-split contiguous
    torchrun --nproc_per_node=4 06_context_parallel/train_cp.py --cp-attention allgather
    torchrun --nproc_per_node=4 06_context_parallel/train_cp.py --cp-attention alltoall      # Ulysses
    torchrun --nproc_per_node=4 06_context_parallel/train_cp.py --cp-attention alltoall+ring --cp-alltoall 2
    torchrun --nproc_per_node=4 06_context_parallel/train_cp.py --cp 2 --tp 2  # CP=2 × TP=2
    torchrun --nproc_per_node=4 06_context_parallel/train_cp.py --cp-split contiguous --timeline runs/cp.json

The CP degree defaults to what --dp and --tp leave of the world size (both default to 1); with --cp
given, DP takes what is left. The grid is
arange(world).view(dp, cp, tp): TP innermost, then CP. The same flags give the same losses in every layout.
"""
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters

import torch

from common import activation_ledger, checkpoint, comm
from common.activation_meter import MeasuredActivations
from common.cli import base_parser, check_common
from common.domains import OUTPUT_FILE, POSITIVE_INT
from common.data import TextData, shard_rows
from common.distributed import env_world_size, init_distributed, shutdown
from common.errors import require, run_main
from common.mesh import Mesh
from common.metrics import RunLog, format_bytes
from common.model import PRESETS, build_model, count_parameters, dense_preset
from common.optim import lr_at
from common.training import (StepTimer, global_sum, resume_state, run_identity, should_save, start_rng,
                             stop_if_not_finite)

tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")     # chapter 02: the TP checks, the cut
tp_trainer = import_module("02_tensor_parallel.tp_trainer")               # chapter 02: the optimizer on the slices
parallel_3d = import_module("04_3d_combined.parallel_3d")                 # chapter 04: the Layout's element size
context_parallel = import_module("06_context_parallel.context_parallel")  # this chapter: CP's pieces
cp_trainer = import_module("06_context_parallel.cp_trainer")              # this chapter: the step verbs
attention_bookkeeping = import_module("06_context_parallel.attention_bookkeeping")  # this chapter: bytes formula, work
cp_timeline = import_module("06_context_parallel.cp_timeline")            # this chapter: --timeline


def parse_args(argv=None):
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--dp", type=POSITIVE_INT, default=None,
                   help="data-parallel degree (default: what --cp and --tp leave of the world if --cp is given, else 1)")
    p.add_argument("--tp", type=POSITIVE_INT, default=1, help="tensor-parallel degree (default 1)")
    context_parallel.add_cp_args(p, "context-parallel degree (default: what --dp and --tp leave of the world)")
    p.add_argument("--timeline", type=OUTPUT_FILE, default=None,
                   help="write every rank's ring attention spans (compute, wait, post) as a Chrome trace JSON here, "
                        "and print each rank's totals (default: none)")
    return p.parse_args(argv)


def decide_degrees(args, world: int) -> tuple[int, int, int]:
    """(dp, cp, tp), after every check that needs no communication: each rank raises the same one-line
    ConfigError, naming the flag and the fix, before any collective."""
    tp, cp = args.tp, args.cp
    dp = args.dp if args.dp is not None else (max(1, world // (cp * tp)) if cp is not None else 1)
    cp = cp if cp is not None else max(1, world // (dp * tp))
    require(dp * cp * tp == world,
            f"--dp {dp} × --cp {cp} × --tp {tp} = {dp * cp * tp} must equal the world size {world}; change the "
            f"degrees (--cp must divide {world // max(1, dp * tp) or world}) or launch with --nproc_per_node={dp * cp * tp}")
    check_common(args, dp=dp)                # the batch splits over dp only: every CP rank has the same rows
    tensor_parallel.check_tp_config(PRESETS[args.model], tp, args.seq_len, False)
    context_parallel.check_cp(args, cp, tp, PRESETS[args.model])       # and the all-to-all's heads
    return dp, cp, tp


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    cfg = dense_preset(args.model, "06_context_parallel/train_5d.py")   # the 5D run splits a mixture of experts
    dp, cp, tp = decide_degrees(args, env_world_size())
    rt = init_distributed(args.device, args.timeout)
    # TP innermost (it talks inside every layer), then CP (every attention), then DP (once per step)
    mesh = Mesh(rt.rank, rt.world_size, joined={"dp_cp": ("dp", "cp")}, dp=dp, cp=cp, tp=tp)
    dp_rank, cp_rank, cp_group = mesh.coord("dp"), mesh.coord("cp"), mesh.group("cp")
    split = context_parallel.sequence_split(args, cp)          # (the hybrid cuts each group's chunks over K)
    data = TextData(args.data, args.seq_len, args.seed)
    resume = resume_state(args)

    # --- the model: the full one from the seed (or the checkpoint), cut to this rank's TP slices (chapter
    # 02), the optimizer built on them; the trainer puts the context-parallel core into every attention
    model = build_model(cfg, args.seed, rt.device, args.recompute, args.compile, args.recompute_layers)
    start = 0
    if resume:
        model.load_state_dict(resume["model"], strict=True)
        start = resume["step"]
    tokens_per_step = args.global_batch * args.seq_len          # global: each token counted once
    timeline = cp_timeline.start(args.timeline, rt.rank)     # records the ring's spans only with --timeline
    model = tensor_parallel.parallelize_model(model, mesh.group("tp"))              # my TP slices
    optimizer = tp_trainer.replicated_adamw_on(model, args.lr, args.weight_decay)   # chapter 01's AdamW on them
    trainer = cp_trainer.CPTrainer(model, optimizer, mesh.group("tp"), cp_group, mesh.group("dp_cp"), split,
                                   args.cp_attention, span=cp_timeline.ring_spans(timeline),
                                   tokens_per_step=tokens_per_step, device=rt.device, bf16=args.dtype == "bf16")
    # the activation bytes each micro-batch keeps, measured, beside the ledger's prediction for S/cp positions
    predicted = activation_ledger.predicted_bytes(cfg, args, args.global_batch // dp // args.microbatches, tp, cp=cp,
                                                  gathered_kv=cp > 1 and args.cp_attention == "allgather")
    trainer = MeasuredActivations(trainer, trainer.model, predicted, measure=not args.no_activation_meter)
    if resume:
        trainer.load_optim_state(resume["optim"])

    log = RunLog(rt.rank, args.steps, args.metrics, args.quiet, append=args.resume)
    log.track_mfu(cfg, args.seq_len, args.dtype, rt)          # `mfu` in every row (common/mfu.py)
    log.config_table("context parallel", layout_rows(args, cfg, mesh, rt, data, split, start))
    if rt.world_size == 1:
        log.print("world size 1: the single-device reference. More ranks: "
                  "torchrun --nproc_per_node=4 06_context_parallel/train_cp.py [--cp-split contiguous]")

    start_rng(args, resume)                   # torch's generator: seeded, or as the checkpoint left it
    log.start(start + 1)
    for step in range(start + 1, args.steps + 1):
        timeline.begin_step(step)
        comm.COUNTER.reset()
        attention_bookkeeping.WORK.reset()
        lr = lr_at(step, args.lr, args.warmup, args.steps)
        trainer.set_lr(lr)
        with StepTimer(rt.device) as timer:
            x, y = data.global_batch(step, args.global_batch)                 # (global_batch, S)
            x, y = shard_rows(x, dp_rank, dp), shard_rows(y, dp_rank, dp)     # my rows: (global_batch/dp, S)
            x, y = split.take(x, cp_rank), split.take(y, cp_rank)             # my positions: (global_batch/dp, S/cp)
            x, y = x.to(rt.device), y.to(rt.device)
            local_loss = torch.zeros((), device=rt.device)
            for mb in range(args.microbatches):
                xm, ym = shard_rows(x, mb, args.microbatches), shard_rows(y, mb, args.microbatches)
                local_loss += trainer.forward_backward(xm, ym, sync=mb == args.microbatches - 1)
            trainer.sync_gradients()         # TP's leftovers, then ONE all-reduce over dp × cp
            grad_norm = trainer.clip_grad_norm(args.clip)
            trainer.step()
            trainer.zero_grad()
        bytes_cp = comm.COUNTER.total("cp")                                    # before the bookkeeping below
        loss_value = global_sum(local_loss, mesh.group("dp_cp"))               # my rows' and positions' share
        stop_if_not_finite(step, loss_value, grad_norm, args)
        log.log_step(step, loss_value, lr, tokens_per_step, timer.seconds, grad_norm=grad_norm,
                     **trainer.comm_bytes(), comm_bytes_cp=bytes_cp, **trainer.memory(),
                     **context_parallel.cp_step_metrics(cp_group, cp, rt.device),
                     dp=dp, cp=cp, tp=tp, cp_split=args.cp_split, cp_attention=args.cp_attention,
                     cp_alltoall=args.cp_alltoall)
        if should_save(args, step):      # a collective inside each TP group, written by global rank 0
            full_model, full_optim = trainer.full_state()
            if rt.is_main:
                path = checkpoint.save(args.checkpoint_dir, step, full_model, full_optim, run_identity(args))
                log.note(f"checkpoint saved: {path}")
    cp_timeline.finish(timeline, args.timeline, rt, log, {"cp": cp, "dp": dp, "tp": tp, "cp_split": args.cp_split,
                                                           "cp_attention": args.cp_attention})
    log.finish(summary_rows(log.history))
    shutdown(rt)
    return log.history


def layout_rows(args, cfg, mesh, rt, data, split, start: int) -> dict:
    """The configuration table printed at start: the grid, the positions each CP rank holds, the ring's bytes."""
    dp, cp, tp = mesh.size("dp"), mesh.size("cp"), mesh.size("tp")
    B, S, hd = args.global_batch // dp // args.microbatches, args.seq_len, cfg.head_dim
    kv = cfg.kv_heads_per_rank(tp)
    chunks = " ".join(f"r{r}:" + "+".join(f"[{a},{b})" for a, b in split.chunks(r)) for r in range(cp))
    element = parallel_3d.ELEMENT_SIZE[args.dtype]               # K/V in the run's dtype (gradients in fp32)
    per_layer, rerun = (attention_bookkeeping.cp_bytes(args.cp_attention, B, S, cp, kv, hd, element, runs,
                                                       h=cfg.n_heads // tp, K=args.cp_alltoall or 1) for runs in (1, 2))
    if args.recompute == "full":             # a recomputed block's forward exchanges again
        per_layer = rerun if args.recompute_layers is None else per_layer
    return {
        "world size": f"{rt.world_size} = DP {dp} × CP {cp} × TP {tp}", "device / backend": f"{rt.device} / {rt.backend}",
        "data": data.describe(), "mesh (dp, cp, tp)": "\n" + mesh.describe(),
        "model": f"{args.model}: {count_parameters(cfg):,} parameters ({format_bytes(count_parameters(cfg) * 4)} fp32)",
        "positions per CP rank": f"{S // cp} of {S} ({args.cp_split}): {chunks}",
        "attention": f"{args.cp_attention}: {format_bytes(per_layer)} sent + received per layer and micro-batch "
                     f"(forward + backward, {args.dtype})" + (
                         f"; {format_bytes(rerun)} in the {args.recompute_layers} first, recomputed"
                         if args.recompute == "full" and args.recompute_layers else "")
                     if cp > 1 else "one rank: plain causal attention",
        "gradients": f"summed over dp × cp = {dp * cp} ranks (one all-reduce per tensor)",
        "global batch": f"{args.global_batch} seq × {S} tokens = {args.global_batch * S:,} tokens",
        "resumed from step": start or "-"}


def summary_rows(history: list[dict]) -> dict:
    """The rows added to the end-of-run summary: the CP traffic, activations, and the work balance."""
    if not history:
        return {}
    last = history[-1]
    imbalance, peak = last["attn_work_imbalance"], last["peak_activation_bytes"]
    return {"CP bytes / step (this rank)": format_bytes(last["comm_bytes_cp"]),
            "peak activation bytes (this rank)": "not measured" if peak is None else format_bytes(peak),
            "attention work, max / min over CP": "-" if imbalance is None else f"{imbalance:.3f}"}


if __name__ == "__main__":
    run_main(main)
