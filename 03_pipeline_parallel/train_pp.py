"""Chapter 03 — pipeline parallelism. The model is cut into stages, micro-batches flow through them.

    python 03_pipeline_parallel/train_pp.py                                   # world size 1: one stage
    torchrun --nproc_per_node=4 03_pipeline_parallel/train_pp.py --schedule 1f1b --microbatches 8
    torchrun --nproc_per_node=4 03_pipeline_parallel/train_pp.py --schedule interleaved --virtual-stages 2
    torchrun --nproc_per_node=4 03_pipeline_parallel/train_pp.py --schedule zb-h1 --timeline runs/zb.json
    torchrun --nproc_per_node=4 03_pipeline_parallel/train_pp.py --schedule zb-v --microbatches 8
    python 03_pipeline_parallel/train_pp.py --pp 4 --microbatches 8 --schedule 1f1b --print-schedule

--pp defaults to the world size; with fewer, the remaining factor is data parallelism
(Mesh dp × pp; each stage's gradients all-reduced over dp as soon as they are final, see pipeline_trainer.py).
"""
import argparse
import sys
from importlib import import_module
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters

import torch
import torch.distributed as dist
from rich.table import Table

from common import checkpoint, comm
from common.cli import base_parser, check_common, pipeline_microbatches
from common.domains import OUTPUT_FILE, POSITIVE_INT
from common.data import TextData, shard_rows
from common.distributed import env_world_size, init_distributed, shutdown
from common.errors import require, run_main
from common.mesh import Mesh
from common.metrics import RunLog, format_bytes
from common.model import PRESETS, build_model, count_parameters, dense_preset, loss_sum
from common.optim import build_adamw, lr_at
from common.timeline import Timeline, write_chrome_trace
from common.training import (StepTimer, consolidate_on_rank0, global_sum, load_optim_state_by_name,
                             resume_state, run_identity, should_save, start_rng,
                             stop_if_not_finite)

pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")   # who runs what, when
schedule_simulator = import_module("03_pipeline_parallel.schedule_simulator")   # a schedule on paper
pipeline_stages = import_module("03_pipeline_parallel.pipeline_stages")         # the model cut into stages
measured_executor = import_module("03_pipeline_parallel.measured_executor")     # runs a schedule, measured
pipeline_trainer = import_module("03_pipeline_parallel.pipeline_trainer")       # the loop's verbs
replicated_adamw = import_module("01_data_parallel.replicated_adamw")           # chapter 01: the optimizer


def torch_pipelining():
    """PyTorch's runtime (--impl torch), imported only when asked for: torch.distributed.pipelining costs every
    rank ~1 s of CPU."""
    return import_module("03_pipeline_parallel.torch_pipelining")


class Layout(NamedTuple):
    """The run's shape, computed from the flags and the world size."""
    dp: int            # data-parallel replicas of the pipeline
    pp: int            # pipeline ranks
    m: int             # micro-batches per step
    v: int             # virtual stages (model chunks) per rank


def parse_args(argv=None, schedule=None):
    p = base_parser(__doc__.splitlines()[0], pipeline=True)
    p.add_argument("--pp", type=POSITIVE_INT, default=None,
                   help="pipeline stages (ranks) (default: the world size; 4 with --print-schedule)")
    if schedule is None:
        p.add_argument("--schedule", default="1f1b", choices=list(pipeline_schedules.SCHEDULES),
                       help="gpipe: all forwards, then all backwards; 1f1b: one forward, one backward; interleaved: "
                            "1f1b over --virtual-stages chunks per rank; zb-h1: backward split into B and W; "
                            "zb-v, dualpipev: two stages per rank placed in a V (rank r: stages r and 2p-1-r)")
    else:            # train_gpipe.py / train_1f1b.py: the schedule is the script's name
        p.add_argument("--schedule", default=schedule, choices=[schedule],
                       help=f"fixed to {schedule} by this script; train_pp.py --schedule runs the others")
    p.add_argument("--virtual-stages", type=POSITIVE_INT, default=1,
                   help="model chunks per rank (interleaved only; zb-v and dualpipev always hold 2)")
    p.add_argument("--impl", default="ours", choices=["ours", "torch"],
                   help="ours: pipeline_executor.py; torch: torch.distributed.pipelining, same stages")
    p.add_argument("--timeline", type=OUTPUT_FILE, default=None,
                   help="write every rank's events as a Chrome trace JSON here (default: none)")
    p.add_argument("--print-schedule", action="store_true", help="draw the per-rank schedule as text and exit")
    p.add_argument("--irecv-one-ahead", action="store_true", help=argparse.SUPPRESS)   # breakdown_pp.py's NCCL rule
    return p.parse_args(argv)


def pipeline_layout(args, world: int) -> Layout:
    """dp × pp and the micro-batch count, from the flags and the world size; a layout that cannot run
    is refused here, on every rank alike, before any communication."""
    pp = args.pp or (4 if args.print_schedule else world)
    require(args.print_schedule or world % pp == 0,
            f"--pp {pp} does not divide the world size {world}; use a divisor of {world} "
            f"or launch with --nproc_per_node={pp}")
    dp = 1 if args.print_schedule else world // pp
    m = pipeline_microbatches(args, dp, pp)
    schedule = pipeline_schedules.SCHEDULES[args.schedule]
    v = pipeline_schedules.stages_from_flag(args.schedule, args.virtual_stages)     # the V: always 2
    check_common(args, dp=dp, microbatches=m, split_w=schedule.split_w)
    if args.impl == "torch":
        known = torch_pipelining().TORCH_SCHEDULES
        torch_class = known.get(args.schedule)
        require(torch_class is not None, f"--impl torch: torch.distributed.pipelining has no {args.schedule} "
                                         f"schedule; use one of {', '.join(known)}")
        require(m >= pp * v or torch_class == "ScheduleGPipe",
                f"torch.distributed.pipelining's {args.schedule} needs --microbatches ≥ the number of stages "
                f"({pp * v}); use --microbatches {pp * v}")
    return Layout(dp, pp, m, v)


def main(argv=None, schedule=None) -> list[dict]:
    args = parse_args(argv, schedule)
    cfg = dense_preset(args.model, "05_moe_expert_parallel/train_4d.py")   # a mixture of experts is chapter 05's
    # Pure functions of the flags, identical on every rank, before any communication: bad layouts fail here.
    layout = pipeline_layout(args, env_world_size())
    plan = pipeline_schedules.build_schedule(args.schedule, layout.pp, layout.m, layout.v)   # every rank's actions
    rank_of = pipeline_schedules.stage_ranks(args.schedule, layout.pp, layout.v)             # a loop, or a V
    specs = pipeline_stages.stage_specs(cfg, layout.pp, layout.v, args.seq_len, rank_of)     # all p·v stages
    if args.print_schedule:
        return print_schedule(args.schedule, layout, plan, specs)
    rt = init_distributed(args.device, args.timeout)
    mesh = Mesh(rt.rank, rt.world_size, dp=layout.dp, pp=layout.pp)
    dp_rank, pp_group = mesh.coord("dp"), mesh.group("pp")
    data = TextData(args.data, args.seq_len, args.seed)
    resume = resume_state(args)
    # --- the stage model: the full model built from the seed, pruned to this rank's layers ---------
    my_specs = pipeline_stages.rank_stages(specs, layout.pp, mesh.coord("pp"))
    model = build_model(cfg, args.seed, rt.device, args.recompute, args.compile, args.recompute_layers,
                        [s.layers for s in specs])          # --recompute-layers counts within each stage
    model = pipeline_stages.prune_to_stages(model, my_specs)
    named = list(model.named_parameters())
    optimizer = build_adamw(named, args.lr, args.weight_decay)
    start = load_stage_state(model, optimizer, named, resume)
    timeline = Timeline(rt.rank)                     # every rank's spans on one clock: the measured bubble
    act_shape = (args.global_batch // layout.dp // layout.m, args.seq_len, cfg.dim)   # one message: (mb, S, D)
    trainer = build_trainer(args, layout, model, optimizer, specs, my_specs, plan, mesh, act_shape, rt.device, timeline)
    log = RunLog(rt.rank, args.steps, args.metrics, args.quiet, append=args.resume)
    log.track_mfu(cfg, args.seq_len, args.dtype, rt)          # `mfu` in every row (common/mfu.py)
    print_layout(log, args, cfg, layout, specs, data, rt, start)

    tokens_per_step = args.global_batch * args.seq_len
    dist.barrier()                                   # every rank starts the first step together
    start_rng(args, resume)                   # torch's generator: seeded, or as the checkpoint left it
    log.start(start + 1)
    for step in range(start + 1, args.steps + 1):
        comm.COUNTER.reset()
        lr = lr_at(step, args.lr, args.warmup, args.steps)
        trainer.set_lr(lr)
        timeline.begin_step(step)
        with StepTimer(rt.device) as timer:
            x, y = data.global_batch(step, args.global_batch)                 # (global_batch, S)
            x, y = shard_rows(x, dp_rank, layout.dp).to(rt.device), shard_rows(y, dp_rank, layout.dp).to(rt.device)
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
        stats = pipeline_trainer.step_stats(timeline, memory["peak_activation_bytes"], pp_group, layout.pp, rt.device)
        log.log_step(step, loss_value, lr, tokens_per_step, timer.seconds, grad_norm=grad_norm,
                     comm_bytes=comm.COUNTER.total(), comm_bytes_pp=comm.COUNTER.total("pp"), **stats,
                     **{k: memory[k] for k in ("param_bytes", "grad_bytes", "optim_bytes",
                                               "activation_bytes_predicted")})
        if should_save(args, step):
            # every stage's names, one copy (data-parallel replica 0), merged on rank 0
            full_model, full_optim = consolidate_on_rank0(model, optimizer, named, dp_rank == 0)
            if rt.is_main:
                log.note(f"checkpoint saved: {checkpoint.save(args.checkpoint_dir, step, full_model, full_optim, run_identity(args))}")
    if args.timeline:
        write_timeline(args, layout, timeline, log, rt.is_main)
    log.finish(summary_rows(log.history[-1], args.schedule, layout) if log.history else None)
    shutdown(rt)
    return log.history


def load_stage_state(model, optimizer, named, resume) -> int:
    """The checkpoint holds the whole model: take this rank's names from it. Returns the step to
    continue from (0: a fresh run)."""
    if not resume:
        return 0
    own = model.state_dict()
    model.load_state_dict({k: resume["model"][k] for k in own if k in resume["model"]}, strict=True)
    load_optim_state_by_name(optimizer, named, resume["optim"])
    return resume["step"]


def build_trainer(args, layout, model, optimizer, specs, my_specs, plan, mesh, act_shape, device, timeline):
    """Our executor or PyTorch's pipeline runtime, chosen once: the loop drives either through the same
    verbs, with the same optimizer object: `optimizer` (AdamW on this rank's stages) replicated over dp,
    each stage's gradients summed there as soon as they are final (chapter 01's ReplicatedAdamW). The
    loss: summed cross-entropy over the global token count (common/model.loss_sum)."""
    pp_group = mesh.group("pp")
    optimizer = replicated_adamw.ReplicatedAdamW(model.named_parameters(), optimizer=optimizer, group=mesh.group("dp"))
    tokens_per_step = args.global_batch * args.seq_len
    if args.impl == "torch":
        scaled_loss = lambda logits, y: loss_sum(logits, y) / tokens_per_step     # noqa: E731
        return torch_pipelining().TorchPipelineTrainer(args.schedule, model, my_specs, len(specs), layout.m,
                                                       scaled_loss, optimizer, pp_group, device)
    executor = measured_executor.MeasuredExecutor(
        model, specs, mesh.coord("pp"), mesh.group_ranks["pp"], pp_group, act_shape=act_shape,   # (mb, S, D)
        loss_fn=loss_sum, loss_scale=tokens_per_step, device=device,
        autocast_dtype=torch.bfloat16 if args.dtype == "bf16" else None, timeline=timeline,
        meter_activations=not args.no_activation_meter,
        post_all_at_start=False if args.irecv_one_ahead else None)     # None: gloo's rule, all at the start
    predicted = pipeline_trainer.predicted_peaks(PRESETS[args.model], args, plan, specs, act_shape[0])
    return pipeline_trainer.PipelineTrainer(executor, plan, optimizer, layout.m, pp_group, predicted)


# --- what the run prints ---------------------------------------------------------------------------
def print_schedule(name: str, layout: Layout, plan, specs) -> list:
    """--print-schedule: the theory bubble, then the schedule drawn as text (no processes)."""
    print(f"{name}: p={layout.pp} m={layout.m} v={layout.v}; "
          f"theory bubble {pipeline_schedules.theory_bubble(name, layout.pp, layout.m, layout.v):.3f}")
    print(schedule_simulator.format_schedule(plan, len(specs)))
    return []


def print_layout(log, args, cfg, layout: Layout, specs, data, rt, start: int) -> None:
    """The configuration, and the stage table: which rank holds which layers, at what cost."""
    mb_rows = args.global_batch // layout.dp // layout.m
    log.config_table(f"pipeline parallel — {args.schedule} ({args.impl})", {
        "world size": f"{rt.world_size} = dp {layout.dp} × pp {layout.pp}",
        "device / backend": f"{rt.device} / {rt.backend}", "data": data.describe(),
        "model": f"{args.model}: {count_parameters(cfg):,} parameters, {cfg.n_layers} layers",
        "micro-batches": f"m = {layout.m} of {mb_rows} seq × {args.seq_len} tokens (per data-parallel rank)",
        "virtual stages": layout.v,
        "theory bubble": f"{theory_bubble(args.schedule, layout):.3f} (measured: in the summary at the end)",
        "resumed from step": start or "-"})
    table = Table(title="stages (balanced by forward FLOPs/token)", title_justify="left")
    for col in ("stage", "rank", "holds", "params", "cost"):
        table.add_column(col)
    for row in pipeline_stages.partition_table(cfg, specs, layout.pp, args.seq_len):
        table.add_row(str(row["stage"]), str(row["rank"]), row["holds"], f"{row['params']:,}", f"{row['cost']:.1%}")
    log.print(table)
    if rt.world_size == 1:
        log.print("world size 1: a one-stage pipeline (the reference). More stages: "
                  "torchrun --nproc_per_node=4 03_pipeline_parallel/train_1f1b.py")


def summary_rows(last: dict, schedule: str, layout: Layout) -> dict:
    """The end of the summary: the last step's bubble, measured beside the theory, and activation peaks."""
    theory, bubble = theory_bubble(schedule, layout), last.get("bubble_fraction")
    peaks = last.get("peak_activation_bytes")
    return {"bubble, last step": (f"measured {bubble:.3f}" if bubble is not None else "not measured (no timeline)")
            + f" · theory {theory:.3f}",
            "peak activations per stage": ", ".join(map(format_bytes, peaks)) if peaks else "not measured"}


def theory_bubble(schedule: str, layout: Layout) -> float:
    return pipeline_schedules.theory_bubble(schedule, layout.pp, layout.m, layout.v)


def write_timeline(args, layout: Layout, timeline, log, is_main: bool) -> None:
    """Every rank's spans, gathered on rank 0 (a collective) and written as one Chrome trace."""
    events = timeline.gather()
    if is_main:
        write_chrome_trace(args.timeline, events, {
            "schedule": args.schedule, "impl": args.impl, "pp": layout.pp, "dp": layout.dp,
            "microbatches": layout.m, "virtual_stages": layout.v, "theory_bubble": theory_bubble(args.schedule, layout),
            **timeline.clock_metadata()})
        log.note(f"timeline written: {args.timeline} (open in ui.perfetto.dev or plot_timeline.py)")


if __name__ == "__main__":
    run_main(main)
