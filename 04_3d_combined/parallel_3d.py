"""Composing the chapters on one mesh: TP innermost, pipeline stages, DP outermost.

Nothing here is new machinery: the tensor-parallel layers come from chapter 02, the stages, schedules
and executor from chapter 03, the gradient all-reduce (or ZeRO-1) from chapter 01 (the optimizer side
is driven by trainer_3d.py). This file only decides who is who on the grid and builds each piece:

    layout = decide_layout(args, cfg, world)    the degrees and micro-batches, checked on every rank
    grid   = arange(world).view(dp, pp, tp)     TP varies fastest: a TP group is consecutive ranks
    rank (d, p, t):  builds the full model from the seed (or the checkpoint),
                     keeps pipeline stage p's layers            (chapter 03: prune_to_stages)
                     keeps TP shard t of each layer             (chapter 02: parallelize_model)
                     trains on data-parallel slice d of the global batch

The seam for later chapters. A later chapter adds its dimension by inserting one step, not by copying
this file: it extends `Layout` with its degree, its `grid()` (the mesh dimensions, outermost first),
its `gradient_groups()` (which ranks sum which gradients) and what a rank holds of the new kind of state
(`experts_held`), and passes `then=` to
`build_local_model`, a function applied to this rank's piece after TP — the way torchtitan applies
TP, then context parallelism, then FSDP as separate transforms of one model.
Chapter 05's 4D run (05_moe_expert_parallel/train_4d.py) is the first user of that seam.

Why this order. TP talks in every layer (two all-reduces per block, forward and backward), on the
critical path: it needs the fastest links, so its ranks are neighbours (one node). The pipeline
sends one activation per micro-batch per stage boundary: it tolerates slower links. DP talks once
per step (the gradient all-reduce) and can overlap it: it goes across nodes.
"""
import math
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import import_module

import torch

from common.cli import check_common, pipeline_microbatches
from common.domains import NON_NEGATIVE_INT, OUTPUT_FILE, POSITIVE_INT
from common.errors import require
from common.model import build_model, parameter_shapes
from common.training import consolidate_on_rank0

tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")
pipeline_stages = import_module("03_pipeline_parallel.pipeline_stages")
pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")
scatter_gather = import_module("04_3d_combined.scatter_gather")     # this chapter: --pp-sends


ELEMENT_SIZE = {"fp32": 4, "bf16": 2}     # bytes of one activation element in the run's --dtype (weights fp32)


@dataclass
class Layout:
    """The run's degrees, decided once from the flags and the world size (never stored on `args`), and
    everything that follows from them alone: the grid, each group's size and span, which group sums which
    gradients, what a rank holds of a stage. No process group is needed to ask it (chapter 07's planner
    asks the same object about layouts it never launches); common/mesh.Mesh builds the groups from its
    `grid()` and `joined`."""
    dp: int                     # data-parallel replicas of each stage (every rank of a dp group: its own rows)
    tp: int                     # tensor-parallel degree
    pp: int                     # pipeline ranks
    microbatches: int           # per data-parallel rank and step
    joined: dict = field(default_factory=dict)    # mesh dimensions read as one (a later chapter splits dp)
    dtype: str = "fp32"         # the run's --dtype: the size of an activation element (element_size)

    def grid(self) -> dict:
        """The mesh dimensions, outermost first: arange(world).view(dp, pp, tp)."""
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp}

    def describe(self) -> str:
        return f"dp {self.dp} × pp {self.pp} × tp {self.tp}"

    def gradient_groups(self) -> dict:
        """Over which mesh dimension each kind of gradient is summed, by name: the ranks that hold the
        same tensors, each of which saw other tokens. The trainer takes its groups from here, and only
        from here. Here one kind: every gradient over dp (a tensor replicated over TP is then summed
        over tp, chapter 02's sync_tp_gradients). A later chapter's layout names its own groups."""
        return {"dense": "dp"}

    @property
    def world(self) -> int:
        """Ranks in all: the product of the grid's dimensions."""
        return math.prod(self.grid().values())

    @property
    def element_size(self) -> int:
        """Bytes of one activation element (a pipeline message, a TP or CP exchange) in the run's dtype."""
        return ELEMENT_SIZE[self.dtype]

    def group_size(self, name: str) -> int:
        """Ranks in one group of the grid, by name, a joined one too (chapter 05's edp: dp/ep)."""
        return math.prod(self.grid()[dim] for dim in self.joined.get(name, (name,)))

    def group_span(self, name: str) -> int:
        """How many consecutive ranks one group of `name` reaches across: its outermost dimension and every
        one inside it (TP, the last, varies fastest). A group whose span fits in a node talks over the
        node's links (chapter 07's planner)."""
        dims = list(self.grid())
        outermost = min(dims.index(dim) for dim in self.joined.get(name, (name,)))
        return math.prod(self.grid()[dim] for dim in dims[outermost:])

    def stage_parameters(self, cfg, spec) -> tuple[int, int]:
        """(dense, expert) parameters one rank holds of pipeline stage `spec` (chapter 03's StageSpec):
        common/model's tensors of its embedding, blocks and head, each split as chapter 02's tp_to_local
        splits it (a KV head replicated when K < tp, norms whole), the experts of a mixture as
        `experts_held` says (whole here: chapter 05's Layout4D spreads them over EP)."""
        dense = experts = 0
        for piece, count in (("embedding", spec.first), ("block", len(spec.layers)), ("head", spec.last)):
            d, x = tp_shard_parameters(cfg, piece, self.tp)
            dense, experts = dense + count * d, experts + count * x
        return dense, self.experts_held(cfg, experts)

    def experts_held(self, cfg, experts: int) -> int:
        """A rank's part of `experts` parameters of a mixture's experts: all of them (no EP here)."""
        return experts

    def positions(self, seq_len: int) -> int:
        """Positions of each sequence a rank holds: all of them here (chapter 06's Layout5D: S/cp)."""
        return seq_len

    def message_shape(self, cfg, global_batch: int, seq_len: int, sequence_parallel: bool) -> tuple[int, int, int]:
        """One pipeline message: a micro-batch's hidden states at this rank's positions, split again over tp
        under sequence parallelism."""
        positions = self.positions(seq_len)
        seq = positions // self.tp if sequence_parallel else positions
        return (global_batch // self.dp // self.microbatches, seq, cfg.dim)           # (mb, S or S/tp, D)


@lru_cache(maxsize=None)
def tp_shard_parameters(cfg, piece: str, tp: int) -> tuple[int, int]:
    """(dense, expert) parameters of one piece of the model (common/model.parameter_shapes: "embedding",
    "block" or "head") on one rank of a TP group of `tp`: each tensor cut by chapter 02's own tp_to_local
    (on the meta device: shapes, no memory)."""
    dense = experts = 0
    for name, shape in parameter_shapes(cfg)[piece].items():
        local = tensor_parallel.tp_to_local(name, torch.empty(shape, device="meta"), 0, tp, cfg.n_kv_heads)
        if tensor_parallel.in_experts(name):
            experts += local.numel()
        else:
            dense += local.numel()
    return dense, experts


def add_layout_args(p) -> None:
    """The flags of a DP × TP × PP run (and of every later chapter's run built on it)."""
    p.add_argument("--dp", type=POSITIVE_INT, default=None, help="data-parallel degree (default: what is left)")
    p.add_argument("--tp", type=POSITIVE_INT, default=None, help="tensor-parallel degree (default: 2 if possible)")
    p.add_argument("--pp", type=POSITIVE_INT, default=None, help="pipeline stages (default: 2 if possible)")
    p.add_argument("--schedule", default="1f1b", choices=list(pipeline_schedules.SCHEDULES),
                   help="pipeline schedule (zb-v, dualpipev: two stages per rank, placed in a V)")
    p.add_argument("--virtual-stages", type=POSITIVE_INT, default=1, help="model chunks per pipeline rank (interleaved)")
    p.add_argument("--sequence-parallel", action="store_true", help="TP with sequence parallelism")
    tensor_parallel.add_tp_overlap_arg(p)                  # --tp-overlap: chapter 02's ring under the matmuls
    scatter_gather.add_pp_sends_arg(p)                     # --pp-sends: each TP rank's 1/tp between stages
    p.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3],
                   help="chapter 01's ZeRO over the ranks holding the same piece (zero_3d.py): 1 shards AdamW's "
                        "state, 2 the gradients too, 3 the weights between steps too")
    p.add_argument("--val-every", type=NON_NEGATIVE_INT, default=25, help="validation loss every N steps (0: only at the end)")
    p.add_argument("--val-batches", type=POSITIVE_INT, default=2, help="global batches in one validation")
    p.add_argument("--sample-tokens", type=NON_NEGATIVE_INT, default=200, help="bytes of text to generate at the end (0: none)")
    p.add_argument("--timeline", type=OUTPUT_FILE, default=None,
                   help="write every rank's pipeline events as a Chrome trace JSON here (default: none)")


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


def decide_layout(args, cfg, world: int, degrees=None) -> Layout:
    """The degrees (those not given chosen from the world size) and the micro-batch count, with every
    check they need, on every rank, before any communication. `degrees`: (dp, tp, pp) with None where
    not given (default: the flags)."""
    dp, tp, pp = default_degrees(world, *(degrees or (args.dp, args.tp, args.pp)))
    m = pipeline_microbatches(args, dp, pp)
    check_common(args, dp=dp, microbatches=m, cfg=cfg, split_w=pipeline_schedules.SCHEDULES[args.schedule].split_w)
    require(dp * tp * pp == world,
            f"--dp {dp} × --tp {tp} × --pp {pp} = {dp * tp * pp} must equal the world size {world}; "
            f"change the degrees or launch with --nproc_per_node={dp * tp * pp}")
    tensor_parallel.check_tp_config(cfg, tp, args.seq_len, args.sequence_parallel, args.tp_overlap)
    scatter_gather.check_pp_sends(args.pp_sends, tp, pp, args.sequence_parallel)
    return Layout(dp, tp, pp, m, dtype=args.dtype)


def plan_pipeline(args, cfg, layout: Layout, build: bool = True) -> tuple[list, list | None]:
    """Chapter 03's plan for this layout: all p·v stages (stage_specs, which checks the model has
    enough layers) and every rank's actions (build_schedule); with `build` False the schedule's checks
    alone, and None for the actions."""
    v = pipeline_schedules.stages_from_flag(args.schedule, args.virtual_stages)         # the V schedules: 2
    rank_of = pipeline_schedules.stage_ranks(args.schedule, layout.pp, v)                # a loop, or a V
    specs = pipeline_stages.stage_specs(cfg, layout.pp, v, args.seq_len, rank_of)
    if not build:
        return specs, pipeline_schedules.check_schedule(args.schedule, layout.pp, layout.microbatches, v)
    return specs, pipeline_schedules.build_schedule(args.schedule, layout.pp, layout.microbatches, v)


def build_local_model(cfg, args, layout: Layout, specs, mesh, device, full_state=None, then=None):
    """This rank's piece of the model: the full reference model (from the seed, or a checkpoint's
    consolidated weights: any layout can resume any other's), pruned to its stages, then TP-sharded,
    then `then(model, mesh)`: the step a later chapter inserts (None here)."""
    model = build_model(cfg, args.seed, device, args.recompute, args.compile, args.recompute_layers,
                        [s.layers for s in specs])          # --recompute-layers counts within each stage
    if full_state is not None:
        model.load_state_dict(full_state, strict=True)
    my_specs = pipeline_stages.rank_stages(specs, layout.pp, mesh.coord("pp"))
    model = pipeline_stages.prune_to_stages(model, my_specs)
    model = tensor_parallel.parallelize_model(model, mesh.group("tp"), args.sequence_parallel,   # (tp 1: as it is)
                                              overlap=args.tp_overlap)
    if then is not None:
        then(model, mesh)
    return model, my_specs


def consolidated_state(trainer, mesh, layout: Layout, cfg, replica_dims=("dp",)):
    """The single-device state dict and AdamW state on global rank 0 (None elsewhere): the trainer
    hands its moments by name (ZeRO-1 first gathers its shards over DP), every TP group gathers its
    shards back to full tensors, then the replica at coordinate 0 of `replica_dims` (the dimensions
    whose ranks hold the same tensors), tp = 0, of each stage sends its names."""
    tp_group = mesh.group("tp")
    to_full = (lambda name, t: tensor_parallel.tp_to_full(name, t, tp_group, cfg.n_kv_heads)) if layout.tp > 1 \
        else (lambda name, t: t)
    writer = all(mesh.coord(d) == 0 for d in (*replica_dims, "tp"))
    return consolidate_on_rank0(trainer.model, trainer.optimizer, trainer.named, writer, to_full, trainer.optim_state())


def act_shape(args, cfg, layout: Layout) -> tuple[int, int, int]:
    """The shape of one pipeline message (Layout.message_shape): (mb, S or S/tp, D); under CP (mb, S/cp or
    S/cp/tp, D)."""
    return layout.message_shape(cfg, args.global_batch, args.seq_len, args.sequence_parallel)
