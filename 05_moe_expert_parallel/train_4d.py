"""Chapter 05 — DP × TP × PP × EP: chapter 04's full run with the experts spread over expert parallelism.

    torchrun --nproc_per_node=8 05_moe_expert_parallel/train_4d.py            # dp 4 = edp 2 × ep 2, pp 2 (default)
    torchrun --nproc_per_node=8 05_moe_expert_parallel/train_4d.py --dp 2 --ep 2 --tp 2 --pp 2
    torchrun --nproc_per_node=8 05_moe_expert_parallel/train_4d.py --dp 4 --ep 4 --tp 1 --pp 2
    python 05_moe_expert_parallel/train_4d.py                                 # world size 1: the reference

The EP group is drawn from the data-parallel ranks of a stage (--ep divides --dp): dp = edp × ep. The
same flags give the same losses as `python 05_moe_expert_parallel/train_moe.py` (world size 1).
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
parallel_4d = import_module("05_moe_expert_parallel.parallel_4d")              # this chapter: + EP
trainer_4d = import_module("05_moe_expert_parallel.trainer_4d")                # this chapter: the 4D verbs


def parse_args(argv=None):
    p = base_parser(__doc__.splitlines()[0], pipeline=True)
    p.set_defaults(model="tiny-moe")
    parallel_4d.add_4d_args(p)
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    layout, cfg = parallel_4d.decide_layout(args, env_world_size())      # bad layouts fail here, on every rank
    specs, plan = parallel_3d.plan_pipeline(args, cfg, layout)           # chapter 03: stages and actions
    rt = init_distributed(args.device, args.timeout)
    mesh = Mesh(rt.rank, rt.world_size, joined=layout.joined, **layout.grid())   # (edp, ep, pp, tp); dp = (edp, ep)
    dp_rank, tp_group = mesh.coord("dp"), mesh.group("tp")
    data = TextData(args.data, args.seq_len, args.seed)
    resume = resume_state(args)

    # --- this rank's piece: chapter 04's (stage(s), TP shard), then this chapter's step: its experts ---
    model, my_specs = parallel_3d.build_local_model(cfg, args, layout, specs, mesh, rt.device, resume and resume["model"],
                                                    then=parallel_4d.experts_over_ep)
    loss_fn = (lambda logits, y: tensor_parallel.tp_loss_sum(logits, y, tp_group)) if layout.tp > 1 else loss_sum
    shape = parallel_3d.act_shape(args, cfg, layout)                           # (mb, S or S/tp, D)
    timeline = Timeline(rt.rank)
    trainer = trainer_4d.build_trainer(model, specs, plan, mesh, layout, args, cfg, loss_fn, shape, rt.device,
                                       timeline, resume and resume["optim"])
    start, tokens_per_step = (resume["step"] if resume else 0), args.global_batch * args.seq_len
    log = RunLog(rt.rank, args.steps, args.metrics, args.quiet, append=args.resume)
    log.track_mfu(cfg, args.seq_len, args.dtype, rt)          # `mfu` in every row (common/mfu.py: active experts)
    print_start(log, rt, args, cfg, layout, mesh, data, start)

    full_model = None                          # the consolidated weights, for the text sample at the end
    dist.barrier()
    start_rng(args, resume)                   # torch's generator: seeded, or as the checkpoint left it
    log.start(start + 1)
    for step in range(start + 1, args.steps + 1):
        comm.COUNTER.reset()
        lr = lr_at(step, args.lr, args.warmup, args.steps)
        trainer.set_lr(lr)
        timeline.begin_step(step)
        with StepTimer(rt.device) as timer:
            x, y = data.global_batch(step, args.global_batch)                   # (global_batch, S)
            x, y = shard_rows(x, dp_rank, layout.dp).to(rt.device), shard_rows(y, dp_rank, layout.dp).to(rt.device)
            # 1. the pipeline schedule runs every micro-batch: TP inside each layer, EP's all-to-alls inside
            #    each MoE layer, whose aux terms join that stage's backward; as soon as one of my stages has
            #    its last gradient, its all-reduces start: dense over dp, experts over edp
            local_loss = trainer.forward_backward(x, y)
            # 2. wait for them (edp, dp); 3. TP: sum the partial gradients of replicated tensors
            trainer.sync_gradients()
            # 4. clip by the norm of the whole model's gradient: TP shards, stages, ep ranks' experts
            grad_norm = trainer.clip_grad_norm(args.clip)
            trainer.step()                                # 5. router statistics and biases; AdamW on my piece
            trainer.zero_grad()
        memory = trainer.memory()
        loss_value = global_sum(local_loss, dist.group.WORLD)                  # last stage, tp rank 0
        stop_if_not_finite(step, loss_value, grad_norm, args)
        # the step's bytes by group (before validation adds its sends), memory, the bubble, the router's numbers
        extra = trainer_3d.step_metrics(memory, timeline, mesh, layout, rt.device, groups=("dp", "tp", "pp", "ep"))
        extra.update(trainer.router_metrics())
        if (args.val_every and step % args.val_every == 0) or step == args.steps:
            extra["val_loss"] = trainer_3d.validation_loss(trainer, my_specs, data, step, args, layout, mesh, loss_fn,
                                                           shape, rt.device)
            log.note(f"step {step}: validation loss {extra['val_loss']:.4f}")
        log.log_step(step, loss_value, lr, tokens_per_step, timer.seconds, grad_norm=grad_norm, **extra)
        if should_save(args, step) or (step == args.steps and args.sample_tokens):
            # the ep ranks of replica edp = 0 hold every expert once between them
            full_model, full_optim = parallel_3d.consolidated_state(trainer, mesh, layout, cfg, replica_dims=("edp",))
            if rt.is_main and should_save(args, step):
                log.note(f"checkpoint saved: {checkpoint.save(args.checkpoint_dir, step, full_model, full_optim, run_identity(args))}")
    if args.timeline:
        console_3d.write_timeline(args.timeline, timeline, rt, log, args, layout)
    log.finish(console_3d.bubble_row(log.history, args, layout))
    console_3d.print_sample(log, rt, full_model, cfg, args)
    shutdown(rt)
    return log.history


def print_start(log, rt, args, cfg, layout, mesh, data, start: int) -> None:
    """Chapter 04's configuration table and grid, with the experts: which ranks share them (ep group),
    which hold the same ones (edp group), and which experts each rank holds."""
    cols, rows = console_3d.grid_rows(mesh, extra_cols=("ep group", "edp group"))
    cols.append("experts")
    for row in rows:
        row.append(parallel_4d.experts_held(cfg.n_experts, int(row[cols.index("ep")]), layout.ep))
    grid = console_3d.grid_table("the mesh: grid = arange(world).view(edp, ep, pp, tp), dp = (edp, ep)", cols, rows)
    config = console_3d.config_rows(args, cfg, layout, rt, data, start)
    config["experts"] = parallel_4d.describe_experts(cfg, args, layout)
    console_3d.print_start(log, rt, "4D parallel pretraining", config, grid,
                           "torchrun --nproc_per_node=8 05_moe_expert_parallel/train_4d.py")


if __name__ == "__main__":
    run_main(main)
