"""Composing the chapters on one mesh: TP innermost, pipeline stages, DP outermost (EP inside DP).

Nothing here is new machinery: the tensor-parallel layers come from chapter 02, the stages, schedules
and executor from chapter 03, the gradient all-reduce (or ZeRO-1) from chapter 01, the experts'
dispatch and combine from chapter 05 (the optimizer side is driven by trainer_3d.py). This file only
decides who is who on the grid and builds each piece:

    grid = arange(world).view(dp/ep, ep, pp, tp)  TP varies fastest: a TP group is consecutive ranks;
                                                  dp = (edp, ep) joined: d = edp·ep + e
    rank (d, p, t):  builds the full model from the seed (or the checkpoint),
                     keeps pipeline stage p's layers            (chapter 03: prune_to_stages)
                     keeps its E/ep experts of each MoE layer   (chapter 05: parallelize_experts)
                     keeps TP shard t of each layer's attention (chapter 02: parallelize_model;
                                                                 the experts stay whole)
                     trains on data-parallel slice d of the global batch

Experts (a mixture-of-experts preset, --ep): the EP group of a rank is the ep consecutive DP
coordinates of its stage and TP coordinate, so its ranks hold different rows (the all-to-all has
something to exchange) and the same stage. After the attention's all-reduce every TP rank holds the
same (mb, S, D) rows, so the TP ranks of a stage route the same tokens through the same experts: the
experts are replicated over TP, not split, and their gradients need no TP sum. A dense model is the
same grid with ep = 1 (edp = dp).

Why this order. TP talks in every layer (two all-reduces per block, forward and backward), on the
critical path: it needs the fastest links, so its ranks are neighbours (one node). The pipeline
sends one activation per micro-batch per stage boundary: it tolerates slower links. DP talks once
per step (the gradient all-reduce) and can overlap it: it goes across nodes.
"""
from importlib import import_module

from common.errors import require
from common.mesh import Mesh
from common.model import build_model
from common.training import consolidate_on_rank0

tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")
pipeline_stages = import_module("03_pipeline_parallel.pipeline_stages")
pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")
expert_parallel = import_module("05_moe_expert_parallel.expert_parallel")


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


def check_expert_layout(args, cfg, ep: int) -> None:
    """What EP needs of the rest of the layout (pure: before any communication, on every rank).
    A dense model is check_moe_args's: it refuses --ep and the other MoE flags there."""
    if not cfg.n_experts:
        return
    require(args.dp % ep == 0, f"--ep {ep} does not divide --dp {args.dp}: the EP group is drawn from the "
                               f"data-parallel ranks of a stage; use an --ep that divides {args.dp} "
                               f"(and the model's {cfg.n_experts} experts), or a larger --dp")
    require(not args.sequence_parallel, "--sequence-parallel splits each sequence over the TP ranks, but the "
                                        "mixture of experts routes whole sequences (its balance statistics and "
                                        "capacity are per sequence); leave --sequence-parallel out with experts")
    require(args.zero_stage == 0, "--zero-stage 1 shards AdamW over the whole DP group, but the experts differ "
                                  "across its EP ranks; leave --zero-stage out with experts")


def build_mesh(rank: int, world: int, args) -> Mesh:
    """The grid arange(world).view(dp/ep, ep, pp, tp) with "dp" = ("edp", "ep") joined: the same ranks,
    coordinates and dp / pp / tp groups as arange(world).view(dp, pp, tp), plus each rank's EP group
    (ranks sharing their experts) and its EDP group (ranks holding the same experts)."""
    return Mesh(rank, world, edp=args.dp // args.ep, ep=args.ep, pp=args.pp, tp=args.tp, joined={"dp": ("edp", "ep")})


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
    consolidated weights: any layout can resume any other's), pruned to its stages, its experts kept,
    then TP-sharded."""
    model = build_model(cfg, args.seed, device)
    if full_state is not None:
        model.load_state_dict(full_state, strict=True)
    my_specs = pipeline_stages.rank_stages(specs, args.pp, mesh.coord("pp"))
    model = pipeline_stages.prune_to_stages(model, my_specs)
    if args.tp > 1:
        model = tensor_parallel.parallelize_model(model, mesh.group("tp"), args.sequence_parallel)
    expert_parallel.parallelize_experts(model, mesh.group("ep"))      # no MoE layers (dense): nothing to do
    return model, my_specs


def consolidated_state(trainer, mesh, args, cfg):
    """The single-device state dict and AdamW state on global rank 0 (None elsewhere): the trainer
    hands its moments by name (ZeRO-1 first gathers its shards over DP), every TP group gathers its
    shards back to full tensors, then replica edp=0, tp=0 of each stage sends its names: the ep ranks
    of that replica hold every expert once between them (the dense weights come with each, identical)."""
    tp_group = mesh.group("tp")
    to_full = (lambda name, t: tensor_parallel.tp_to_full(name, t, tp_group, cfg.n_kv_heads)) if args.tp > 1 \
        else (lambda name, t: t)
    writer = mesh.coord("edp") == 0 and mesh.coord("tp") == 0
    return consolidate_on_rank0(trainer.model, trainer.optimizer, trainer.named, writer, to_full, trainer.optim_state())


def grid_rows(mesh) -> tuple[list[str], list[list[str]]]:
    """The console's grid: column names, then one row per rank (coordinates and groups). The EP and
    EDP columns appear when the experts are spread (ep > 1)."""
    cols = ["rank", "dp", "pp", "tp", "dp group", "pp group", "tp group"]
    if mesh.size("ep") > 1:
        cols[2:2] = ["edp", "ep"]
        cols += ["ep group", "edp group"]
    return cols, [[str(r[c]) for c in cols] for r in mesh.rank_rows()]


def describe_experts(cfg, args) -> str:
    """For the console: how the experts are spread, and who reduces their gradients."""
    if not cfg.n_experts:
        return "- (dense model)"
    routing = "dropless" if args.capacity_factor is None else f"capacity factor {args.capacity_factor}"
    return (f"{cfg.n_experts} per MoE layer, top-{cfg.top_k}, {cfg.n_experts // args.ep} per rank over EP {args.ep} "
            f"(whole on every TP rank); gradients: dense over DP ({args.dp} ranks), experts over EDP "
            f"({args.dp // args.ep}); {routing}, aux α={args.aux_loss_coef}, z β={args.z_loss_coef}, "
            f"bias γ={args.router_bias_rate}")


def act_shape(args, cfg, mb_rows: int) -> tuple[int, int, int]:
    """The shape of one pipeline message: a micro-batch's hidden states, sequence-sharded under SP."""
    seq = args.seq_len // args.tp if args.sequence_parallel else args.seq_len
    return (mb_rows, seq, cfg.dim)                                        # (mb, S or S/tp, D)
