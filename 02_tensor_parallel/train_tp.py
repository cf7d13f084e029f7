"""Chapter 02 — tensor parallelism. Every rank holds a slice of every weight matrix.

    python 02_tensor_parallel/train_tp.py                                     # world size 1: the reference
    torchrun --nproc_per_node=4 02_tensor_parallel/train_tp.py                # TP=4
    torchrun --nproc_per_node=4 02_tensor_parallel/train_tp.py --sequence-parallel
    torchrun --nproc_per_node=4 02_tensor_parallel/train_tp.py --tp 2         # TP=2 × DP=2
    torchrun --nproc_per_node=4 02_tensor_parallel/train_tp.py --impl torch   # DTensor's parallelize_module

The TP degree defaults to the world size; the remaining factor world/tp is data parallelism.
The same flags give the same losses in every layout.
"""
import sys
from contextlib import nullcontext
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters

import torch

from common import checkpoint, comm
from common.cli import base_parser, check_common
from common.data import TextData, shard_rows
from common.distributed import env_world_size, init_distributed, shutdown
from common.errors import require, run_main
from common.mesh import Mesh
from common.metrics import RunLog, format_bytes
from common.model import PRESETS, build_model, count_parameters
from common.optim import build_adamw, clip_by_global_norm, lr_at, set_lr
from common.training import (StepTimer, global_sum, load_optim_state_by_name, optim_state_by_name,
                             resume_state, run_identity, should_save)

tp_lib = import_module("02_tensor_parallel.tensor_parallel")
dt_lib = import_module("02_tensor_parallel.dtensor_tp")
dp_lib = import_module("01_data_parallel.data_parallel")


def parse_args(argv=None):
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: the world size); "
                                                        "world/tp ranks of data parallelism around it")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="norms and residuals on sequence shards; all-gather / reduce-scatter instead of all-reduce")
    p.add_argument("--impl", default="ours", choices=["ours", "torch"],
                   help="ours: this chapter's layers; torch: torch.distributed.tensor.parallel (DTensor)")
    args = p.parse_args(argv)
    world = env_world_size()
    args.tp = world if args.tp is None else args.tp
    require(args.tp >= 1 and world % args.tp == 0,
            f"--tp {args.tp} does not divide the world size {world}; use a --tp that divides {world} "
            f"(e.g. --tp {world}) or launch a multiple of {max(args.tp, 1)} ranks with torchrun --nproc_per_node")
    check_common(args, dp=world // args.tp)
    tp_lib.check_tp_config(PRESETS[args.model], args.tp, args.seq_len, args.sequence_parallel)
    if args.impl == "torch":
        require(PRESETS[args.model].n_kv_heads % args.tp == 0,
                f"--impl torch needs the KV heads to split over --tp {args.tp}; use --impl ours")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rt = init_distributed(args.device, args.timeout)
    tp = args.tp
    mesh = Mesh(rt.rank, rt.world_size, dp=rt.world_size // tp, tp=tp)
    tp_group, tp_rank, dp_group, dp_rank, dp = (mesh.group("tp"), mesh.coord("tp"), mesh.group("dp"),
                                                 mesh.coord("dp"), mesh.size("dp"))
    data = TextData(args.data, args.seq_len, args.seed)
    cfg = PRESETS[args.model]
    resume = resume_state(args)
    ours = args.impl == "ours"

    # --- the model: build the full one from the seed (or the checkpoint), keep this rank's slices --
    model = build_model(cfg, args.seed, rt.device)
    start = 0
    if resume:                           # the consolidated state: each rank keeps its slice below
        model.load_state_dict(resume["model"], strict=True)
        start = resume["step"]
    if ours:
        tp_lib.parallelize_model(model, tp_group, args.sequence_parallel)
        to_full = lambda name, t: tp_lib.tp_to_full(name, t, tp_group, cfg.n_kv_heads)
        to_local = lambda name, t: tp_lib.tp_to_local(name, t, tp_rank, tp, cfg.n_kv_heads)
    else:
        dt_lib.parallelize_with_dtensor(model, dt_lib.tp_mesh_from_group(tp_group, rt.device), args.sequence_parallel)
        to_full = lambda name, t: dt_lib.full_tensor(t)
        params = dict(model.named_parameters())
        to_local = lambda name, t: dt_lib.like_param(params[name], t)
    named = list(model.named_parameters())
    optimizer = build_adamw(named, args.lr, args.weight_decay)
    if resume:
        load_optim_state_by_name(optimizer, named, resume["optim"], to_local)

    log = RunLog(rt.rank, args.steps, args.metrics, args.quiet)
    param_bytes = sum(dt_lib.local(p).numel() * p.element_size() for p in model.parameters())
    M = count_parameters(cfg) * 4
    B, S, D = args.global_batch // dp // args.microbatches, args.seq_len, cfg.dim
    log.config_table(f"tensor parallel — {args.impl}{' + sequence parallel' if args.sequence_parallel else ''}", {
        "world size": f"{rt.world_size} = DP {dp} × TP {tp}", "device / backend": f"{rt.device} / {rt.backend}",
        "mesh (dp, tp)": "\n" + mesh.describe(),
        "model": f"{args.model}: {count_parameters(cfg):,} parameters ({format_bytes(M)} fp32)",
        "parameters per rank": f"{format_bytes(param_bytes)} (full/tp = {format_bytes(M / tp)})",
        "heads per rank": f"{cfg.n_heads // tp} query, {max(1, cfg.n_kv_heads // tp)} KV"
                          + (f" (each KV head on {tp // cfg.n_kv_heads} ranks)" if cfg.n_kv_heads < tp else ""),
        "activations per f/g": f"B·S·D = {B}·{S}·{D} floats = {format_bytes(B * S * D * 4)} per all-reduce",
        "global batch": f"{args.global_batch} seq × {args.seq_len} tokens = {args.global_batch * args.seq_len:,} tokens",
        "resumed from step": start or "-"})
    if rt.world_size == 1:
        log.print("world size 1: the single-device reference. More ranks: "
                  "torchrun --nproc_per_node=4 02_tensor_parallel/train_tp.py [--sequence-parallel]")

    tokens_per_step = args.global_batch * args.seq_len
    log.start(start + 1)
    for step in range(start + 1, args.steps + 1):
        comm.COUNTER.reset()
        lr = lr_at(step, args.lr, args.warmup, args.steps)
        set_lr(optimizer, lr)
        with StepTimer(rt.device) as timer:
            x, y = data.global_batch(step, args.global_batch)                 # (global_batch, S)
            x, y = shard_rows(x, dp_rank, dp), shard_rows(y, dp_rank, dp)     # (global_batch/dp, S): same on a TP group
            x, y = x.to(rt.device), y.to(rt.device)
            local_loss = torch.zeros((), device=rt.device)
            for mb in range(args.microbatches):
                xm, ym = shard_rows(x, mb, args.microbatches), shard_rows(y, mb, args.microbatches)
                parallel_loss = nullcontext() if ours else dt_lib.loss_parallel()   # torch: backward inside too
                with parallel_loss, torch.autocast(rt.device.type, torch.bfloat16, enabled=args.dtype == "bf16"):
                    h = model.embed(xm)                                   # (B, S, D), or (B, S/tp, D) with SP
                    for layer in model.layers:
                        h = layer(h, model.rope_cos, model.rope_sin)      # f ... g twice per block
                    logits = model.head(h)                                # (B, S, V/tp): never gathered
                    if ours:
                        loss = tp_lib.tp_loss_sum(logits, ym, tp_group) / tokens_per_step
                    else:
                        loss = dt_lib.dtensor_loss_sum(logits, ym) / tokens_per_step
                    loss.backward()
                local_loss += dt_lib.local(loss).detach()     # the same on every TP rank
            if ours:
                tp_lib.sync_tp_gradients(model, tp_group)               # SP norms, replicated KV heads
                dp_lib.allreduce_gradients(model, dp_group)              # chapter 01, over the DP group
                owned = [p.grad for p in model.parameters() if p.grad is not None and tp_lib.counted_here(p, tp_rank)]
                every = [p.grad for p in model.parameters()]
            else:
                dt_lib.settle_grads(model)                               # DTensor's grad layouts
                dt_lib.allreduce_dp(model, dp_group)
                owned = dt_lib.owned_local_grads(model, tp_rank)
                every = [dt_lib.local(p.grad) for p in model.parameters()]
            # Each gradient element counted once within the TP group; DP replicas agree already.
            grad_norm = clip_by_global_norm(owned, args.clip, groups=[tp_group], all_grads=every)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        loss_value = global_sum(local_loss, dp_group)
        by_group = comm.COUNTER.by_group()
        log.log_step(step, loss_value, lr, tokens_per_step, timer.seconds, grad_norm=grad_norm,
                     comm_bytes=comm.COUNTER.total(), comm_bytes_tp=by_group.get("tp", 0),
                     comm_bytes_dp=by_group.get("dp", 0), param_bytes=param_bytes,
                     tp=tp, dp=dp, sequence_parallel=args.sequence_parallel, impl=args.impl)
        if should_save(args, step):      # a collective inside each TP group, written by global rank 0
            full_model = {name: to_full(name, p.detach()) for name, p in model.named_parameters()}
            full_optim = optim_state_by_name(optimizer, named, to_full)
            if rt.is_main:
                path = checkpoint.save(args.checkpoint_dir, step, full_model, full_optim, run_identity(args))
                log.note(f"checkpoint saved: {path}")
    log.finish({"parameters per rank": format_bytes(param_bytes),
                "TP bytes / step (this rank)": format_bytes(log.history[-1]["comm_bytes_tp"]) if log.history else "-"})
    shutdown(rt)
    return log.history


if __name__ == "__main__":
    run_main(main)
