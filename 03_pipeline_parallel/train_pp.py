"""Chapter 03 — pipeline parallelism. The model is cut into stages, micro-batches flow through them.

    python 03_pipeline_parallel/train_pp.py                                   # world size 1: one stage
    torchrun --nproc_per_node=4 03_pipeline_parallel/train_pp.py --schedule 1f1b --microbatches 8
    torchrun --nproc_per_node=4 03_pipeline_parallel/train_pp.py --schedule interleaved --virtual-stages 2
    torchrun --nproc_per_node=4 03_pipeline_parallel/train_pp.py --schedule zb-h1 --timeline runs/zb.json
    python 03_pipeline_parallel/train_pp.py --pp 4 --microbatches 8 --schedule 1f1b --print-schedule

--pp defaults to the world size; with fewer, the remaining factor is data parallelism
(Mesh dp × pp; each stage's gradients all-reduced over dp as soon as they are final, see pipeline_trainer.py).
"""
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters

import torch
import torch.distributed as dist

from common import checkpoint, comm
from common.cli import OUTPUT_FILE, POSITIVE_INT, base_parser, check_common, pipeline_microbatches
from common.data import TextData, shard_rows
from common.distributed import env_world_size, init_distributed, shutdown
from common.errors import require, run_main
from common.mesh import Mesh
from common.metrics import RunLog, format_bytes
from common.model import PRESETS, build_model, count_parameters, loss_sum
from common.optim import build_adamw, lr_at
from common.timeline import Timeline, write_chrome_trace
from common.training import (StepTimer, consolidate_on_rank0, global_sum, load_optim_state_by_name,
                             resume_state, run_identity, should_save, stop_if_not_finite)

pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")   # who runs what, when
pipeline_stages = import_module("03_pipeline_parallel.pipeline_stages")         # the model cut into stages
pipeline_executor = import_module("03_pipeline_parallel.pipeline_executor")     # runs a schedule
pipeline_trainer = import_module("03_pipeline_parallel.pipeline_trainer")       # the loop's verbs
torch_pipelining = import_module("03_pipeline_parallel.torch_pipelining")       # --impl torch


def parse_args(argv=None, schedule=None):
    p = base_parser(__doc__.splitlines()[0], pipeline=True)
    p.add_argument("--pp", type=POSITIVE_INT, default=None,
                   help="pipeline stages (ranks) (default: the world size; 4 with --print-schedule)")
    if schedule is None:
        p.add_argument("--schedule", default="1f1b", choices=pipeline_schedules.SCHEDULES,
                       help="gpipe: all forwards, then all backwards; 1f1b: one forward, one backward; interleaved: "
                            "1f1b over --virtual-stages chunks per rank; zb-h1: backward split into B and W")
    else:            # train_gpipe.py / train_1f1b.py: the schedule is the script's name
        p.add_argument("--schedule", default=schedule, choices=[schedule],
                       help=f"fixed to {schedule} by this script; train_pp.py --schedule runs the others")
    p.add_argument("--virtual-stages", type=POSITIVE_INT, default=1, help="model chunks per rank (interleaved only)")
    p.add_argument("--impl", default="ours", choices=["ours", "torch"],
                   help="ours: pipeline_executor.py; torch: torch.distributed.pipelining, same stages")
    p.add_argument("--timeline", type=OUTPUT_FILE, default=None,
                   help="write every rank's events as a Chrome trace JSON here (default: none)")
    p.add_argument("--print-schedule", action="store_true", help="draw the per-rank schedule as text and exit")
    args = p.parse_args(argv)
    world = env_world_size()
    if args.pp is None:
        args.pp = world if not args.print_schedule else 4
    require(args.print_schedule or world % args.pp == 0,
            f"--pp {args.pp} does not divide the world size {world}; use a divisor of {world} "
            f"or launch with --nproc_per_node={args.pp}")
    dp = 1 if args.print_schedule else world // args.pp
    args.microbatches = pipeline_microbatches(args, dp, args.pp)
    check_common(args, dp=dp)
    if args.impl == "torch":
        require(args.microbatches >= args.pp * args.virtual_stages or args.schedule == "gpipe",
                f"torch.distributed.pipelining's {args.schedule} needs --microbatches ≥ the number of stages "
                f"({args.pp * args.virtual_stages}); use --microbatches {args.pp * args.virtual_stages}")
    return args


def main(argv=None, schedule=None) -> list[dict]:
    args = parse_args(argv, schedule)
    cfg = PRESETS[args.model]
    # Pure functions of the flags, identical on every rank, before any communication: bad layouts fail here.
    plan = pipeline_schedules.build_schedule(args.schedule, args.pp, args.microbatches, args.virtual_stages)
    specs = pipeline_stages.stage_specs(cfg, args.pp, args.virtual_stages, args.seq_len)   # all p·v stages
    if args.print_schedule:
        print(f"{args.schedule}: p={args.pp} m={args.microbatches} v={args.virtual_stages}; "
              f"theory bubble {pipeline_schedules.theory_bubble(args.schedule, args.pp, args.microbatches, args.virtual_stages):.3f}")
        print(pipeline_schedules.format_schedule(plan, len(specs)))
        return []
    rt = init_distributed(args.device, args.timeout)
    mesh = Mesh(rt.rank, rt.world_size, dp=rt.world_size // args.pp, pp=args.pp)
    dp_rank, dp = mesh.coord("dp"), mesh.size("dp")
    pp_group, pp_rank, pp = mesh.group("pp"), mesh.coord("pp"), mesh.size("pp")
    data = TextData(args.data, args.seq_len, args.seed)
    resume = resume_state(args)
    m, v = args.microbatches, args.virtual_stages

    # --- the stage model: the full model built from the seed, pruned to this rank's layers ---------
    my_specs = pipeline_stages.rank_stages(specs, pp, pp_rank)
    model = pipeline_stages.prune_to_stages(build_model(cfg, args.seed, rt.device), my_specs)
    named = list(model.named_parameters())
    optimizer = build_adamw(named, args.lr, args.weight_decay)
    start = 0
    if resume:              # the checkpoint holds the whole model: take this stage's names from it
        own = model.state_dict()
        model.load_state_dict({k: resume["model"][k] for k in own if k in resume["model"]}, strict=True)
        load_optim_state_by_name(optimizer, named, resume["optim"])
        start = resume["step"]

    tokens_per_step = args.global_batch * args.seq_len
    mb_rows = args.global_batch // dp // m
    timeline = Timeline(rt.rank)
    trainer = build_trainer(args, model, optimizer, specs, my_specs, plan, mesh, (mb_rows, args.seq_len, cfg.dim),
                            rt.device, timeline)

    log = RunLog(rt.rank, args.steps, args.metrics, args.quiet)
    log.track_mfu(cfg, args.seq_len, args.dtype, rt)          # `mfu` in every row (common/mfu.py)
    log.config_table(f"pipeline parallel — {args.schedule} ({args.impl})", {
        "world size": f"{rt.world_size} = dp {dp} × pp {pp}", "device / backend": f"{rt.device} / {rt.backend}",
        "data": data.describe(),
        "model": f"{args.model}: {count_parameters(cfg):,} parameters, {cfg.n_layers} layers",
        "micro-batches": f"m = {m} of {mb_rows} seq × {args.seq_len} tokens (per data-parallel rank)",
        "virtual stages": v,
        "theory bubble": f"{pipeline_schedules.theory_bubble(args.schedule, pp, m, v):.3f}",
        "resumed from step": start or "-"})
    if rt.is_main and not args.quiet:
        from rich.table import Table
        table = Table(title="stages (balanced by forward FLOPs/token)", title_justify="left")
        for col in ("stage", "rank", "holds", "params", "cost"):
            table.add_column(col)
        for row in pipeline_stages.partition_table(cfg, specs, pp, args.seq_len):
            table.add_row(str(row["stage"]), str(row["rank"]), row["holds"], f"{row['params']:,}", f"{row['cost']:.1%}")
        log.print(table)
    if rt.world_size == 1:
        log.print("world size 1: a one-stage pipeline (the reference). More stages: "
                  "torchrun --nproc_per_node=4 03_pipeline_parallel/train_1f1b.py")

    dist.barrier()                                   # every rank starts the first step together
    log.start(start + 1)
    for step in range(start + 1, args.steps + 1):
        comm.COUNTER.reset()
        lr = lr_at(step, args.lr, args.warmup, args.steps)
        trainer.set_lr(lr)
        timeline.begin_step(step)
        with StepTimer(rt.device) as timer:
            x, y = data.global_batch(step, args.global_batch)                 # (global_batch, S)
            x, y = shard_rows(x, dp_rank, dp).to(rt.device), shard_rows(y, dp_rank, dp).to(rt.device)
            # the whole schedule in one call: m micro-batches of (mb, S), every F and B, the sends and
            # receives; each stage's DP all-reduce starts as soon as its last backward is done
            local_loss = trainer.forward_backward(x, y)
            trainer.sync_gradients()                                           # DP: wait for those sums
            grad_norm = trainer.clip_grad_norm(args.clip)                      # squared norms summed over pp
            trainer.step()
            trainer.zero_grad()
        memory = trainer.memory()
        loss_value = global_sum(local_loss, dist.group.WORLD)   # only last-stage ranks hold a loss
        stop_if_not_finite(step, loss_value, grad_norm, args)
        stats = pipeline_trainer.step_stats(timeline, memory["peak_activation_bytes"], pp_group, pp, rt.device)
        log.log_step(step, loss_value, lr, tokens_per_step, timer.seconds, grad_norm=grad_norm,
                     comm_bytes=comm.COUNTER.total(), comm_bytes_pp=comm.COUNTER.total("pp"), **stats)
        if should_save(args, step):
            # every stage's names, one copy (data-parallel replica 0), merged on rank 0
            full_model, full_optim = consolidate_on_rank0(model, optimizer, named, dp_rank == 0)
            if rt.is_main:
                log.note(f"checkpoint saved: {checkpoint.save(args.checkpoint_dir, step, full_model, full_optim, run_identity(args))}")
    if args.timeline:
        events = timeline.gather()
        if rt.is_main:
            write_chrome_trace(args.timeline, events, {
                "schedule": args.schedule, "impl": args.impl, "pp": pp, "dp": dp, "microbatches": m,
                "virtual_stages": v, "theory_bubble": pipeline_schedules.theory_bubble(args.schedule, pp, m, v),
                **timeline.clock_metadata()})
            log.note(f"timeline written: {args.timeline} (open in ui.perfetto.dev or plot_timeline.py)")
    last = log.history[-1] if log.history else {}
    log.finish({"bubble fraction (last step)": f"{last.get('bubble_fraction', 0):.3f}",
                "peak activations per stage": ", ".join(format_bytes(b) for b in last.get("peak_activation_bytes", []))})
    shutdown(rt)
    return log.history


def build_trainer(args, model, optimizer, specs, my_specs, plan, mesh, act_shape, device, timeline):
    """Our executor or PyTorch's pipeline runtime, chosen once: the loop drives either through the same
    verbs. The loss: summed cross-entropy over the global token count (common/model.loss_sum)."""
    pp_group, dp_group, m = mesh.group("pp"), mesh.group("dp"), args.microbatches
    tokens_per_step = args.global_batch * args.seq_len
    if args.impl == "torch":
        runtime = torch_pipelining.TorchPipeline(args.schedule, model, my_specs, len(specs), m, pp_group, device,
                                                 lambda logits, y: loss_sum(logits, y) / tokens_per_step)
        return torch_pipelining.TorchPipelineTrainer(runtime, optimizer, m, dp_group, pp_group)
    executor = pipeline_executor.PipelineExecutor(
        model, specs, mesh.coord("pp"), mesh.group_ranks["pp"], pp_group, act_shape=act_shape,   # (mb, S, D)
        loss_fn=loss_sum, loss_scale=tokens_per_step, device=device,
        autocast_dtype=torch.bfloat16 if args.dtype == "bf16" else None, timeline=timeline)
    return pipeline_trainer.PipelineTrainer(executor, plan, optimizer, m, dp_group, pp_group)


if __name__ == "__main__":
    run_main(main)
