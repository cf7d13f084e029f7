"""Chapter 06 — DP × TP × PP × EP × CP: chapter 05's 4D run with each sequence split over context parallelism.

    torchrun --nproc_per_node=8 06_context_parallel/train_5d.py        # cp 2, dp 2 = edp 1 × ep 2, pp 2 (default)
    torchrun --nproc_per_node=16 06_context_parallel/train_5d.py --dp 2 --ep 2 --pp 2 --cp 2 --tp 2
    torchrun --nproc_per_node=8 06_context_parallel/train_5d.py --model tiny --cp 4 --pp 2
    python 06_context_parallel/train_5d.py                             # world size 1: the reference

Every degree as in train_4d.py, on the world/cp ranks that CP leaves. The same flags give the same losses
as `python 06_context_parallel/train_5d.py` (world size 1), which is chapter 05's single-device run.
"""
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters

import torch.distributed as dist

from common import checkpoint, comm
from common.cli import base_parser
from common.data import TextData, shard_rows
from common.distributed import env_world_size, init_distributed, shutdown
from common.errors import run_main
from common.mesh import Mesh
from common.metrics import RunLog
from common.model import loss_sum
from common.optim import lr_at
from common.timeline import Timeline
from common.training import (StepTimer, global_sum, resume_state, run_identity, should_save, start_rng,
                             stop_if_not_finite)

tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")          # chapter 02: the TP loss
parallel_3d = import_module("04_3d_combined.parallel_3d")                      # chapter 04: each rank's piece
trainer_3d = import_module("04_3d_combined.trainer_3d")                        # chapter 04: validation
console_3d = import_module("04_3d_combined.console_3d")                        # chapter 04: what it prints
parallel_4d = import_module("05_moe_expert_parallel.parallel_4d")              # chapter 05: the experts
parallel_5d = import_module("06_context_parallel.parallel_5d")                 # this chapter: + CP
trainer_5d = import_module("06_context_parallel.trainer_5d")                   # this chapter: the 5D verbs
context_parallel = import_module("06_context_parallel.context_parallel")       # this chapter: the work balance
ring_attention = import_module("06_context_parallel.ring_attention")           # this chapter: the work tally


def parse_args(argv=None):
    p = base_parser(__doc__.splitlines()[0], pipeline=True)
    p.set_defaults(model="tiny-moe")
    parallel_5d.add_5d_args(p)
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    layout, cfg = parallel_5d.decide_layout(args, env_world_size())      # bad layouts fail here, on every rank
    specs, plan = parallel_3d.plan_pipeline(args, cfg, layout)           # chapter 03: stages and actions
    rt = init_distributed(args.device, args.timeout)
    mesh = Mesh(rt.rank, rt.world_size, joined=layout.joined, **layout.grid())   # (edp, ep, pp, cp, tp)
    dp_rank, cp_rank, tp_group = mesh.coord("dp"), mesh.coord("cp"), mesh.group("tp")
    split = parallel_5d.sequence_split(args, layout)                     # who holds which positions
    data = TextData(args.data, args.seq_len, args.seed)
    resume = resume_state(args)

    # --- this rank's piece: chapter 04's (stage(s), TP shard), then chapter 05's experts, then CP's attention ---
    model, my_specs = parallel_3d.build_local_model(cfg, args, layout, specs, mesh, rt.device, resume and resume["model"],
                                                    then=parallel_5d.then_experts_and_cp(args, layout))
    loss_fn = (lambda logits, y: tensor_parallel.tp_loss_sum(logits, y, tp_group)) if layout.tp > 1 else loss_sum
    shape = parallel_5d.act_shape(args, cfg, layout)                           # (mb, S/cp, D)
    timeline = Timeline(rt.rank)
    trainer = trainer_5d.build_trainer(model, specs, plan, mesh, layout, args, cfg, loss_fn, shape, rt.device,
                                       timeline, resume and resume["optim"])
    start, tokens_per_step = (resume["step"] if resume else 0), args.global_batch * args.seq_len
    log = RunLog(rt.rank, args.steps, args.metrics, args.quiet, append=args.resume)
    log.track_mfu(cfg, args.seq_len, args.dtype, rt)          # `mfu` in every row (common/mfu.py: active experts)
    # tokens_per_step counts each token once: the CP ranks of a row hold different positions of it
    print_start(log, rt, args, cfg, layout, mesh, data, start)

    full_model = None                          # the consolidated weights, for the text sample at the end
    dist.barrier()
    start_rng(args, resume)                   # torch's generator: seeded, or as the checkpoint left it
    log.start(start + 1)
    for step in range(start + 1, args.steps + 1):
        comm.COUNTER.reset()
        ring_attention.WORK.reset()
        lr = lr_at(step, args.lr, args.warmup, args.steps)
        trainer.set_lr(lr)
        timeline.begin_step(step)
        with StepTimer(rt.device) as timer:
            x, y = data.global_batch(step, args.global_batch)                   # (global_batch, S)
            x, y = shard_rows(x, dp_rank, layout.dp), shard_rows(y, dp_rank, layout.dp)   # my rows
            x, y = split.take(x, cp_rank).to(rt.device), split.take(y, cp_rank).to(rt.device)   # my positions: (rows, S/cp)
            # 1. the pipeline schedule runs every micro-batch: TP inside each layer, CP's ring inside each
            #    attention, EP's all-to-alls inside each MoE layer, whose aux terms join that stage's backward;
            #    as soon as one of my stages has its last gradient, its all-reduces start: dense over dp × cp,
            #    experts over edp × cp
            local_loss = trainer.forward_backward(x, y)
            # 2. wait for them (edp × cp, dp × cp); 3. TP: sum the partial gradients of replicated tensors
            trainer.sync_gradients()
            # 4. clip by the norm of the whole model's gradient: TP shards, stages, ep ranks' experts
            grad_norm = trainer.clip_grad_norm(args.clip)
            trainer.step()                                # 5. router statistics and biases; AdamW on my piece
            trainer.zero_grad()
        memory = trainer.memory()
        loss_value = global_sum(local_loss, dist.group.WORLD)                  # last stage, tp rank 0
        stop_if_not_finite(step, loss_value, grad_norm, args)
        # the step's bytes by group (before validation adds its sends), memory, the bubble, the router's numbers
        extra = trainer_3d.step_metrics(memory, timeline, mesh, layout, rt.device, groups=("dp", "tp", "pp", "ep", "cp"))
        extra.update(trainer.router_metrics())
        extra.update(context_parallel.cp_step_metrics(mesh.group("cp"), layout.cp, rt.device))
        if (args.val_every and step % args.val_every == 0) or step == args.steps:
            extra["val_loss"] = trainer_3d.validation_loss(trainer, my_specs, data, step, args, layout, mesh, loss_fn,
                                                           shape, rt.device, take=lambda t: split.take(t, cp_rank))
            log.note(f"step {step}: validation loss {extra['val_loss']:.4f}")
        log.log_step(step, loss_value, lr, tokens_per_step, timer.seconds, grad_norm=grad_norm, **extra)
        if should_save(args, step) or (step == args.steps and args.sample_tokens):
            # the ep ranks of replica edp = 0, cp = 0 hold every expert once between them
            full_model, full_optim = parallel_3d.consolidated_state(trainer, mesh, layout, cfg, replica_dims=("edp", "cp"))
            if rt.is_main and should_save(args, step):
                log.note(f"checkpoint saved: {checkpoint.save(args.checkpoint_dir, step, full_model, full_optim, run_identity(args))}")
    if args.timeline:
        console_3d.write_timeline(args.timeline, timeline, rt, log, args, layout)
    log.finish(console_3d.bubble_row(log.history, args, layout))
    console_3d.print_sample(log, rt, full_model, cfg, args)
    shutdown(rt)
    return log.history


def print_start(log, rt, args, cfg, layout, mesh, data, start: int) -> None:
    """Chapter 05's configuration table and grid, with CP: which ranks share a sequence (cp group), which
    sum the dense gradients (dp_cp group), and the positions each rank holds."""
    cols, rows = console_3d.grid_rows(mesh, extra_cols=("ep group", "edp group", "cp group"))
    cols.append("experts")
    for row in rows:
        row.append(parallel_4d.experts_held(cfg.n_experts, int(row[cols.index("ep")]), layout.ep))
    cols.append("positions")
    split = parallel_5d.sequence_split(args, layout)
    for row in rows:
        row.append("+".join(f"{a}-{b - 1}" for a, b in split.chunks(int(row[cols.index("cp")]))))
    grid = console_3d.grid_table("the mesh: grid = arange(world).view(edp, ep, pp, cp, tp), dp = (edp, ep)", cols, rows)
    config = console_3d.config_rows(args, cfg, layout, rt, data, start)
    config["experts"] = parallel_4d.describe_experts(cfg, args, layout)
    config["context"] = (f"{args.seq_len // layout.cp} of {args.seq_len} positions per rank ({args.cp_split}), "
                         f"{args.cp_attention} attention over cp {layout.cp}" if layout.cp > 1
                         else "cp 1: every rank holds whole sequences, plain causal attention")
    console_3d.print_start(log, rt, "5D parallel pretraining", config, grid,
                           "torchrun --nproc_per_node=8 06_context_parallel/train_5d.py")


if __name__ == "__main__":
    run_main(main)
