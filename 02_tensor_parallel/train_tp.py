"""Chapter 02 — tensor parallelism. Every rank holds a slice of every weight matrix.

    python 02_tensor_parallel/train_tp.py                                     # world size 1: the reference
    torchrun --nproc_per_node=4 02_tensor_parallel/train_tp.py                # TP=4
    torchrun --nproc_per_node=4 02_tensor_parallel/train_tp.py --sequence-parallel
    torchrun --nproc_per_node=4 02_tensor_parallel/train_tp.py --sequence-parallel --tp-overlap   # tp_overlap.py
    torchrun --nproc_per_node=4 02_tensor_parallel/train_tp.py --tp 2         # TP=2 × DP=2
    torchrun --nproc_per_node=4 02_tensor_parallel/train_tp.py --impl torch   # DTensor's parallelize_module

The TP degree defaults to the world size; the remaining factor world/tp is data parallelism.
The same flags give the same losses in every layout.
"""
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters

import torch

from common import activation_ledger, checkpoint, comm
from common.activation_meter import MeasuredActivations
from common.cli import base_parser, check_common
from common.domains import POSITIVE_INT
from common.data import TextData, shard_rows
from common.distributed import env_world_size, init_distributed, shutdown
from common.errors import require, run_main
from common.mesh import Mesh
from common.metrics import RunLog, format_bytes
from common.model import PRESETS, build_model, count_parameters, dense_preset
from common.optim import lr_at
from common.training import (StepTimer, global_sum, resume_state, run_identity, should_save, start_rng,
                             stop_if_not_finite)

tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")
tp_trainer = import_module("02_tensor_parallel.tp_trainer")


def parse_args(argv=None):
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--tp", type=POSITIVE_INT, default=None, help="tensor-parallel degree (default: the world size); "
                                                        "world/tp ranks of data parallelism around it")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="norms and residuals on sequence shards; all-gather / reduce-scatter instead of all-reduce")
    tensor_parallel.add_tp_overlap_arg(p)
    p.add_argument("--impl", default="ours", choices=["ours", "torch"],
                   help="ours: this chapter's layers; torch: torch.distributed.tensor.parallel (DTensor)")
    return p.parse_args(argv)


def tp_degree(args, world: int) -> int:
    """The TP degree (--tp, default: the world size), after every check that needs no communication:
    ranks raise the same ConfigError, naming the fix, before any collective."""
    tp = world if args.tp is None else args.tp
    # DTensor's own backward (its redistribution of gradients) breaks inside a compiled block.
    require(args.impl != "torch" or args.compile == "none",
            f"--compile {args.compile} with --impl torch: DTensor's layers do not compile here; use --impl ours "
            "(this chapter's layers compile, their collectives running between compiled pieces)")
    require(args.impl != "torch" or not args.tp_overlap,
            "--tp-overlap is this chapter's ring (tp_overlap.py); DTensor's async TP needs CUDA symmetric memory: "
            "use --impl ours")
    require(world % tp == 0,
            f"--tp {tp} does not divide the world size {world}; use a --tp that divides {world} "
            f"(e.g. --tp {world}) or launch a multiple of {max(tp, 1)} ranks with torchrun --nproc_per_node")
    check_common(args, dp=world // tp)
    tensor_parallel.check_tp_config(PRESETS[args.model], tp, args.seq_len, args.sequence_parallel, args.tp_overlap)
    return tp


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    tp = tp_degree(args, env_world_size())
    cfg = dense_preset(args.model, "05_moe_expert_parallel/train_4d.py")   # a mixture of experts is chapter 05's
    rt = init_distributed(args.device, args.timeout)
    mesh = Mesh(rt.rank, rt.world_size, dp=rt.world_size // tp, tp=tp)
    dp_group, dp_rank, dp = mesh.group("dp"), mesh.coord("dp"), mesh.size("dp")
    data = TextData(args.data, args.seq_len, args.seed)
    resume = resume_state(args)

    # --- the model: build the full one from the seed (or the checkpoint); build_trainer cuts it to this
    # rank's slices. Ours or DTensor's, chosen once: the loop below is the same for both.
    model = build_model(cfg, args.seed, rt.device, args.recompute, args.compile, args.recompute_layers)
    start = 0
    if resume:                           # the consolidated state: each rank keeps its slice
        model.load_state_dict(resume["model"], strict=True)
        start = resume["step"]
    trainer = build_trainer(args, model, mesh, rt.device)
    # the bytes autograd keeps, measured beside the ledger's prediction (`memory()`; ours only)
    predicted = activation_ledger.predicted_bytes(cfg, args, args.global_batch // dp // args.microbatches, tp,
                                                  args.sequence_parallel)
    trainer = MeasuredActivations(trainer, trainer.model, predicted,
                                  measure=args.impl == "ours" and not args.no_activation_meter)
    if resume:
        trainer.load_optim_state(resume["optim"])

    log = RunLog(rt.rank, args.steps, args.metrics, args.quiet, append=args.resume)
    log.track_mfu(cfg, args.seq_len, args.dtype, rt)          # `mfu` in every row (common/mfu.py)
    log.config_table(f"tensor parallel — {args.impl}{' + sequence parallel' if args.sequence_parallel else ''}"
                     f"{' + ring overlap' if args.tp_overlap else ''}",
                     layout_rows(args, cfg, mesh, rt, data, trainer.memory(), start))
    if rt.world_size == 1:
        log.print("world size 1: the single-device reference. More ranks: "
                  "torchrun --nproc_per_node=4 02_tensor_parallel/train_tp.py [--sequence-parallel]")

    tokens_per_step = args.global_batch * args.seq_len
    start_rng(args, resume)                   # torch's generator: seeded, or as the checkpoint left it
    log.start(start + 1)
    for step in range(start + 1, args.steps + 1):
        comm.COUNTER.reset()
        lr = lr_at(step, args.lr, args.warmup, args.steps)
        trainer.set_lr(lr)
        with StepTimer(rt.device) as timer:
            x, y = data.global_batch(step, args.global_batch)                 # (global_batch, S)
            x, y = shard_rows(x, dp_rank, dp), shard_rows(y, dp_rank, dp)     # (global_batch/dp, S): same on a TP group
            x, y = x.to(rt.device), y.to(rt.device)
            local_loss = torch.zeros((), device=rt.device)
            for mb in range(args.microbatches):
                xm, ym = shard_rows(x, mb, args.microbatches), shard_rows(y, mb, args.microbatches)
                local_loss += trainer.forward_backward(xm, ym, sync=mb == args.microbatches - 1)
            trainer.sync_gradients()         # TP's leftovers (SP norms, shared KV heads), then the DP all-reduce
            grad_norm = trainer.clip_grad_norm(args.clip)
            trainer.step()
            trainer.zero_grad()
        loss_value = global_sum(local_loss, dp_group)
        stop_if_not_finite(step, loss_value, grad_norm, args)
        log.log_step(step, loss_value, lr, tokens_per_step, timer.seconds, grad_norm=grad_norm,
                     **trainer.comm_bytes(), **trainer.memory(),
                     tp=tp, dp=dp, sequence_parallel=args.sequence_parallel, impl=args.impl)
        if should_save(args, step):      # a collective inside each TP group, written by global rank 0
            full_model, full_optim = trainer.full_state()
            if rt.is_main:
                path = checkpoint.save(args.checkpoint_dir, step, full_model, full_optim, run_identity(args))
                log.note(f"checkpoint saved: {path}")
    log.finish(summary_rows(log.history))
    shutdown(rt)
    return log.history


def build_trainer(args, model, mesh, device):
    """The trainer of `--impl`, chosen once: ours (tp_trainer.py) or PyTorch's DTensor (dtensor_tp.py),
    siblings with the same verbs and the same arguments. In torchtitan's order: cut the model first
    (each rank keeps its slices), build the optimizer on those slices, hand both to the trainer."""
    tp_group = mesh.group("tp")
    if args.impl == "torch":               # imported only when asked for: DTensor costs every rank ~0.8 s of CPU
        dtensor_tp = import_module("02_tensor_parallel.dtensor_tp")
        Trainer = dtensor_tp.DTensorTrainer
        model = dtensor_tp.parallelize_with_dtensor(model, tp_group, device, args.sequence_parallel)
    else:                                  # --tp-overlap: ours only (tp_degree refuses it with DTensor)
        Trainer = tp_trainer.TPTrainer
        model = tensor_parallel.parallelize_model(model, tp_group, args.sequence_parallel, overlap=args.tp_overlap)
    optimizer = tp_trainer.replicated_adamw_on(model, args.lr, args.weight_decay)
    return Trainer(model, optimizer, tp_group, mesh.group("dp"), tokens_per_step=args.global_batch * args.seq_len,
                   device=device, bf16=args.dtype == "bf16")


def layout_rows(args, cfg, mesh, rt, data, memory: dict, start: int) -> dict:
    """The configuration table printed at start: the grid, what each rank holds, what an f or g moves."""
    tp, dp = mesh.size("tp"), mesh.size("dp")
    M = count_parameters(cfg) * 4
    B, S, D = args.global_batch // dp // args.microbatches, args.seq_len, cfg.dim
    return {
        "world size": f"{rt.world_size} = DP {dp} × TP {tp}", "device / backend": f"{rt.device} / {rt.backend}",
        "data": data.describe(), "mesh (dp, tp)": "\n" + mesh.describe(),
        "model": f"{args.model}: {count_parameters(cfg):,} parameters ({format_bytes(M)} fp32)",
        "parameters per rank": f"{format_bytes(memory['param_bytes'])} (full/tp = {format_bytes(M / tp)})",
        "heads per rank": f"{cfg.n_heads // tp} query, {cfg.kv_heads_per_rank(tp)} KV"
                          + (f" (each KV head on {tp // cfg.n_kv_heads} ranks)" if cfg.n_kv_heads < tp else ""),
        "activations per f/g": f"B·S·D = {B}·{S}·{D} floats = {format_bytes(B * S * D * 4)} per all-reduce",
        "global batch": f"{args.global_batch} seq × {args.seq_len} tokens = {args.global_batch * args.seq_len:,} tokens",
        "resumed from step": start or "-"}


def summary_rows(history: list[dict]) -> dict:
    """The rows added to the end-of-run summary: what this rank holds and sends for TP."""
    if not history:
        return {}
    tp_bytes = history[-1]["comm_bytes_tp"]
    return {"parameters per rank": format_bytes(history[-1]["param_bytes"]),
            "TP bytes / step (this rank)": "— (not measured: DTensor bypasses common.comm)"
                                           if tp_bytes is None else format_bytes(tp_bytes)}


if __name__ == "__main__":
    run_main(main)
