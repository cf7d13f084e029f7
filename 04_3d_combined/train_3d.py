"""Chapter 04 — DP × TP × PP on one mesh: the full pretraining run, built from chapters 01-03.

    torchrun --nproc_per_node=8 04_3d_combined/train_3d.py                 # dp 2 × tp 2 × pp 2 (default)
    torchrun --nproc_per_node=8 04_3d_combined/train_3d.py --dp 1 --tp 2 --pp 4 --schedule interleaved
    torchrun --nproc_per_node=8 04_3d_combined/train_3d.py --dp 4 --tp 2 --pp 1 --zero-stage 1
    python 04_3d_combined/train_3d.py                                      # world size 1: the reference
    python 04_3d_combined/plot_loss.py runs/3d/metrics.jsonl               # the loss curve

The degrees must multiply to the world size; those not given are chosen from it (TP 2, PP 2, DP the rest).
Chapter 05 adds a fourth dimension to this run: 05_moe_expert_parallel/train_4d.py.
"""
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters

import torch.distributed as dist

from common import comm
from common.cli import base_parser
from common.data import TextData, shard_rows
from common.distributed import env_world_size, init_distributed
from common.errors import run_main
from common.live_memory import LivePeak
from common.mesh import Mesh
from common.metrics import RunLog
from common.model import dense_preset
from common.optim import lr_at
from common.timeline import Timeline
from common.training import StepTimer, resume_state, start_rng

tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")          # chapter 02: the TP loss
parallel_3d = import_module("04_3d_combined.parallel_3d")                      # this chapter: each rank's piece
trainer_3d = import_module("04_3d_combined.trainer_3d")                        # this chapter: the loop's verbs
run_tail = import_module("04_3d_combined.run_tail")                            # this chapter: all but the step


def parser():
    p = base_parser(__doc__.splitlines()[0], pipeline=True)
    parallel_3d.add_layout_args(p)
    p.add_argument("--measure-memory", action="store_true",
                   help="live_peak_bytes in each row: every byte rank 0's tensors hold at once in a step "
                        "(common/live_memory.py; slower: every operation is counted)")
    return p


def parse_args(argv=None):
    return parser().parse_args(argv)


def checked_layout(args, world: int, cfg=None, build: bool = True):
    """Every check this run makes before any communication, on every rank: (layout, cfg, specs, plan).
    Chapter 07's planner asks the same function whether a layout runs (`cfg`: a published shape; `build`
    False: the checks without building every rank's actions, plan None)."""
    cfg = cfg or dense_preset(args.model, "05_moe_expert_parallel/train_4d.py")   # the preset's configuration
    layout = parallel_3d.decide_layout(args, cfg, world)                 # bad layouts fail here, on every rank
    specs, plan = parallel_3d.plan_pipeline(args, cfg, layout, build)    # chapter 03: stages and actions
    return layout, cfg, specs, plan


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    layout, cfg, specs, plan = checked_layout(args, env_world_size())   # bad layouts fail here, on every rank
    rt = init_distributed(args.device, args.timeout)
    mesh = Mesh(rt.rank, rt.world_size, **layout.grid())                 # arange(world).view(dp, pp, tp)
    dp_rank, tp_group = mesh.coord("dp"), mesh.group("tp")
    data = TextData(args.data, args.seq_len, args.seed)
    resume = resume_state(args)

    # --- this rank's piece: the reference model → its pipeline stage(s) → its TP shard ---------------
    model, my_specs = parallel_3d.build_local_model(cfg, args, layout, specs, mesh, rt.device, resume and resume["model"])
    # The loss on the last stage: vocab-parallel cross-entropy when the logits are split over TP.
    loss_fn = lambda logits, y: tensor_parallel.tp_loss_sum(logits, y, tp_group)    # noqa: E731 (tp 1: the plain loss)
    shape = parallel_3d.act_shape(args, cfg, layout)                           # (mb, S or S/tp, D)
    timeline = Timeline(rt.rank)
    # AdamW, or ZeRO-1 with --zero-stage 1: chosen here, once; the loop drives either through the same verbs
    trainer = trainer_3d.build_trainer(model, specs, plan, mesh, layout, args, cfg, loss_fn, shape, rt.device,
                                       timeline, resume and resume["optim"])
    if args.measure_memory:                               # every tensor counted: the peak a GPU's allocator sees
        trainer = LivePeak(trainer)
    start, tokens_per_step = (resume["step"] if resume else 0), args.global_batch * args.seq_len
    log = RunLog(rt.rank, args.steps, args.metrics, args.quiet, append=args.resume)
    log.track_mfu(cfg, args.seq_len, args.dtype, rt)          # `mfu` in every row (common/mfu.py)
    # what comes before and after each step (the tables, the metrics row, validation, checkpoints, the sample)
    tail = run_tail.RunTail(log, rt, args, cfg, layout, mesh, data, trainer, timeline, my_specs, loss_fn, shape)
    tail.print_start("3D parallel pretraining", "torchrun --nproc_per_node=8 04_3d_combined/train_3d.py", start)

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
            # 1. the pipeline schedule runs forward and backward of every micro-batch (TP inside each
            #    layer); as soon as one of my stages has its last gradient, its DP all-reduce starts in
            #    the background, overlapping the rest of the schedule (the pipeline's cool-down)
            local_loss = trainer.forward_backward(x, y)
            # 2. DP: wait for those all-reduces; 3. TP: sum the partial gradients of replicated tensors
            trainer.sync_gradients()
            # 4. clip by the norm of the whole model's gradient: TP shards and stages hold different parts
            grad_norm = trainer.clip_grad_norm(args.clip)
            trainer.step()                                # 5. AdamW on my piece (ZeRO-1: my shard)
            trainer.zero_grad()
        # the loss summed over the ranks (the last stage's, tp index 0), checked finite; the metrics row (bytes
        # by dp, tp, pp); validation; the checkpoint, written by one replica of each stage
        tail.after_step(step, local_loss, lr, tokens_per_step, timer.seconds, grad_norm)
    return tail.finish()                       # the timeline, the summary, a text sample


if __name__ == "__main__":
    run_main(main)
