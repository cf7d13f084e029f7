"""Chapter 01, part two — ZeRO: data parallelism whose ranks share the memory instead of copying it.

    python 01_data_parallel/train_zero.py                                   # world size 1: the reference
    torchrun --nproc_per_node=4 01_data_parallel/train_zero.py --zero-stage 1|2|3
    torchrun --nproc_per_node=4 01_data_parallel/train_zero.py --zero-stage 3 --impl torch   # FSDP2

The DP degree is the world size. Every stage gives the same losses as train_dp.py with the same flags.
"""
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters

import torch

from common import activation_ledger, checkpoint, comm
from common.activation_meter import MeasuredActivations
from common.cli import base_parser, check_common
from common.data import TextData, shard_rows
from common.distributed import env_world_size, init_distributed, shutdown
from common.errors import require, run_main
from common.mesh import Mesh
from common.metrics import RunLog, format_bytes
from common.model import build_model, count_parameters, dense_preset
from common.optim import lr_at
from common.training import (StepTimer, global_sum, resume_state, run_identity, should_save, start_rng,
                             stop_if_not_finite)

zero_sharding = import_module("01_data_parallel.zero_sharding")
zero_accounting = import_module("01_data_parallel.zero_accounting")
zero_stage3 = import_module("01_data_parallel.zero_stage3")

FORMULAS = {0: "M(1+1+α)", 1: "2M + αM/N", 2: "M + (1+α)M/N", 3: "(1+1+α)M/N"}


def parser():
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--zero-stage", type=int, default=3, choices=[1, 2, 3],
                   help="1: shard optimizer state; 2: + gradients; 3: + parameters")
    p.add_argument("--impl", default="ours", choices=["ours", "torch"],
                   help="ours: by hand; torch: ZeroRedundancyOptimizer (stage 1) or FSDP2 fully_shard (2, 3)")
    p.add_argument("--no-prefetch", action="store_true", help="stage 3 (ours): gather each unit only when needed")
    return p


def checked_layout(args, world: int, cfg=None, build: bool = True):
    """Every check this run makes before any communication, on every rank: the model's configuration
    (the DP degree is the world size). Chapter 07's planner asks the same function whether a layout runs
    (`cfg`: a published shape; `build` as in the later chapters' scripts, which build a pipeline plan: here
    there is none)."""
    check_common(args, dp=world, cfg=cfg)
    require(not (args.impl == "torch" and (args.checkpoint_dir or args.resume)),
            "checkpoints are implemented for --impl ours only; drop --checkpoint-dir/--resume or use --impl ours")
    return cfg or dense_preset(args.model, "05_moe_expert_parallel/train_moe.py")   # a mixture is chapter 05's


def identity(args) -> dict:
    """A checkpoint resumes only the same stage: the meta says which (any world size works, the
    file holds the consolidated single-device state)."""
    return {**run_identity(args), "zero_stage": args.zero_stage}


def main(argv=None) -> list[dict]:
    args = parser().parse_args(argv)
    cfg = checked_layout(args, env_world_size())          # bad input fails here, on every rank
    rt = init_distributed(args.device, args.timeout)
    mesh = Mesh(rt.rank, rt.world_size, dp=rt.world_size)
    dp_group, dp_rank, dp = mesh.group("dp"), mesh.coord("dp"), mesh.size("dp")
    data = TextData(args.data, args.seq_len, args.seed)
    resume = resume_state(args, identity(args))      # every rank loads and checks it, so every rank fails alike

    # --- the model: built whole from the seed on every rank, then sharded --------------------------
    model = build_model(cfg, args.seed, rt.device, args.recompute, args.compile, args.recompute_layers)
    start = resume["step"] if resume else 0
    if resume:
        model.load_state_dict(resume["model"], strict=True)
    M = sum(p.numel() * p.element_size() for p in model.parameters())    # before stage 3 takes them away
    trainer = build_trainer(args, model, dp_group, rt.device)   # stage 1 | 2 | 3, ours or PyTorch's
    # the bytes autograd keeps beside the ledger's prediction (`memory()`): ours, stages 1 and 2 (stage 3
    # saves through hooks of its own, FSDP2's parameters are DTensors)
    predicted = activation_ledger.predicted_bytes(cfg, args, args.global_batch // dp // args.microbatches)
    trainer = MeasuredActivations(trainer, model, predicted,
                                  measure=args.impl == "ours" and args.zero_stage < 3 and not args.no_activation_meter)
    if resume:
        trainer.load_optim_state(resume["optim"])

    log = RunLog(rt.rank, args.steps, args.metrics, args.quiet, append=args.resume)
    log.track_mfu(cfg, args.seq_len, args.dtype, rt)          # `mfu` in every row (common/mfu.py)
    log.config_table(f"ZeRO stage {args.zero_stage} — {implementation_name(args)}",
                     config_rows(args, cfg, M, rt, data.describe(), start))
    if rt.world_size == 1:
        log.print("world size 1: the single-device reference. More ranks: "
                  "torchrun --nproc_per_node=4 01_data_parallel/train_zero.py --zero-stage 3")

    tokens_per_step = args.global_batch * args.seq_len
    start_rng(args, resume)                   # torch's generator: seeded, or as the checkpoint left it
    log.start(start + 1)
    for step in range(start + 1, args.steps + 1):
        comm.COUNTER.reset()
        lr = lr_at(step, args.lr, args.warmup, args.steps)
        trainer.set_lr(lr)
        with StepTimer(rt.device) as timer:
            x, y = data.global_batch(step, args.global_batch)                 # (global_batch, S)
            x, y = shard_rows(x, dp_rank, dp), shard_rows(y, dp_rank, dp)     # (global_batch/N, S)
            x, y = x.to(rt.device), y.to(rt.device)
            local_loss = torch.zeros((), device=rt.device)
            for mb in range(args.microbatches):
                xm, ym = shard_rows(x, mb, args.microbatches), shard_rows(y, mb, args.microbatches)
                # stage 2, 3: each unit's reduce-scatter starts in backward, as soon as its gradient exists
                local_loss += trainer.forward_backward(xm, ym, sync=mb == args.microbatches - 1)
            trainer.sync_gradients()    # 1: all-reduce; 2, 3: wait for the reduce-scatters
            grad_norm = trainer.clip_grad_norm(args.clip)   # squares of my shard, summed over DP
            trainer.step()              # AdamW on my shard (+ all-gather of the params in 1, 2)
            trainer.zero_grad()
        memory = trainer.memory()
        loss_value = global_sum(local_loss, dp_group)
        stop_if_not_finite(step, loss_value, grad_norm, args)
        log.log_step(step, loss_value, lr, tokens_per_step, timer.seconds, grad_norm=grad_norm,
                     zero_stage=args.zero_stage, world_size=dp, **memory, **trainer.comm_bytes())
        if should_save(args, step):
            model_state, optim_state = trainer.full_state()     # a collective: every rank takes part
            if rt.is_main:
                path = checkpoint.save(args.checkpoint_dir, step, model_state, optim_state, identity(args))
                log.note(f"checkpoint saved: {path}")
    log.finish({"memory per rank (measured)": format_bytes(sum(memory[k] for k in
                ("param_bytes", "grad_bytes", "optim_bytes")))} if log.history else None)
    shutdown(rt)
    return log.history


def implementation_name(args) -> str:
    """ZeRO by hand, or the PyTorch implementation that stands for this stage."""
    if args.impl == "ours":
        return "by hand"
    return "ZeroRedundancyOptimizer + DDP" if args.zero_stage == 1 else \
        f"FSDP2 fully_shard, reshard_after_forward={args.zero_stage == 3}"


def config_rows(args, cfg, M: int, rt, data: str, start: int) -> dict:
    """The configuration table printed at start: the model's M, and memory per rank by the formula."""
    stage, N = args.zero_stage, rt.world_size
    units = f"embed, {cfg.n_layers} blocks, norm+head" if args.impl == "ours" else "torch's own"
    return {
        "world size (= DP degree N)": N, "device / backend": f"{rt.device} / {rt.backend}", "data": data,
        "model": f"{args.model}: {count_parameters(cfg):,} parameters, M = {format_bytes(M)} fp32",
        "global batch": f"{args.global_batch} seq × {args.seq_len} tokens, {args.global_batch // N} per rank",
        "memory per rank (formula, α=2)": f"{FORMULAS[stage]} = {format_bytes(zero_accounting.zero_memory_bytes(stage, M, N))} "
                                          f"(plain DP: {format_bytes(zero_accounting.zero_memory_bytes(0, M, N))})",
        "units (gather / reduce granularity)": units,
        "resumed from step": start or "-"}


def build_trainer(args, model, group, device):
    """The trainer of `--zero-stage` and `--impl`, chosen once: ours (zero_sharding.py for stages 1 and
    2, zero_stage3.py for 3) or PyTorch's (zero_torch.py). Each exposes the same verbs."""
    kw = dict(lr=args.lr, weight_decay=args.weight_decay, tokens_per_step=args.global_batch * args.seq_len,
              bf16=args.dtype == "bf16")
    if args.impl == "torch":    # imported only when asked for: FSDP2's DTensors cost every rank ~0.8 s of CPU
        zero_torch = import_module("01_data_parallel.zero_torch")
        if args.zero_stage == 1:
            return zero_torch.torch_zero1(model, group, **kw)
        return zero_torch.TorchFSDP2(model, group, device, args.zero_stage, **kw)
    if args.zero_stage == 3:
        return zero_stage3.ZeroStage3(model, zero_sharding.model_units(model), group, prefetch=not args.no_prefetch,
                                      **kw)
    # the optimizer, passed in: ZeRO 1 or 2 over the model's units on the DP group
    zero = zero_sharding.ZeroOptimizer(list(model.named_parameters()), group, args.lr, args.weight_decay,
                                       stage=args.zero_stage, units=zero_sharding.model_units(model))
    return zero_sharding.ZeroDataParallel(model, zero, kw["tokens_per_step"], kw["bf16"])


if __name__ == "__main__":
    run_main(main)
