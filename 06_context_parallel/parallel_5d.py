"""DP × TP × PP × EP × CP: chapter 05's 4D composition with one more step inserted, attention over CP.

Chapter 05 (05_moe_expert_parallel/parallel_4d.py) decides the 4D layout and builds each rank's piece
through chapter 04's seam. This chapter adds its dimension the same way, not by copying:

    Layout5D      chapter 05's Layout4D plus `cp`; its grid puts CP between PP and TP:
                  arange(world).view(edp, ep, pp, cp, tp), with three joined dimensions (common/mesh.py):
                      dp       = (edp, ep)       every data-parallel rank of a stage: its own rows
                      dp_cp    = (edp, ep, cp)   every rank holding the same dense weights: the dense
                                                 gradients are summed over it
                      edp_cp   = (edp, cp)       every rank holding the same experts: theirs over it
    then          chapter 05's step (each MoE layer keeps its E/ep experts), then this chapter's
                  (every attention's core becomes context-parallel: context_parallel.attention_over_cp)

Why this order, innermost first. TP talks inside every layer, twice per block, on the critical path:
the fastest links (ranks on one node, NVLink). CP talks inside every attention, and the ring's
messages can hide under the block's compute: next to TP, still inside a node where possible. PP sends
one activation per micro-batch per stage boundary; DP (and EP's edp) sum gradients once per step,
overlapped with the backward: they tolerate the slowest links, across nodes. EP's all-to-alls run
inside each MoE layer and want fast links too: with the grid above, an EP group of ranks that also
share a pipeline stage sits pp·cp·tp ranks apart — fine on one node, and the reason production runs
often fold EP into the data-parallel ranks of one node.
"""
from dataclasses import dataclass
from importlib import import_module

from common.errors import require

from .context_parallel import add_cp_args, attention_over_cp, check_cp
from .cp_split import SequenceSplit

parallel_4d = import_module("05_moe_expert_parallel.parallel_4d")      # chapter 05: the 4D composition


@dataclass
class Layout5D(parallel_4d.Layout4D):
    cp: int = 1                 # context-parallel degree: S/cp positions of every sequence per rank

    def grid(self) -> dict:
        """arange(world).view(edp, ep, pp, cp, tp): TP innermost, then CP."""
        return {"edp": self.dp // self.ep, "ep": self.ep, "pp": self.pp, "cp": self.cp, "tp": self.tp}

    def describe(self) -> str:
        return (f"dp {self.dp} (= edp {self.dp // self.ep} × ep {self.ep}) × pp {self.pp} × cp {self.cp} "
                f"× tp {self.tp}")

    def gradient_groups(self) -> dict:
        return {"dense": ("dp × cp", self.dp * self.cp), "experts": ("edp × cp", self.dp // self.ep * self.cp)}


JOINED = {"dp": ("edp", "ep"), "dp_cp": ("edp", "ep", "cp"), "edp_cp": ("edp", "cp")}


def add_5d_args(p) -> None:
    parallel_4d.add_4d_args(p)
    add_cp_args(p, "context-parallel degree (default: 2 when the world size is even); the other degrees "
                   "share what it leaves of the world as in train_4d.py")


def decide_layout(args, world: int) -> tuple[Layout5D, object]:
    """CP's degree first, then chapter 05's decision on the world/cp ranks left, then CP's checks; on
    every rank, before any communication."""
    cp = args.cp if args.cp is not None else (2 if world % 2 == 0 else 1)
    require(world % cp == 0, f"--cp {cp} does not divide the world size {world}; use a --cp that divides {world} "
                             f"or launch a multiple of {cp} ranks with torchrun --nproc_per_node")
    given = [d for d in (args.dp, args.tp, args.pp) if d is not None]
    if len(given) == 3:
        product = args.dp * args.tp * args.pp * cp
        require(product == world, f"--dp {args.dp} × --tp {args.tp} × --pp {args.pp} × --cp {cp} = {product} must "
                                  f"equal the world size {world}; change the degrees or launch with "
                                  f"--nproc_per_node={product}")
    layout, cfg = parallel_4d.decide_layout(args, world // cp)         # the 4D checks on the ranks CP leaves
    check_cp(args, cp)
    if cp > 1:
        require(args.capacity_factor is None,
                "--capacity-factor serves each sequence's tokens in position order, but --cp splits the positions "
                "over ranks; leave --capacity-factor out (dropless) with --cp > 1")
        require(args.zero_stage == 0, "--zero-stage 1 shards AdamW over the DP group, but with --cp the gradients "
                                      "are summed over dp × cp; leave --zero-stage out with --cp > 1")
    return Layout5D(layout.dp, layout.tp, layout.pp, layout.microbatches, JOINED, layout.ep, cp), cfg


def then_experts_and_cp(args, layout: Layout5D):
    """The steps chapter 04's build_local_model applies after TP: chapter 05's experts, then CP."""
    def then(model, mesh):
        parallel_4d.experts_over_ep(model, mesh)
        if layout.cp > 1:
            attention_over_cp(model, mesh.group("cp"), sequence_split(args, layout), args.cp_attention)
    return then


def sequence_split(args, layout: Layout5D) -> SequenceSplit:
    return SequenceSplit(args.seq_len, layout.cp, args.cp_split)


def act_shape(args, cfg, layout: Layout5D) -> tuple[int, int, int]:
    """One pipeline message: a micro-batch's hidden states at this rank's S/cp positions."""
    return (args.global_batch // layout.dp // layout.microbatches, args.seq_len // layout.cp, cfg.dim)
