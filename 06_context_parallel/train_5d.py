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

from common import comm
from common.cli import base_parser
from common.data import TextData, shard_rows
from common.distributed import env_world_size, init_distributed
from common.errors import run_main
from common.mesh import Mesh
from common.metrics import RunLog
from common.model import loss_sum
from common.optim import lr_at
from common.timeline import Timeline
from common.training import StepTimer, resume_state, start_rng

tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")          # chapter 02: the TP loss
parallel_3d = import_module("04_3d_combined.parallel_3d")                      # chapter 04: each rank's piece
run_tail = import_module("04_3d_combined.run_tail")                            # chapter 04: all but the step
trainer_4d = import_module("05_moe_expert_parallel.trainer_4d")                # chapter 05: the 4D verbs
parallel_5d = import_module("06_context_parallel.parallel_5d")                 # this chapter: + CP
context_parallel = import_module("06_context_parallel.context_parallel")       # this chapter: the work balance
attention_bookkeeping = import_module("06_context_parallel.attention_bookkeeping")  # this chapter: the work tally


def parser():
    p = base_parser(__doc__.splitlines()[0], pipeline=True)
    p.set_defaults(model="tiny-moe")
    parallel_5d.add_5d_args(p)
    return p


def parse_args(argv=None):
    return parser().parse_args(argv)


def checked_layout(args, world: int, cfg=None, build: bool = True):
    """Every check this run makes before any communication, on every rank: (layout, cfg, specs, plan).
    Chapter 07's planner asks the same function whether a layout runs (`cfg`: a published shape; `build`
    False: the checks without building every rank's actions, plan None)."""
    layout, cfg = parallel_5d.decide_layout(args, world, cfg)            # bad layouts fail here, on every rank
    specs, plan = parallel_3d.plan_pipeline(args, cfg, layout, build)    # chapter 03: stages and actions
    return layout, cfg, specs, plan


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    layout, cfg, specs, plan = checked_layout(args, env_world_size())   # bad layouts fail here, on every rank
    rt = init_distributed(args.device, args.timeout)
    mesh = Mesh(rt.rank, rt.world_size, joined=layout.joined, **layout.grid())   # (edp, ep, pp, cp, tp)
    dp_rank, cp_rank, cp_group, tp_group = mesh.coord("dp"), mesh.coord("cp"), mesh.group("cp"), mesh.group("tp")
    split = parallel_5d.sequence_split(args, layout)                     # who holds which positions
    data = TextData(args.data, args.seq_len, args.seed)
    resume = resume_state(args)

    # --- this rank's piece: chapter 04's (stage(s), TP shard), then chapter 05's experts, then CP: attention
    #     over cp, and the routers told that the rest of each sequence is on the cp group ----------------------
    model, my_specs = parallel_3d.build_local_model(cfg, args, layout, specs, mesh, rt.device, resume and resume["model"],
                                                    then=parallel_5d.then_experts_and_cp(args, layout))
    loss_fn = (lambda logits, y: tensor_parallel.tp_loss_sum(logits, y, tp_group)) if layout.tp > 1 else loss_sum
    shape = parallel_3d.act_shape(args, cfg, layout)                           # (mb, S/cp, D); S/cp/tp under SP
    timeline = Timeline(rt.rank)
    # chapter 05's verbs as they are; the gradients are summed over the groups Layout5D.gradient_groups() names:
    # dense over dp × cp (the mesh's "dp_cp"), experts over edp × cp ("edp_cp")
    trainer = trainer_4d.build_trainer(model, specs, plan, mesh, layout, args, cfg, loss_fn, shape, rt.device,
                                       timeline, resume and resume["optim"])
    # tokens_per_step counts each token once: the CP ranks of a row hold different positions of it
    start, tokens_per_step = (resume["step"] if resume else 0), args.global_batch * args.seq_len
    log = RunLog(rt.rank, args.steps, args.metrics, args.quiet, append=args.resume)
    log.track_mfu(cfg, args.seq_len, args.dtype, rt)          # `mfu` in every row (common/mfu.py: active experts)
    # chapter 04's bookkeeping before and after each step, with chapter 05's and this chapter's additions: the
    # gradient all-reduces' bytes named for their group (counted as "dp", they run over dp × cp); the router's
    # numbers and the attention work; validation on my positions; edp = 0, cp = 0 write the checkpoint
    tail = run_tail.RunTail(log, rt, args, cfg, layout, mesh, data, trainer, timeline, my_specs, loss_fn, shape,
                            groups=("dp_cp", "tp", "pp", "ep", "cp"), counted_as={"dp_cp": "dp"},
                            chapter_metrics=(trainer.router_metrics,
                                             lambda: context_parallel.cp_step_metrics(cp_group, layout.cp, rt.device)),
                            take=lambda t: split.take(t, cp_rank), replica_dims=("edp", "cp"))
    tail.print_start("5D parallel pretraining", "torchrun --nproc_per_node=8 06_context_parallel/train_5d.py", start,
                     *parallel_5d.console_rows(cfg, args, layout))

    dist.barrier()
    start_rng(args, resume)                   # torch's generator: seeded, or as the checkpoint left it
    log.start(start + 1)
    for step in range(start + 1, args.steps + 1):
        comm.COUNTER.reset()
        attention_bookkeeping.WORK.reset()
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
            trainer.step()                    # 5. chapter 05's: router statistics and biases; AdamW on my piece
            trainer.zero_grad()
        # the loss summed over the ranks, checked finite; the metrics row (bytes by dp × cp, tp, pp, ep, cp; the
        # router's numbers; attn_work_imbalance); validation on my positions; the checkpoint
        tail.after_step(step, local_loss, lr, tokens_per_step, timer.seconds, grad_norm)
    return tail.finish()                       # the timeline, the summary, a text sample


if __name__ == "__main__":
    run_main(main)
