"""Chapter 04 — DP × TP × PP (× EP) on one mesh: the full pretraining run, built from chapters 01-03 (and 05).

    torchrun --nproc_per_node=8 04_3d_combined/train_3d.py                 # dp 2 × tp 2 × pp 2 (default)
    torchrun --nproc_per_node=8 04_3d_combined/train_3d.py --dp 1 --tp 2 --pp 4 --schedule interleaved
    torchrun --nproc_per_node=8 04_3d_combined/train_3d.py --model tiny-moe   # 4D: dp 2·ep 2 × tp 2 × pp 2
    torchrun --nproc_per_node=8 04_3d_combined/train_3d.py --model tiny-moe --dp 4 --ep 4 --tp 1 --pp 2
    python 04_3d_combined/train_3d.py                                      # world size 1: the reference
    python 04_3d_combined/plot_loss.py runs/3d/metrics.jsonl               # the loss curve

The degrees must multiply to the world size; those not given are chosen from it (TP 2, PP 2, DP the rest).
With a mixture-of-experts preset, the EP group is drawn from the DP ranks (--ep divides --dp).
"""
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters

import torch
import torch.distributed as dist
from rich.table import Table

from common import checkpoint, comm
from common.cli import (NON_NEGATIVE_INT, OUTPUT_FILE, POSITIVE_INT, base_parser, check_common,
                        pipeline_microbatches)
from common.data import TextData, shard_rows
from common.distributed import env_world_size, init_distributed, shutdown
from common.errors import run_main
from common.generate import sample
from common.metrics import RunLog
from common.model import describe_size, loss_sum
from common.moe_args import add_moe_args, check_moe_args, expert_parallel_degree, moe_model_config
from common.optim import lr_at
from common.timeline import Timeline, write_chrome_trace
from common.training import StepTimer, global_sum, resume_state, run_identity, should_save, stop_if_not_finite

tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")          # chapter 02: the TP loss
pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")  # chapter 03: schedules
pipeline_executor = import_module("03_pipeline_parallel.pipeline_executor")    # chapter 03: validation forward
pipeline_trainer = import_module("03_pipeline_parallel.pipeline_trainer")      # chapter 03: measured bubble
parallel_3d = import_module("04_3d_combined.parallel_3d")                      # this chapter: each rank's piece
trainer_3d = import_module("04_3d_combined.trainer_3d")                        # this chapter: the loop's verbs


def parse_args(argv=None):
    p = base_parser(__doc__.splitlines()[0], pipeline=True)
    p.add_argument("--dp", type=POSITIVE_INT, default=None, help="data-parallel degree (default: what is left)")
    p.add_argument("--tp", type=POSITIVE_INT, default=None, help="tensor-parallel degree (default: 2 if possible)")
    p.add_argument("--pp", type=POSITIVE_INT, default=None, help="pipeline stages (default: 2 if possible)")
    p.add_argument("--schedule", default="1f1b", choices=pipeline_schedules.SCHEDULES, help="pipeline schedule")
    p.add_argument("--virtual-stages", type=POSITIVE_INT, default=1, help="model chunks per pipeline rank (interleaved)")
    p.add_argument("--sequence-parallel", action="store_true", help="TP with sequence parallelism")
    p.add_argument("--zero-stage", type=int, default=0, choices=[0, 1],
                   help="1: shard AdamW's state over the DP group (chapter 01's ZeRO-1)")
    p.add_argument("--val-every", type=NON_NEGATIVE_INT, default=25, help="validation loss every N steps (0: only at the end)")
    p.add_argument("--val-batches", type=POSITIVE_INT, default=2, help="global batches in one validation")
    p.add_argument("--sample-tokens", type=NON_NEGATIVE_INT, default=200, help="bytes of text to generate at the end (0: none)")
    p.add_argument("--timeline", type=OUTPUT_FILE, default=None,
                   help="write every rank's pipeline events as a Chrome trace JSON here (default: none)")
    add_moe_args(p, ep_help="expert-parallel degree, drawn from the data-parallel ranks of each stage (default: "
                            "the largest that divides both --dp and the number of experts; 1 for a dense model)")
    args = p.parse_args(argv)
    world = env_world_size()
    args.dp, args.tp, args.pp = parallel_3d.default_degrees(world, args.dp, args.tp, args.pp)
    args.microbatches = pipeline_microbatches(args, args.dp, args.pp)
    check_common(args, dp=args.dp)
    cfg = moe_model_config(args)
    ep = expert_parallel_degree(args.ep, cfg, args.dp)     # default: the largest dividing --dp and the experts
    check_moe_args(args, cfg, world, ep)                   # the MoE flags; a dense model refuses them
    parallel_3d.check_expert_layout(args, cfg, ep)         # EP inside DP; what experts cannot share
    args.ep = ep
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    cfg = moe_model_config(args)                                         # the preset, with --top-k applied
    specs, plan = parallel_3d.plan_layout(args, cfg, env_world_size())   # bad layouts fail here, on every rank
    rt = init_distributed(args.device, args.timeout)
    mesh = parallel_3d.build_mesh(rt.rank, rt.world_size, args)          # (dp/ep, ep, pp, tp); dp = (edp, ep)
    dp_rank, tp_rank, pp_rank = mesh.coord("dp"), mesh.coord("tp"), mesh.coord("pp")
    tp_group, pp_group = mesh.group("tp"), mesh.group("pp")
    data = TextData(args.data, args.seq_len, args.seed)
    resume = resume_state(args)

    # --- this rank's piece: the reference model → its pipeline stage(s) → its experts → its TP shard ---
    model, my_specs = parallel_3d.build_local_model(cfg, args, specs, mesh, rt.device, resume and resume["model"])
    start = resume["step"] if resume else 0

    m, tokens_per_step = args.microbatches, args.global_batch * args.seq_len
    mb_rows = args.global_batch // args.dp // m
    # The loss on the last stage: vocab-parallel cross-entropy when the logits are split over TP.
    loss_fn = (lambda logits, y: tensor_parallel.tp_loss_sum(logits, y, tp_group)) if args.tp > 1 else loss_sum
    shape = parallel_3d.act_shape(args, cfg, mb_rows)                          # (mb, S or S/tp, D)
    timeline = Timeline(rt.rank)
    # AdamW, or ZeRO-1 with --zero-stage 1: chosen here, once; the loop drives either through the same verbs
    trainer = trainer_3d.build_trainer(model, specs, plan, mesh, args, cfg, loss_fn, shape, rt.device, timeline,
                                       resume and resume["optim"])

    log = RunLog(rt.rank, args.steps, args.metrics, args.quiet)
    log.track_mfu(cfg, args.seq_len, args.dtype, rt)          # `mfu` in every row (common/mfu.py)
    ep_note = f" (dp = dp/ep {args.dp // args.ep} × ep {args.ep})" if args.ep > 1 else ""
    log.config_table("4D parallel pretraining" if cfg.n_experts else "3D parallel pretraining", {
        "world size": f"{rt.world_size} = dp {args.dp} × pp {args.pp} × tp {args.tp}{ep_note}"
                      + (" (+ sequence parallel)" if args.sequence_parallel else ""),
        "device / backend": f"{rt.device} / {rt.backend}", "data": data.describe(),
        "model": f"{args.model}: {describe_size(cfg)}, {cfg.n_layers} layers",
        "experts": parallel_3d.describe_experts(cfg, args),
        "optimizer": "ZeRO-1 over the DP group (chapter 01)" if args.zero_stage else "AdamW on each rank's piece",
        "pipeline": f"{args.schedule}, {m} micro-batch(es) of {mb_rows} seq, {args.virtual_stages} virtual stage(s), "
                    f"theory bubble {pipeline_schedules.theory_bubble(args.schedule, args.pp, m, args.virtual_stages):.3f}",
        "global batch": f"{args.global_batch} seq × {args.seq_len} tokens, warmup {args.warmup} + cosine, clip {args.clip}",
        "resumed from step": start or "-"})
    if rt.is_main and not args.quiet:
        cols, rows = parallel_3d.grid_rows(mesh)
        grid_shape = "dp/ep, ep, pp, tp), dp = (edp, ep" if args.ep > 1 else "dp, pp, tp"
        grid = Table(title=f"the mesh: grid = arange(world).view({grid_shape})", title_justify="left")
        for col in cols:
            grid.add_column(col)
        for row in rows:
            grid.add_row(*row)
        log.print(grid)
    if rt.world_size == 1:
        log.print("world size 1: the single-device reference. The 3D run: "
                  "torchrun --nproc_per_node=8 04_3d_combined/train_3d.py")

    def validate(step: int) -> float:
        total = torch.zeros((), device=rt.device)
        for i in range(args.val_batches):
            x, y = data.global_batch(step * 1000 + i, args.global_batch, split="valid")
            x, y = shard_rows(x, dp_rank, args.dp).to(rt.device), shard_rows(y, dp_rank, args.dp).to(rt.device)
            total += pipeline_executor.forward_only_loss_sum(
                model, my_specs, pp_rank, mesh.group_ranks["pp"], pp_group, [shard_rows(x, k, m) for k in range(m)],
                [shard_rows(y, k, m) for k in range(m)], loss_fn, shape, rt.device)
        mine = total if tp_rank == 0 else torch.zeros_like(total)      # TP ranks hold the same value
        return global_sum(mine, dist.group.WORLD) / (tokens_per_step * args.val_batches)

    dist.barrier()
    log.start(start + 1)
    for step in range(start + 1, args.steps + 1):
        comm.COUNTER.reset()
        lr = lr_at(step, args.lr, args.warmup, args.steps)
        trainer.set_lr(lr)
        timeline.begin_step(step)
        with StepTimer(rt.device) as timer:
            x, y = data.global_batch(step, args.global_batch)                   # (global_batch, S)
            x, y = shard_rows(x, dp_rank, args.dp).to(rt.device), shard_rows(y, dp_rank, args.dp).to(rt.device)
            # 1. the pipeline schedule runs forward and backward of every micro-batch (TP inside each
            #    layer, EP's all-to-alls inside each MoE layer, whose aux terms join that stage's backward);
            #    as soon as one of my stages has its last gradient, its DP all-reduces start in the
            #    background, overlapping the rest of the schedule (the pipeline's cool-down)
            local_loss = trainer.forward_backward(x, y)
            # 2. DP: wait for those all-reduces (experts: over EDP); 3. TP: sum the partial gradients of replicated tensors
            trainer.sync_gradients()
            # 4. clip by the norm of the whole model's gradient: TP shards, stages, EP's experts hold different parts
            grad_norm = trainer.clip_grad_norm(args.clip)
            trainer.step()                                # 5. router statistics; AdamW on my piece (ZeRO-1: my shard)
            trainer.zero_grad()
        memory = trainer.memory()
        loss_value = global_sum(local_loss, dist.group.WORLD)                  # last stage, tp rank 0
        stop_if_not_finite(step, loss_value, grad_norm, args)
        # the step's traffic, by group (counted before validation adds its forward-only sends)
        extra = {"comm_bytes": comm.COUNTER.total(), **{f"comm_bytes_{g}": comm.COUNTER.total(g) for g in ("dp", "tp", "pp", "ep")}}
        extra["optim_bytes"] = memory["optim_bytes"]
        extra.update(trainer.router_metrics())        # aux_loss, z_loss, expert load... (none for a dense model)
        extra.update(pipeline_trainer.step_stats(timeline, memory["peak_activation_bytes"], pp_group, args.pp, rt.device))
        if (args.val_every and step % args.val_every == 0) or step == args.steps:
            extra["val_loss"] = validate(step)
            log.note(f"step {step}: validation loss {extra['val_loss']:.4f}")
        log.log_step(step, loss_value, lr, tokens_per_step, timer.seconds, grad_norm=grad_norm, **extra)
        if should_save(args, step) or (step == args.steps and args.sample_tokens):
            full_model, full_optim = parallel_3d.consolidated_state(trainer, mesh, args, cfg)
            if rt.is_main and should_save(args, step):
                log.note(f"checkpoint saved: {checkpoint.save(args.checkpoint_dir, step, full_model, full_optim, run_identity(args))}")
    if args.timeline:
        events = timeline.gather()
        if rt.is_main:
            write_chrome_trace(args.timeline, events, {
                "schedule": args.schedule, "dp": args.dp, "tp": args.tp, "pp": args.pp, "microbatches": m,
                "virtual_stages": args.virtual_stages,
                "theory_bubble": pipeline_schedules.theory_bubble(args.schedule, args.pp, m, args.virtual_stages),
                **timeline.clock_metadata()})
            log.note(f"timeline written: {args.timeline} (plot: python 03_pipeline_parallel/plot_timeline.py)")
    log.finish()
    if args.sample_tokens and rt.is_main and log.history and not args.quiet:
        prompt = "The "
        text = sample(full_model, cfg, prompt, args.sample_tokens, seed=args.seed)
        log.print(f"[bold]sample from the trained model[/bold] (prompt {prompt!r}):\n{prompt}{text}")
    shutdown(rt)
    return log.history


if __name__ == "__main__":
    run_main(main)
