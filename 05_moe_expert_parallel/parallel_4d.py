"""DP × TP × PP × EP: chapter 04's composition with one step inserted, the experts spread over EP.

Chapter 04 (04_3d_combined/parallel_3d.py) builds each rank's piece: the reference model, pruned to
its pipeline stage(s), TP-sharded. This chapter adds its dimension through chapter 04's seam, not by
copying it:

    Layout4D      chapter 04's Layout plus `ep`; its grid splits dp in two:
                  arange(world).view(edp, ep, pp, tp), with dp = (edp, ep) joined (common/mesh.py):
                      dp    every data-parallel rank of a stage (d = edp·ep + e): each its own rows
                      ep    the ep consecutive dp ranks that share their experts (the all-to-all group)
                      edp   the dp ranks holding the same experts (dp 4 = edp 2 × ep 2)
    experts_over_ep   the step chapter 04's build_local_model applies after TP (`then=`): each MoE
                  layer keeps its E/ep experts (expert_parallel.parallelize_experts)

Why EP inside DP. An EP group must route *different* tokens to each other's experts, so its ranks are
data-parallel ranks (each with its own rows) of the same stage and TP coordinate. After attention's
all-reduce every TP rank of a stage holds the same (mb, S, D) rows, so the TP ranks route the same
tokens through the same experts: the experts are replicated over TP, not split, and need no TP sum.
Under sequence parallelism (`--sequence-parallel`) attention's reduce-scatter leaves each TP rank
(mb, S/tp, D): each routes its own positions through its (whole) experts, as Megatron-LM does, so the
experts' gradients are partial over TP and summed like the norm gains', and the routers' per-sequence
statistics are summed over the TP group (`experts_over_ep`).
"""
import math
from dataclasses import dataclass, field
from importlib import import_module

from common.errors import require
from common.model import moe_layers
from common.moe_args import add_moe_args, check_moe_args, moe_model_config

from .expert_parallel import local_experts, parallelize_experts

parallel_3d = import_module("04_3d_combined.parallel_3d")      # chapter 04: the 3D composition and its seam


EP_JOINED = {"dp": ("edp", "ep")}      # the whole data-parallel group, read off the grid's (edp, ep)


@dataclass
class Layout4D(parallel_3d.Layout):
    joined: dict = field(default_factory=lambda: dict(EP_JOINED))
    ep: int = 1                 # expert-parallel degree, inside dp

    def grid(self) -> dict:
        """arange(world).view(edp, ep, pp, tp): EP innermost of the data-parallel ranks."""
        return {"edp": self.dp // self.ep, "ep": self.ep, "pp": self.pp, "tp": self.tp}

    def describe(self) -> str:
        return f"dp {self.dp} (= edp {self.dp // self.ep} × ep {self.ep}) × pp {self.pp} × tp {self.tp}"

    def gradient_groups(self) -> dict:
        """Chapter 04's rule with the experts, by mesh name: a dense gradient over dp (every data-parallel
        rank of the stage saw its own rows), an expert's over edp (its holders, each of which saw its EP
        group's rows). trainer_4d.build_trainer and the console read it here."""
        return {"dense": "dp", "experts": "edp"}

    def experts_held(self, cfg, experts: int) -> int:
        """A rank's part of `experts` parameters (all E experts of some blocks): its E/ep experts, the ones
        parallelize_experts keeps (local_experts)."""
        return experts // cfg.n_experts * len(local_experts(cfg.n_experts, 0, self.ep)) if cfg.n_experts else 0


def add_4d_args(p) -> None:
    parallel_3d.add_layout_args(p)
    add_moe_args(p, ep_help="expert-parallel degree, drawn from the data-parallel ranks of each stage (default: "
                            "the largest dividing the experts and --dp that leaves two ranks holding each "
                            "expert when --dp ≥ 4)")


def default_ep(dp: int, n_experts: int) -> int:
    """The largest EP dividing the experts and dp; from dp 4 on, the largest that leaves edp ≥ 2, so
    that by default two ranks hold each expert (the EDP all-reduce has something to sum)."""
    return math.gcd(dp // 2 if dp >= 4 else dp, n_experts) if n_experts else 1


def decide_layout(args, world: int, cfg=None) -> tuple[Layout4D, object]:
    """Chapter 04's degrees and checks (TP defaults to 1 here: the experts stay whole on every TP
    rank, so TP would only split the attention), then EP's, on every rank before any communication.
    `cfg`: the model (default: the preset's; chapter 07's planner passes a published shape)."""
    cfg = cfg or moe_model_config(args)                              # the preset, with --top-k applied
    # --tp not given: 1, unless --dp and --pp are both given (then TP takes what the world leaves)
    tp = args.tp if args.tp is not None else (1 if args.dp is None or args.pp is None else None)
    layout = parallel_3d.decide_layout(args, cfg, world, degrees=(args.dp, tp, args.pp))
    ep = args.ep if args.ep is not None else default_ep(layout.dp, cfg.n_experts)
    check_moe_args(args, cfg, world, ep)                             # the MoE flags; a dense model refuses them
    if cfg.n_experts:
        require(layout.dp % ep == 0, f"--ep {ep} does not divide --dp {layout.dp}: the EP group is drawn from the "
                                     f"data-parallel ranks of a stage; use an --ep that divides {layout.dp} (and "
                                     f"the model's {cfg.n_experts} experts), or a larger --dp")
        # Under sequence parallelism each TP rank routes its own S/tp positions (experts_over_ep): the balance
        # statistics are summed over tp, but the capacity's queue is each sequence's tokens in order
        require(not (args.sequence_parallel and layout.tp > 1 and args.capacity_factor is not None),
                "--capacity-factor serves each sequence's tokens in position order, but --sequence-parallel splits "
                "the positions over the TP ranks; leave --capacity-factor out (dropless, as DeepSeek-V3 trains) with "
                "--sequence-parallel")
    return Layout4D(layout.dp, layout.tp, layout.pp, layout.microbatches, dtype=layout.dtype, ep=ep), cfg


def experts_over_ep(model, mesh) -> None:
    """The step inserted after TP: each MoE layer keeps this rank's E/ep experts (none if dense). Under
    sequence parallelism each TP rank routes its own S/tp positions of every sequence through its experts
    (no gather: the residual stays split), so a router's per-sequence balance statistics are summed over
    the TP group (common/moe_routing.route); the experts' and routers' gradients, partial over TP like the
    norm gains', are summed by chapter 02's sync_tp_gradients (parallelize_model marked them replicated)."""
    parallelize_experts(model, mesh.group("ep"))
    if getattr(model, "sequence_parallel", False):               # set by chapter 02's parallelize_model
        for layer in moe_layers(model):
            layer.options.sequence_group, layer.options.sequence_name = mesh.group("tp"), "tp"


def experts_held(n_experts: int, ep_rank: int, ep: int) -> str:
    held = local_experts(n_experts, ep_rank, ep)
    return f"{held.start}-{held.stop - 1}" if n_experts else "-"


def describe_experts(cfg, args, layout: Layout4D) -> str:
    """For the console: how the experts are spread, and who reduces their gradients."""
    if not cfg.n_experts:
        return "- (dense model)"
    routing = "dropless" if args.capacity_factor is None else f"capacity factor {args.capacity_factor}"
    groups = layout.gradient_groups()
    dense, experts = (groups[kind].replace("_", " × ") for kind in ("dense", "experts"))     # dp_cp: "dp × cp"
    return (f"{cfg.n_experts} per MoE layer, top-{cfg.top_k}, {cfg.n_experts // layout.ep} per rank over ep "
            f"{layout.ep} (whole on every TP rank); gradients: dense over {dense} "
            f"({layout.group_size(groups['dense'])} ranks), experts over {experts} "
            f"({layout.group_size(groups['experts'])}); {routing}, aux α={args.aux_loss_coef}, "
            f"z β={args.z_loss_coef}, bias γ={args.router_bias_rate}")


def console_rows(cfg, args, layout: Layout4D) -> tuple[dict, dict]:
    """What the experts add to chapter 04's start tables (run_tail.RunTail.print_start): a row of the
    configuration, and a column of the ranks table (the experts a rank holds, from its ep coordinate)."""
    return ({"experts": describe_experts(cfg, args, layout)},
            {"experts": lambda row: experts_held(cfg.n_experts, row["ep"], layout.ep)})
