"""DP × TP × PP × EP × CP: chapter 05's 4D composition with one more step inserted, attention over CP.

Chapter 05 (05_moe_expert_parallel/parallel_4d.py) decides the 4D layout and builds each rank's piece
through chapter 04's seam. This chapter adds its dimension the same way, not by copying:

    Layout5D      chapter 05's Layout4D plus `cp`; its grid puts CP between PP and TP:
                  arange(world).view(edp, ep, pp, cp, tp), with three joined dimensions (common/mesh.py):
                      dp       = (edp, ep)       every data-parallel rank of a stage: its own rows
                      dp_cp    = (edp, ep, cp)   every rank holding the same dense weights: the dense
                                                 gradients are summed over it
                      edp_cp   = (edp, cp)       every rank holding the same experts: theirs over it
    then          chapter 05's step (each MoE layer keeps its E/ep experts), then this chapter's, all
                  of CP's changes to the model in one place: every attention's core becomes
                  context-parallel (context_parallel.attention_over_cp), and every router learns which
                  ranks hold the rest of each sequence (its balance statistics are per sequence)

What CP changes in chapter 05's step verbs (trainer_4d.Trainer4D, used as it is): nothing but the groups.
forward_backward runs the same schedule on (rows, S/cp) micro-batches, with the ring's (or all-gather's)
messages inside each attention and the per-sequence expert counts summed over cp inside each MoE layer;
when a stage's gradients are final they are all-reduced over the groups `Layout5D.gradient_groups()`
names, dp × cp and edp × cp; after that sum the CP ranks hold the same gradients, so the clipping norm
is chapter 05's.

Why this order, innermost first. TP talks inside every layer, twice per block, on the critical path:
the fastest links (ranks on one node, NVLink). CP talks inside every attention, and the ring's
messages can hide under the block's compute: next to TP, still inside a node where possible. PP sends
one activation per micro-batch per stage boundary; DP (and EP's edp) sum gradients once per step,
overlapped with the backward: they tolerate the slowest links, across nodes. EP's all-to-alls run
inside each MoE layer and want fast links too: with the grid above, an EP group of ranks that also
share a pipeline stage sits pp·cp·tp ranks apart — fine on one node, and the reason production runs
often fold EP into the data-parallel ranks of one node.
"""
from dataclasses import dataclass, field
from importlib import import_module

from common.errors import require

from .context_parallel import add_cp_args, attention_over_cp, check_cp
from .context_parallel import sequence_split as cp_sequence_split
from .cp_split import SequenceSplit

parallel_4d = import_module("05_moe_expert_parallel.parallel_4d")      # chapter 05: the 4D composition


JOINED = {"dp": ("edp", "ep"), "dp_cp": ("edp", "ep", "cp"), "edp_cp": ("edp", "cp")}
# Under sequence parallelism a sequence's positions are spread over cp × tp ranks: a router's per-sequence
# balance statistics are summed over this group (then_experts_and_cp), made only where a run needs it
SEQUENCE_JOINED = {"cp_tp": ("cp", "tp")}


@dataclass
class Layout5D(parallel_4d.Layout4D):
    joined: dict = field(default_factory=lambda: dict(JOINED))
    cp: int = 1                 # context-parallel degree: S/cp positions of every sequence per rank

    def grid(self) -> dict:
        """arange(world).view(edp, ep, pp, cp, tp): TP innermost, then CP."""
        return {"edp": self.dp // self.ep, "ep": self.ep, "pp": self.pp, "cp": self.cp, "tp": self.tp}

    def describe(self) -> str:
        return (f"dp {self.dp} (= edp {self.dp // self.ep} × ep {self.ep}) × pp {self.pp} × cp {self.cp} "
                f"× tp {self.tp}")

    def gradient_groups(self) -> dict:
        """The course's one rule for gradients, here whole: each kind is summed over the ranks that hold
        the same tensor, each of which saw other tokens (its own rows, or its own positions of them).

            dense tensors     over dp × cp ("dp_cp"): every rank with the same stage and TP shard
            an expert's       over edp × cp ("edp_cp"): every rank holding that expert
            TP-replicated     summed over tp after (chapter 02's sync_tp_gradients: norm gains under SP,
                              shared KV heads), and counted once per TP group in the clipping norm
            ZeRO (--zero-stage 1-3)  shards each kind over these same groups (04_3d_combined/zero_3d.py)

        At cp = 1 these are chapter 05's dp and edp. The table of every run's groups is in this chapter's
        README (section 7); trainer_4d.build_trainer takes the groups from here, by name."""
        return {"dense": "dp_cp", "experts": "edp_cp"}

    def positions(self, seq_len: int) -> int:
        """Positions of each sequence a rank holds: its S/cp (cp_split.py says which)."""
        return seq_len // self.cp


def add_5d_args(p) -> None:
    parallel_4d.add_4d_args(p)
    add_cp_args(p, "context-parallel degree (default: 2 when the world size is even); the other degrees "
                   "share what it leaves of the world as in train_4d.py")


def decide_layout(args, world: int, cfg=None) -> tuple[Layout5D, object]:
    """CP's degree first, then chapter 05's decision on the world/cp ranks left, then CP's checks; on
    every rank, before any communication. `cfg`: the model (default: the preset's)."""
    cp = args.cp if args.cp is not None else (2 if world % 2 == 0 else 1)
    require(world % cp == 0, f"--cp {cp} does not divide the world size {world}; use a --cp that divides {world} "
                             f"or launch a multiple of {cp} ranks with torchrun --nproc_per_node")
    given = [d for d in (args.dp, args.tp, args.pp) if d is not None]
    if len(given) == 3:
        product = args.dp * args.tp * args.pp * cp
        require(product == world, f"--dp {args.dp} × --tp {args.tp} × --pp {args.pp} × --cp {cp} = {product} must "
                                  f"equal the world size {world}; change the degrees or launch with "
                                  f"--nproc_per_node={product}")
    layout, cfg = parallel_4d.decide_layout(args, world // cp, cfg)    # the 4D checks on the ranks CP leaves
    check_cp(args, cp, layout.tp, cfg)                                 # under SP: S/cp splits over tp; heads
    if cp > 1:
        require(args.capacity_factor is None,
                "--capacity-factor serves each sequence's tokens in position order, but --cp splits the positions "
                "over ranks; leave --capacity-factor out (dropless, as DeepSeek-V3 trains) with --cp > 1")
    sequence_over_cp_tp = args.sequence_parallel and layout.tp > 1 and cp > 1 and cfg.n_experts
    joined = {**JOINED, **SEQUENCE_JOINED} if sequence_over_cp_tp else JOINED
    return Layout5D(layout.dp, layout.tp, layout.pp, layout.microbatches, joined=joined, dtype=layout.dtype, ep=layout.ep,
                    cp=cp), cfg


def then_experts_and_cp(args, layout: Layout5D):
    """The steps chapter 04's build_local_model applies after TP: chapter 05's experts, then CP's."""
    def then(model, mesh):
        parallel_4d.experts_over_ep(model, mesh)                      # under SP: the routers' group is tp
        if layout.cp > 1:
            cp_group = mesh.group("cp")
            attention_over_cp(model, cp_group, sequence_split(args, layout), args.cp_attention)
            # a router's balance statistics are per sequence, and my sequences' other positions are on
            # the cp group (under SP, on its tp ranks too: cp × tp): common/moe_routing.route sums the
            # per-sequence expert counts over it
            group = mesh.group("cp_tp") if "cp_tp" in layout.joined else cp_group
            for block in model.layers.values():
                if hasattr(block.mlp, "stats"):                       # an MoE layer
                    block.mlp.options.sequence_group, block.mlp.options.sequence_name = group, "cp"
    return then


def sequence_split(args, layout: Layout5D) -> SequenceSplit:
    return cp_sequence_split(args, layout.cp)


def console_rows(cfg, args, layout: Layout5D) -> tuple[dict, dict]:
    """What CP adds to chapter 05's start tables: the "context" row, and the positions each rank holds
    (from its cp coordinate: `0-31+96-127` is zig-zag's two chunks)."""
    config, columns = parallel_4d.console_rows(cfg, args, layout)
    split = sequence_split(args, layout)
    config["context"] = (f"{args.seq_len // layout.cp} of {args.seq_len} positions per rank ({args.cp_split}), "
                         f"{args.cp_attention} attention over cp {layout.cp}" if layout.cp > 1
                         else "cp 1: every rank holds whole sequences, plain causal attention")
    columns["positions"] = lambda row: "+".join(f"{a}-{b - 1}" for a, b in split.chunks(row["cp"]))
    return config, columns
