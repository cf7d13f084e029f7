"""Chapter 01, part two — ZeRO: data parallelism whose ranks share the memory instead of copying it.

    python 01_data_parallel/train_zero.py                                   # world size 1: the reference
    torchrun --nproc_per_node=4 01_data_parallel/train_zero.py --zero-stage 1|2|3
    torchrun --nproc_per_node=4 01_data_parallel/train_zero.py --zero-stage 3 --impl torch   # FSDP2

The DP degree is the world size. Every stage gives the same losses as train_dp.py with the same flags.
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
from common.model import PRESETS, build_model, count_parameters, loss_sum
from common.optim import clip_by_global_norm, lr_at, set_lr
from common.training import StepTimer, global_sum, run_identity, should_save

zs = import_module("01_data_parallel.zero_sharding")
z3 = import_module("01_data_parallel.zero_stage3")

FORMULAS = {0: "M(1+1+α)", 1: "2M + αM/N", 2: "M + (1+α)M/N", 3: "(1+1+α)M/N"}


def parse_args(argv=None):
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--zero-stage", type=int, default=3, choices=[1, 2, 3],
                   help="1: shard optimizer state; 2: + gradients; 3: + parameters")
    p.add_argument("--impl", default="ours", choices=["ours", "torch"],
                   help="ours: by hand; torch: ZeroRedundancyOptimizer (stage 1) or FSDP2 fully_shard (2, 3)")
    p.add_argument("--no-prefetch", action="store_true", help="stage 3 (ours): gather each unit only when needed")
    args = p.parse_args(argv)
    check_common(args, dp=env_world_size())
    require(not (args.impl == "torch" and (args.checkpoint_dir or args.resume)),
            "checkpoints are implemented for --impl ours only; drop --checkpoint-dir/--resume or use --impl ours")
    return args


def identity(args) -> dict:
    """A checkpoint resumes only the same stage: the meta says which (any world size works, the
    file holds the consolidated single-device state)."""
    return {**run_identity(args), "zero_stage": args.zero_stage}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rt = init_distributed(args.device, args.timeout)
    mesh = Mesh(rt.rank, rt.world_size, dp=rt.world_size)
    dp_group, dp_rank, dp = mesh.group("dp"), mesh.coord("dp"), mesh.size("dp")
    data = TextData(args.data, args.seq_len, args.seed)
    cfg = PRESETS[args.model]
    resume = None
    if args.resume:   # every rank loads and checks it, so every rank fails alike
        resume = checkpoint.load(checkpoint.latest_path(args.checkpoint_dir), identity(args))
        torch.set_rng_state(resume["rng"])

    # --- the model: built whole from the seed on every rank, then sharded --------------------------
    model = build_model(cfg, args.seed, rt.device)
    M = sum(p.numel() * p.element_size() for p in model.parameters())
    start = resume["step"] if resume else 0
    if resume:
        model.load_state_dict(resume["model"], strict=True)
    stage, ours = args.zero_stage, args.impl == "ours"
    wrapped = model
    if ours and stage in (1, 2):
        zero = zs.ZeroOptimizer(list(model.named_parameters()), dp_group, args.lr, args.weight_decay,
                                stage=stage, units=zs.model_units(model))
    elif ours:
        zero = z3.ZeroStage3(model, zs.model_units(model), dp_group, args.lr, args.weight_decay,
                             prefetch=not args.no_prefetch)
    elif stage == 1:
        zt = import_module("01_data_parallel.zero_torch")
        wrapped, optimizer = zt.build_zero1(model, dp_group, args.lr, args.weight_decay)
    else:
        zt = import_module("01_data_parallel.zero_torch")
        optimizer = zt.wrap_fsdp2(model, dp_group, rt.device, stage)
        for g, wd in zip(optimizer.param_groups, (args.weight_decay, 0.0)):
            g["weight_decay"] = wd
    if resume and ours:
        zs.load_optim_pieces(zero.units, zero.pieces, zero.optimizer, resume["optim"])

    log = RunLog(rt.rank, args.steps, args.metrics, args.quiet)
    impl = "by hand" if ours else ("ZeroRedundancyOptimizer + DDP" if stage == 1 else
                                   f"FSDP2 fully_shard, reshard_after_forward={stage == 3}")
    log.config_table(f"ZeRO stage {stage} — {impl}", {
        "world size (= DP degree N)": rt.world_size, "device / backend": f"{rt.device} / {rt.backend}",
        "model": f"{args.model}: {count_parameters(cfg):,} parameters, M = {format_bytes(M)} fp32",
        "global batch": f"{args.global_batch} seq × {args.seq_len} tokens, {args.global_batch // dp} per rank",
        "memory per rank (formula, α=2)": f"{FORMULAS[stage]} = {format_bytes(formula_bytes(stage, M, dp))} "
                                          f"(plain DP: {format_bytes(formula_bytes(0, M, dp))})",
        "units (gather / reduce granularity)": "embed, 8 blocks, norm+head" if ours else "torch's own",
        "resumed from step": start or "-"})
    if rt.world_size == 1:
        log.print("world size 1: the single-device reference. More ranks: "
                  "torchrun --nproc_per_node=4 01_data_parallel/train_zero.py --zero-stage 3")

    tokens_per_step = args.global_batch * args.seq_len
    log.start(start + 1)
    for step in range(start + 1, args.steps + 1):
        comm.COUNTER.reset()
        lr = lr_at(step, args.lr, args.warmup, args.steps)
        if ours:
            zero.set_lr(lr)
            if stage == 3:
                zero.peak_param_bytes = zero.alive_bytes     # the peak is per step
        else:
            set_lr(optimizer, lr)
        with StepTimer(rt.device) as timer:
            x, y = data.global_batch(step, args.global_batch)                 # (global_batch, S)
            x, y = shard_rows(x, dp_rank, dp), shard_rows(y, dp_rank, dp)     # (global_batch/N, S)
            x, y = x.to(rt.device), y.to(rt.device)
            local_loss = torch.zeros((), device=rt.device)
            for mb in range(args.microbatches):
                last = mb == args.microbatches - 1
                xm, ym = shard_rows(x, mb, args.microbatches), shard_rows(y, mb, args.microbatches)
                no_sync = wrapped.no_sync() if (not last and not ours and stage == 1) else nullcontext()
                with no_sync, torch.autocast(rt.device.type, torch.bfloat16, enabled=args.dtype == "bf16"):
                    logits = forward_stage3(model, zero, xm) if ours and stage == 3 else wrapped(xm)
                    loss = loss_sum(logits, ym) / tokens_per_step
                    fsdp_mean = dp if not ours and stage > 1 else 1   # FSDP2 averages: undo it
                    (loss * fsdp_mean).backward()   # stage 2/3: reduce-scatters start here, unit by unit
                local_loss += loss.detach()
            if ours:
                zero.sync_gradients()    # 1: all-reduce; 2, 3: wait for the reduce-scatters
                grad_norm = zero.clip_grad_norm(args.clip)   # squares of my shard, summed over DP
                zero.step()                # AdamW on my shard (+ all-gather of the params in 1, 2)
                zero.zero_grad()
            else:
                grad_norm = (zt.clip_fsdp2(model, args.clip, dp_group) if stage > 1 else
                             clip_by_global_norm([p.grad for p in model.parameters()], args.clip))
                optimizer.step()
                memory = zt.measured_memory(model, optimizer)        # grads still there: measure now
                optimizer.zero_grad(set_to_none=stage > 1)
        loss_value = global_sum(local_loss, dp_group)
        if ours:
            memory = zero.memory()
        counted = ours or stage == 1       # FSDP2's collectives bypass our counter
        log.log_step(step, loss_value, lr, tokens_per_step, timer.seconds, grad_norm=grad_norm,
                     zero_stage=stage, world_size=dp, **memory,
                     comm_bytes=comm.COUNTER.total() if counted else None,
                     comm_bytes_sent=sum(comm.COUNTER.sent.values()) if counted else None)
        if should_save(args, step):
            model_state, optim_state = zero.full_state()     # a collective: every rank takes part
            if rt.is_main:
                path = checkpoint.save(args.checkpoint_dir, step, model_state, optim_state, identity(args))
                log.note(f"checkpoint saved: {path}")
    log.finish({"memory per rank (measured)": format_bytes(sum(memory[k] for k in
                ("param_bytes", "grad_bytes", "optim_bytes")))} if log.history else None)
    shutdown(rt)
    return log.history


def forward_stage3(model, zero, tokens):
    """The model's forward, unit by unit, each unit's weights gathered just in time (zero.run)."""
    h = zero.run(0, model.embed, tokens)                                     # (B, S, D)
    for i, layer in enumerate(model.layers):
        h = zero.run(1 + i, layer, h, model.rope_cos, model.rope_sin)        # (B, S, D)
    return zero.run(1 + len(model.layers), model.head, h)                   # (B, S, V)


def formula_bytes(stage: int, M: float, N: int, alpha: float = 2.0) -> float:
    """Per-rank bytes of parameters + gradients + optimizer state (stage 0 = plain DP)."""
    return {0: M * (2 + alpha), 1: 2 * M + alpha * M / N, 2: M + (1 + alpha) * M / N,
            3: (2 + alpha) * M / N}[stage]


if __name__ == "__main__":
    run_main(main)
