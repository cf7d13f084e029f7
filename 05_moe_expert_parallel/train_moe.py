"""Chapter 05 — mixture of experts with expert parallelism. Each rank holds E/ep experts of every layer.

    python 05_moe_expert_parallel/train_moe.py                                # world size 1: the reference
    torchrun --nproc_per_node=4 05_moe_expert_parallel/train_moe.py           # EP=4 (8 experts: 2 per rank)
    torchrun --nproc_per_node=4 05_moe_expert_parallel/train_moe.py --ep 2    # EP=2 × DP=2
    torchrun --nproc_per_node=4 05_moe_expert_parallel/train_moe.py --capacity-factor 1.0
    torchrun --nproc_per_node=4 05_moe_expert_parallel/train_moe.py --aux-loss-coef 0 --router-bias-rate 0.001

Every rank takes its own rows of the global batch; the EP degree defaults to the largest that divides
both the world size and the number of experts, the rest of the world is data parallelism.
The same flags give the same losses in every layout.
"""
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters

import torch
import torch.distributed as dist

from common import checkpoint, comm
from common.activation_meter import MeasuredActivations
from common.cli import base_parser, check_common
from common.data import TextData, shard_rows
from common.distributed import env_world_size, init_distributed, shutdown
from common.errors import run_main
from common.mesh import Mesh
from common.metrics import RunLog, format_bytes
from common.model import build_model, count_parameters
from common.moe_args import add_moe_args, check_moe_args, expert_parallel_degree, moe_model_config
from common.optim import lr_at
from common.training import (StepTimer, global_sum, resume_state, run_identity, should_save, start_rng,
                             stop_if_not_finite)

expert_parallel = import_module("05_moe_expert_parallel.expert_parallel")
moe_trainer = import_module("05_moe_expert_parallel.moe_trainer")

NOTE_EVERY = 10    # steps between the load / dropped-tokens lines on the console


def parse_args(argv=None):
    p = base_parser(__doc__.splitlines()[0])
    p.set_defaults(model="tiny-moe")
    add_moe_args(p)
    args = p.parse_args(argv)
    world = env_world_size()
    check_common(args, dp=world)             # every rank takes its own rows: the batch splits world-ways
    cfg = moe_model_config(args)
    check_moe_args(args, cfg, world, expert_parallel_degree(args.ep, cfg, world))
    return args


def identity(args, cfg) -> dict:
    """What a checkpoint must match: the run's, with the configuration as trained (--top-k applied)."""
    return {**run_identity(args), "model_config": cfg.to_dict()}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rt = init_distributed(args.device, args.timeout)
    cfg = moe_model_config(args)
    ep = expert_parallel_degree(args.ep, cfg, rt.world_size)
    # grid arange(world).view(edp, ep): dp (every rank here) = edp × ep, the EP group innermost
    mesh = Mesh(rt.rank, rt.world_size, edp=rt.world_size // ep, ep=ep, joined={"dp": ("edp", "ep")})
    data = TextData(args.data, args.seq_len, args.seed)
    resume = resume_state(args, identity(args, cfg))       # every rank loads it, so every rank can fail alike

    # --- the model: build the full one from the seed (or the checkpoint), keep this rank's experts --
    model = build_model(cfg, args.seed, rt.device, args.recompute, args.compile, args.recompute_layers)
    start = 0
    if resume:                       # the consolidated single-device state, whatever --ep saved it
        model.load_state_dict(resume["model"], strict=True)
        start = resume["step"]
    expert_parallel.parallelize_experts(model, mesh.group("ep"))
    optimizer = moe_trainer.replicated_over_groups(model, mesh, args.lr, args.weight_decay)  # on what I hold
    trainer = moe_trainer.ExpertParallelTrainer(model, optimizer, mesh, args, cfg, rt.device)
    # the bytes autograd keeps (`memory()`); MoE layers route rows, which the ledger does not count: null
    trainer = MeasuredActivations(trainer, model, predicted=None, measure=not args.no_activation_meter)
    if resume:
        trainer.load_optim_state(resume["optim"])

    log = RunLog(rt.rank, args.steps, args.metrics, args.quiet, append=args.resume)
    log.track_mfu(cfg, args.seq_len, args.dtype, rt)          # `mfu` in every row (common/mfu.py: active experts)
    log.config_table(f"mixture of experts — dp {rt.world_size} = edp {mesh.size('edp')} × ep {ep}",
                     layout_rows(args, cfg, mesh, rt, trainer.memory(), start) | {"data": data.describe()})
    if rt.world_size == 1:
        log.print("world size 1: the single-device reference. More ranks: "
                  "torchrun --nproc_per_node=4 05_moe_expert_parallel/train_moe.py [--ep 2]")

    tokens_per_step = args.global_batch * args.seq_len
    start_rng(args, resume)                   # torch's generator: seeded, or as the checkpoint left it
    log.start(start + 1)
    for step in range(start + 1, args.steps + 1):
        comm.COUNTER.reset()
        lr = lr_at(step, args.lr, args.warmup, args.steps)
        trainer.set_lr(lr)
        with StepTimer(rt.device) as timer:
            x, y = data.global_batch(step, args.global_batch)                             # (global_batch, S)
            x, y = shard_rows(x, rt.rank, rt.world_size), shard_rows(y, rt.rank, rt.world_size)   # my rows
            x, y = x.to(rt.device), y.to(rt.device)
            local_loss = torch.zeros((), device=rt.device)
            for mb in range(args.microbatches):
                xm, ym = shard_rows(x, mb, args.microbatches), shard_rows(y, mb, args.microbatches)
                # forward and backward; inside each MoE layer: route, all-to-all out, experts, all-to-all back
                local_loss += trainer.forward_backward(xm, ym, sync=mb == args.microbatches - 1)
            trainer.sync_gradients()        # dense: all-reduce over all ranks; experts: over edp
            grad_norm = trainer.clip_grad_norm(args.clip)
            trainer.step()                  # router statistics summed over all ranks, router bias, AdamW
            trainer.zero_grad()
        memory = trainer.memory()
        loss_value = global_sum(local_loss, dist.group.WORLD)
        stop_if_not_finite(step, loss_value, grad_norm, args)
        router = trainer.router_metrics()
        by_group = comm.COUNTER.by_group()
        log.log_step(step, loss_value, lr, tokens_per_step, timer.seconds, grad_norm=grad_norm, **router,
                     comm_bytes=comm.COUNTER.total(), comm_bytes_ep=by_group.get("ep", 0),
                     comm_bytes_dp=by_group.get("dp", 0), dp=rt.world_size, ep=ep, edp=rt.world_size // ep,
                     **memory)
        if router and (step % NOTE_EVERY == 0 or step == args.steps):
            log.note(f"step {step}: loss {loss_value:.4f}, expert load max/mean {router['max_over_mean_load']:.2f} "
                     f"(mean over layers), dropped {100 * router['dropped_fraction']:.1f}% of slots, "
                     f"aux {router['aux_loss']:.5f}, z {router['z_loss']:.5f}")
        if should_save(args, step):        # every DP-coordinate-0 rank sends its experts to rank 0
            full_model, full_optim = trainer.full_state()
            if rt.is_main:
                path = checkpoint.save(args.checkpoint_dir, step, full_model, full_optim, identity(args, cfg))
                log.note(f"checkpoint saved: {path}")
    log.finish(load_rows(log.history[-1]) if log.history and cfg.n_experts else None)
    shutdown(rt)
    return log.history


def layout_rows(args, cfg, mesh, rt, memory: dict, start: int) -> dict:
    """The configuration table printed at start: the grid, who holds which experts, who sums what."""
    ep, edp, world = mesh.size("ep"), mesh.size("edp"), rt.world_size
    T_rank = args.global_batch // world * args.seq_len            # tokens per rank per step
    moe = cfg.n_experts > 0
    return {
        "world size": f"{world} = dp {world} = edp {edp} × ep {ep}",
        "device / backend": f"{rt.device} / {rt.backend}",
        "mesh (edp, ep)": "\n" + mesh.describe(),
        "experts per rank": ", ".join(f"ep={j}: {list(expert_parallel.local_experts(cfg.n_experts, j, ep))}"
                                      for j in range(ep)) if moe else "- (dense model)",
        "gradient all-reduce": f"dense over dp (all {world} ranks); experts over edp (the ranks holding "
                               f"the same experts): {mesh.lines('edp')}",
        "model": f"{args.model}: {count_parameters(cfg):,} parameters, {count_parameters(cfg, active=True):,} "
                 f"active per token" + (f" ({cfg.n_experts} experts, top-{cfg.top_k})" if moe else " (dense)"),
        "parameters on this rank": f"{format_bytes(memory['param_bytes'])}, of which experts "
                                   f"{format_bytes(memory['expert_param_bytes'])}",
        "routing": ("dropless" if args.capacity_factor is None else f"capacity factor {args.capacity_factor}")
                   + f", aux α={args.aux_loss_coef}, z β={args.z_loss_coef}, bias γ={args.router_bias_rate}",
        "all-to-all rows per exchange": f"≈ (ep-1)/ep·T·k = {(ep - 1) / ep * T_rank * cfg.top_k:,.0f} of "
                                        f"{cfg.dim} floats sent per rank, 4 exchanges per layer per step",
        "global batch": f"{args.global_batch} seq × {args.seq_len} tokens; {args.global_batch // world} "
                        f"seq per rank in {args.microbatches} micro-batch(es)",
        "resumed from step": start or "-"}


def load_rows(row: dict) -> dict:
    """The last step's tokens per expert, one summary row per layer (what the plots show over steps)."""
    out = {f"layer {i} load": " ".join(f"{n:>4}" for n in load) for i, load in enumerate(row["expert_load"])}
    out["max/mean load (mean over layers)"] = f"{row['max_over_mean_load']:.2f}"
    out["dropped slots"] = f"{100 * row['dropped_fraction']:.1f}%"
    return out


if __name__ == "__main__":
    run_main(main)
