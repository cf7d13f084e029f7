"""Composing the three chapters on one mesh: TP innermost, pipeline stages, DP outermost.

Nothing here is new machinery: the tensor-parallel layers come from chapter 02, the stages, schedules
and executor from chapter 03, the gradient all-reduce (or ZeRO-1) from chapter 01 (those last two
are driven by trainer_3d.py). This file only decides who is who on the grid and builds each piece:

    grid = arange(world).view(dp, pp, tp)        TP varies fastest: a TP group is consecutive ranks
    rank (d, p, t):  builds the full model from the seed (or the checkpoint),
                     keeps pipeline stage p's layers            (chapter 03: prune_to_stages)
                     keeps TP shard t of each of those layers   (chapter 02: parallelize_model)
                     trains on data-parallel slice d of the global batch

Why this order. TP talks in every layer (two all-reduces per block, forward and backward), on the
critical path: it needs the fastest links, so its ranks are neighbours (one node). The pipeline
sends one activation per micro-batch per stage boundary: it tolerates slower links. DP talks once
per step (the gradient all-reduce) and can overlap it: it goes across nodes.
"""
from importlib import import_module

from common.errors import require
from common.model import build_model
from common.training import consolidate_on_rank0

tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")
pipeline_stages = import_module("03_pipeline_parallel.pipeline_stages")
pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")


def default_degrees(world: int, dp=None, tp=None, pp=None) -> tuple[int, int, int]:
    """Fill in the degrees not given, in the order tp, pp, dp: TP 2 and PP 2 when the world allows,
    the last missing one takes whatever is left (8 ranks → dp 2 × tp 2 × pp 2)."""
    deg = {"tp": tp, "pp": pp, "dp": dp}
    missing = [k for k, v in deg.items() if v is None]
    for k in missing:
        known = 1
        for v in deg.values():
            known *= v or 1
        rest = world // known if world % known == 0 else 1
        deg[k] = rest if k == missing[-1] else (2 if rest % 2 == 0 else 1)
    return deg["dp"], deg["tp"], deg["pp"]


def plan_layout(args, cfg, world: int) -> tuple[list, list]:
    """Every chapter's checks for this layout, on every rank, before any communication; then the
    pipeline's plan: all p·v stages (chapter 03's stage_specs) and every rank's actions (build_schedule)."""
    require(args.dp * args.tp * args.pp == world,
            f"--dp {args.dp} × --tp {args.tp} × --pp {args.pp} = {args.dp * args.tp * args.pp} must equal the "
            f"world size {world}; change the degrees or launch with --nproc_per_node={args.dp * args.tp * args.pp}")
    tensor_parallel.check_tp_config(cfg, args.tp, args.seq_len, args.sequence_parallel)
    specs = pipeline_stages.stage_specs(cfg, args.pp, args.virtual_stages, args.seq_len)
    plan = pipeline_schedules.build_schedule(args.schedule, args.pp, args.microbatches, args.virtual_stages)
    return specs, plan


def build_local_model(cfg, args, specs, mesh, device, full_state=None):
    """This rank's piece of the model: the full reference model (from the seed, or a checkpoint's
    consolidated weights: any layout can resume any other's), pruned to its stages, then TP-sharded."""
    model = build_model(cfg, args.seed, device)
    if full_state is not None:
        model.load_state_dict(full_state, strict=True)
    my_specs = pipeline_stages.rank_stages(specs, args.pp, mesh.coord("pp"))
    model = pipeline_stages.prune_to_stages(model, my_specs)
    if args.tp > 1:
        model = tensor_parallel.parallelize_model(model, mesh.group("tp"), args.sequence_parallel)
    return model, my_specs


def consolidated_state(trainer, mesh, args, cfg):
    """The single-device state dict and AdamW state on global rank 0 (None elsewhere): the trainer
    hands its moments by name (ZeRO-1 first gathers its shards over DP), every TP group gathers its
    shards back to full tensors, then replica dp=0, tp=0 of each stage sends its names."""
    tp_group = mesh.group("tp")
    to_full = (lambda name, t: tensor_parallel.tp_to_full(name, t, tp_group, cfg.n_kv_heads)) if args.tp > 1 \
        else (lambda name, t: t)
    writer = mesh.coord("dp") == 0 and mesh.coord("tp") == 0
    return consolidate_on_rank0(trainer.model, trainer.optimizer, trainer.named, writer, to_full, trainer.optim_state())


def grid_rows(mesh) -> list[list[str]]:
    """One row per rank for the console: coordinates, groups, and what it holds."""
    return [[str(r["rank"]), str(r["dp"]), str(r["pp"]), str(r["tp"]),
             str(r["dp group"]), str(r["pp group"]), str(r["tp group"])] for r in mesh.rank_rows()]


def act_shape(args, cfg, mb_rows: int) -> tuple[int, int, int]:
    """The shape of one pipeline message: a micro-batch's hidden states, sequence-sharded under SP."""
    seq = args.seq_len // args.tp if args.sequence_parallel else args.seq_len
    return (mb_rows, seq, cfg.dim)                                        # (mb, S or S/tp, D)
