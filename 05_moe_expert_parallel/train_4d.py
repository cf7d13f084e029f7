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

import torch
import torch.distributed as dist

from common import comm
from common.cli import base_parser
from common.data import TextData, shard_rows
from common.distributed import env_world_size, init_distributed
from common.errors import require, run_main
from common.mesh import Mesh
from common.metrics import RunLog
from common.model import loss_sum
from common.optim import lr_at
from common.timeline import Timeline
from common.training import StepTimer, resume_state, start_rng

tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")          # chapter 02: the TP loss
parallel_3d = import_module("04_3d_combined.parallel_3d")                      # chapter 04: each rank's piece
run_tail = import_module("04_3d_combined.run_tail")                            # chapter 04: all but the step
parallel_4d = import_module("05_moe_expert_parallel.parallel_4d")              # this chapter: + EP
trainer_4d = import_module("05_moe_expert_parallel.trainer_4d")                # this chapter: the 4D verbs
paired_executor = import_module("05_moe_expert_parallel.paired_executor")      # this chapter: DualPipeV's pairs


def parser():
    p = base_parser(__doc__.splitlines()[0], pipeline=True)
    p.set_defaults(model="tiny-moe")
    parallel_4d.add_4d_args(p)
    p.add_argument("--pair-overlap", action="store_true",
                   help="DualPipeV: run each of its pairs (one micro-batch's forward, another's backward) on two "
                        "threads, so that one's all-to-all waits under the other's compute (paired_executor.py); "
                        "needs --schedule dualpipev, on CPU")
    return p


def parse_args(argv=None):
    return parser().parse_args(argv)


def checked_layout(args, world: int, cfg=None, build: bool = True):
    """Every check this run makes before any communication, on every rank: (layout, cfg, specs, plan).
    Chapter 07's planner asks the same function whether a layout runs (`cfg`: a published shape; `build`
    False: the checks without building every rank's actions, plan None)."""
    layout, cfg = parallel_4d.decide_layout(args, world, cfg)            # bad layouts fail here, on every rank
    if args.pair_overlap:
        require(args.schedule == "dualpipev", f"--pair-overlap runs DualPipeV's pairs, but --schedule {args.schedule} "
                                              f"has none; add --schedule dualpipev")
        require((args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu", "--pair-overlap runs a pair on two CPU threads (on a GPU it "
                                                      "would need a second CUDA stream); add --device cpu")
    specs, plan = parallel_3d.plan_pipeline(args, cfg, layout, build)    # chapter 03: stages and actions
    return layout, cfg, specs, plan


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    layout, cfg, specs, plan = checked_layout(args, env_world_size())   # bad layouts fail here, on every rank
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
    paired_executor.time_all_to_alls(timeline)                                 # the all-to-alls' waits, per step
    # --pair-overlap: a pair's backward talks on twins of the groups a stage's compute uses (a collective)
    twins = paired_executor.twin_groups(mesh, ("ep", "tp")) if args.pair_overlap else None
    # AdamW on my piece; gradients summed as Layout4D.gradient_groups() says: dense over dp, experts over edp
    trainer = trainer_4d.build_trainer(model, specs, plan, mesh, layout, args, cfg, loss_fn, shape, rt.device,
                                       timeline, resume and resume["optim"], twins)
    start, tokens_per_step = (resume["step"] if resume else 0), args.global_batch * args.seq_len
    log = RunLog(rt.rank, args.steps, args.metrics, args.quiet, append=args.resume)
    log.track_mfu(cfg, args.seq_len, args.dtype, rt)          # `mfu` in every row (common/mfu.py: active experts)
    # chapter 04's bookkeeping before and after each step, with this chapter's bytes, numbers and replicas:
    # the ep ranks of replica edp = 0 hold every expert once between them, and write the checkpoint
    tail = run_tail.RunTail(log, rt, args, cfg, layout, mesh, data, trainer, timeline, my_specs, loss_fn, shape,
                            groups=("dp", "tp", "pp", "ep"),
                            chapter_metrics=(trainer.router_metrics,
                                             lambda: paired_executor.step_metrics(timeline, trainer.executor)),
                            replica_dims=("edp",))
    tail.print_start("4D parallel pretraining", "torchrun --nproc_per_node=8 05_moe_expert_parallel/train_4d.py", start,
                     *parallel_4d.console_rows(cfg, args, layout))

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
        # the loss summed over the ranks, checked finite; the metrics row (bytes by dp, tp, pp, ep; the router's
        # loads, aux and z terms); validation; the checkpoint
        tail.after_step(step, local_loss, lr, tokens_per_step, timer.seconds, grad_norm)
    return tail.finish()                       # the timeline, the summary, a text sample


if __name__ == "__main__":
    run_main(main)
