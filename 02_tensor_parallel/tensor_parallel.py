"""Turning a single-device Transformer into its tensor-parallel shard, and back.

API (chapter 04 imports this module with importlib.import_module("02_tensor_parallel.tensor_parallel")):

    add_tp_overlap_arg(parser)      the --tp-overlap flag, the same in every script that has TP
    check_tp_config(cfg, tp, seq_len=None, sequence_parallel=False, overlap=False)   raises ConfigError,
        no communication
    parallelize_model(model, tp_group, sequence_parallel=False, keep_gathered=False, overlap=False, span=untimed)
        (keep_gathered: SP keeping each gathered input for backward, only for bench_tp.py's comparison;
        overlap: --tp-overlap, SP's all-gathers and reduce-scatters as ring steps under the matmuls)
        Works on a whole common.model.Transformer or a pipeline stage's part of one (only some Blocks
        in model.layers; tok_emb, or norm and lm_head, may be None). Keeps the methods and the
        reference parameter names:
            model.embed(tokens)        (B, S) -> (B, S, D), or (B, S/tp, D) with sequence parallelism
            model.layers[i](h, cos, sin)   same layout in and out
            model.head(h)              -> LOCAL logits (B, S, V/tp)
    tp_loss_sum(local_logits, targets, tp_group) -> summed cross-entropy (like common.model.loss_sum)
    sync_tp_gradients(model, tp_group)      after backward, before clipping / the DP all-reduce:
        sums the partial gradients of norm weights (SP) and of replicated KV heads over the TP group
        Every parameter is marked with its layout: `p.tp_split_dim` (None: whole) and how many TP ranks
        hold the same values (common.step_protocol: counted_here(replicas(p), coords) reads it)
    tp_collectives(cfg, rows, seq_len, tp, sequence_parallel, n_layers, ...)   every collective of a
        micro-batch, and tp_gradient_collectives(...) those of sync_tp_gradients: the bytes formula
    block_forward_collectives(cfg, rows, seq_len, sequence_parallel, ...)   one block's forward's alone
    tp_to_full(name, local, tp_group, n_kv_heads=None) -> full tensor (weights and AdamW moments)
    tp_to_local(name, full, tp_rank, tp_size, n_kv_heads=None) -> this rank's slice
        n_kv_heads is needed only when KV heads are replicated (n_kv_heads < tp_size).

Which dimension is split follows from the parameter's name, the same rule in both directions:
wq wk wv w_gate w_up lm_head tok_emb along dim 0 (output rows / vocabulary), wo w_down along dim 1
(input columns), norms replicated. A mixture of experts (common/model.py) is not split: its router and
experts stay whole on every TP rank, like the norms (chapter 05 shards the experts over EP instead).
"""
import torch
import torch.distributed as dist

from common import comm
from common.errors import require
from common.model import Attention, SwiGLU, loss_sum
from common.recompute import recomputed_of
from common.step_protocol import replicas

from . import tp_layers
from .tp_trace import untimed

SPLIT_DIM0 = ("wq.weight", "wk.weight", "wv.weight", "w_gate.weight", "w_up.weight", "lm_head.weight",
              "tok_emb.weight")
SPLIT_DIM1 = ("wo.weight", "w_down.weight")


def split_dim(name: str):
    """0, 1, or None (replicated) for a reference parameter name."""
    if in_experts(name):
        return None
    if name.endswith(SPLIT_DIM0):
        return 0
    if name.endswith(SPLIT_DIM1):
        return 1
    return None


def in_experts(name: str) -> bool:
    """Is this module or parameter one of a mixture's experts ("layers.3.mlp.experts.5.w_up.weight")?"""
    return ".experts." in f".{name}."


def _kv_replicated(name, tp_size, n_kv_heads):
    return n_kv_heads is not None and n_kv_heads < tp_size and name.endswith(("wk.weight", "wv.weight"))


def add_tp_overlap_arg(p) -> None:
    p.add_argument("--tp-overlap", action="store_true",
                   help="with --sequence-parallel: each all-gather before a column-parallel matmul and each "
                        "reduce-scatter after a row-parallel one as tp ring steps under the matmul's chunks "
                        "(tp_overlap.py)")


def check_tp_config(cfg, tp: int, seq_len=None, sequence_parallel=False, overlap=False) -> None:
    """Every divisibility TP needs, with the fix in the message. Pure: runs before any collective."""
    require(tp >= 1, f"--tp must be ≥ 1, got {tp}")
    require(sequence_parallel or not overlap,
            "--tp-overlap decomposes sequence parallelism's all-gather and reduce-scatter; add --sequence-parallel")
    require(cfg.n_heads % tp == 0, f"the model's {cfg.n_heads} query heads do not split over --tp {tp}; "
                                   f"use a --tp that divides {cfg.n_heads}")
    if cfg.n_kv_heads >= tp:
        require(cfg.n_kv_heads % tp == 0, f"the model's {cfg.n_kv_heads} KV heads do not split over --tp {tp}; "
                                          f"use a --tp that divides {cfg.n_kv_heads} (or a multiple of it)")
    else:
        require(tp % cfg.n_kv_heads == 0, f"--tp {tp} is not a multiple of the model's {cfg.n_kv_heads} KV heads, "
                                          f"so they cannot be replicated evenly; use a --tp that divides "
                                          f"{cfg.n_kv_heads} or a multiple of it")
    require(cfg.vocab_size % tp == 0, f"the vocabulary of {cfg.vocab_size} does not split over --tp {tp}; "
                                      f"use a --tp that divides {cfg.vocab_size}")
    require(cfg.ffn_hidden % tp == 0, f"the MLP hidden size {cfg.ffn_hidden} does not split over --tp {tp}; "
                                      f"use a --tp that divides {cfg.ffn_hidden}")
    if sequence_parallel and seq_len is not None:
        require(seq_len % tp == 0, f"--sequence-parallel splits each sequence over --tp {tp} ranks, but "
                                   f"--seq-len {seq_len} is not a multiple of {tp}; use a --seq-len divisible by {tp}")


def parallelize_model(model, tp_group, sequence_parallel: bool = False, keep_gathered: bool = False,
                      overlap: bool = False, span=untimed):
    """Replace each layer of `model` by its TP shard, in place; returns the model.

    Every rank must hold the same full weights first (build_model from the seed, or a loaded
    checkpoint): each rank keeps its slice, so the shards are exactly the single-device weights.
    Under SP each column-parallel entrance keeps its input's sequence shard for backward and
    all-gathers it again there (tp_layers.TPRegion.f_then_columns); `keep_gathered=True` keeps the
    gathered (B, S, D) instead: no re-gather, more memory (bench_tp.py compares the two; the training
    scripts never ask for it, and tp_collectives and the activation ledger count the default only).
    `overlap=True` (--tp-overlap, SP only): those all-gathers and the reduce-scatters after wo and w_down
    run as ring steps under the matmuls' sequence chunks (tp_overlap.py): the same bytes, in tp − 1
    messages each, the same activations kept.
    `span`: a timer every layer hands its SP collectives and ring steps (tp_trace.TPSpans: overlap_tp.py),
    or `untimed`: timing only, no number changes.
    """
    tp = dist.get_world_size(tp_group)
    check_tp_config(model.cfg, tp, sequence_parallel=sequence_parallel, overlap=overlap)
    if tp == 1:              # nothing to split: the single-device layers are the shards (and cost nothing)
        return model
    # Every Attention and SwiGLU, wherever it sits (whole model, or a stage holding a few Blocks).
    for name, module in list(model.named_modules()):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(module, Attention):
            setattr(parent, attr, tp_layers.ParallelAttention(module, tp_group, sequence_parallel))
        elif isinstance(module, SwiGLU) and not in_experts(name):
            setattr(parent, attr, tp_layers.ParallelSwiGLU(module, tp_group, sequence_parallel))
    if getattr(model, "tok_emb", None) is not None:
        model.tok_emb = tp_layers.VocabParallelEmbedding(model.tok_emb.weight, tp_group, sequence_parallel)
    if getattr(model, "lm_head", None) is not None:
        # Output kept split over the vocabulary: the loss never needs the whole (B, S, V) logits.
        model.lm_head = tp_layers.ColumnParallelLinear(model.lm_head.weight, tp_group, sequence_parallel)
    for name, p in model.named_parameters():
        if not hasattr(p, "tp_split_dim"):       # norms: whole on every rank
            tp_layers.mark_layout(p, None, tp)
    for module in model.modules():
        if isinstance(module, tp_layers.TPRegion):
            module.keep_gathered, module.overlap, module.span = keep_gathered, overlap, span
    model.tp_group, model.tp_size, model.sequence_parallel = tp_group, tp, sequence_parallel
    return model


def tp_loss_sum(local_logits, targets, tp_group):
    """(B, S, V/tp), (B, S) -> summed cross-entropy, the same value on every TP rank."""
    if dist.get_world_size(tp_group) == 1:          # the whole vocabulary is here: the plain loss
        return loss_sum(local_logits, targets)
    return tp_layers.vocab_parallel_cross_entropy(local_logits, targets, tp_group)


def sync_sequence_parallel_grads(model, tp_group) -> None:
    """With SP each rank's norm saw only its S/tp tokens, so its weight gradient is a partial sum:
    all-reduce them (D floats per norm: tiny). The same holds for every other tensor whole on each TP
    rank: in a mixture of experts (chapter 05) each TP rank routes its own S/tp tokens through the router
    and its experts, whose gradients are partial sums too (an expert's: 3·F·D floats, not tiny)."""
    if getattr(model, "sequence_parallel", False):
        for name, p in model.named_parameters():
            if p.grad is not None and p.tp_split_dim is None and replicas(p)["tp"] == model.tp_size:
                comm.all_reduce(p.grad, group=tp_group, name="tp")


def sync_replicated_kv_grads(model, tp_group) -> None:
    """A KV head held by tp/K ranks got, on each, the gradient from that rank's query heads only.
    Sum over the ranks sharing it with one all-reduce over the whole TP group of a (K, hd, D) buffer
    in which each rank fills its head's slot: no sub-groups to create (the TP group may be any
    part of the world), at the price of K× the bytes of one head (small: wk is K·hd·D)."""
    for module in model.modules():
        if isinstance(module, tp_layers.ParallelAttention) and module.kv_replicas > 1:
            for holder in (module.wk, module.wv):
                g = holder.weight.grad                                                   # (hd, D) partial
                buf = torch.zeros((module.total_kv_heads,) + g.shape, dtype=g.dtype, device=g.device)  # (K, hd, D)
                buf[module.kv_head] = g
                comm.all_reduce(buf, group=tp_group, name="tp")
                g.copy_(buf[module.kv_head])


def sync_tp_gradients(model, tp_group) -> None:
    """Everything TP leaves to do after backward: SP norm gradients and replicated KV heads (none at tp 1)."""
    if dist.get_world_size(tp_group) == 1:
        return
    sync_sequence_parallel_grads(model, tp_group)
    sync_replicated_kv_grads(model, tp_group)


def tp_collectives(cfg, rows: int, seq_len: int, tp: int, sequence_parallel: bool, n_layers: int,
                   first: bool = True, last: bool = True, element_size: int = 4,
                   route_counts: bool = True, recompute: str = "none",
                   recomputed: int | None = None) -> list[tuple[str, int]]:
    """(kind, bytes) of every "tp" collective of one micro-batch of `rows` sequences, forward and
    backward, through a stage of `n_layers` blocks (with the embedding if `first`, the head and the loss
    if `last`): the volumes the counter adds up (common.comm.collective_bytes of each).

    Each block's attention and MLP: g forward and f backward, one all-reduce of the (rows, S, D)
    activation each; under sequence parallelism each all-reduce becomes a pair, f an all-gather
    forward and a reduce-scatter backward, g the reverse (the same bytes), and f's all-gather runs
    again in backward (its column-parallel layers keep only the shard: TPRegion.f_then_columns), one
    more all-gather per f. The embedding's g moves the activation forward (and back under SP), the
    head's f its input gradient backward (under SP: its input forward, and again in backward); the
    vocab-parallel loss, three all-reduces of rows·S fp32 numbers. A
    mixture of experts stays whole on every TP rank: its blocks talk in the attention only; under SP
    each TP rank routes its own S/tp positions through it (no all-gather there either), and each router
    sums its per-sequence expert counts over tp, one all-reduce of (rows, E) int64 per block
    (`route_counts`: False where chapter 06 sums them over cp × tp and counts them as "cp").

    `recompute` "full" reruns each block's forward in backward, its collectives with it, but only as far
    as the last tensor backward needs (the recomputation stops there): a dense block's attention g, and
    under SP the attention's f and the MLP's f that feeds gate and up, run again, where the MLP's g, whose
    output nobody saved, does not; a mixture's block reruns its attention's region and its routers' count
    sums. `recomputed`: how many of the stage's blocks recompute (--recompute-layers; None: all)."""
    act = rows * seq_len * cfg.dim * element_size                   # one (rows, S, D) activation
    region = _region_collectives(act, sequence_parallel)
    regather = [("all_gather", act)] if sequence_parallel else []   # f's input gathered again in backward
    counts = _count_sums(cfg, rows, sequence_parallel, route_counts)
    backward = _split_regions(cfg) * (region + regather)            # f backward, and under SP f's input again
    out = (region if first else []) + n_layers * (block_forward_collectives(cfg, rows, seq_len, sequence_parallel,
                                                                            element_size, route_counts) + backward)
    if recompute == "full":                                         # the forward again, up to what backward needs
        out += recomputed_of(n_layers, recomputed) * (region + counts if cfg.n_experts else region + regather)
    if last:
        out += region + regather + 3 * [("all_reduce", rows * seq_len * 4)]
    return out


def _count_sums(cfg, rows: int, sequence_parallel: bool, route_counts: bool) -> list[tuple[str, int]]:
    """A mixture's routers under SP: each block's per-sequence expert counts, one (rows, E) int64 all-reduce."""
    return [("all_reduce", rows * cfg.n_experts * 8)] if sequence_parallel and cfg.n_experts and route_counts else []


def _split_regions(cfg) -> int:
    """A block's TP regions (f ... g): the attention, and the MLP if dense (a mixture's experts stay whole)."""
    return 1 if cfg.n_experts else 2


def _region_collectives(act: int, sequence_parallel: bool) -> list[tuple[str, int]]:
    """One TP region's collectives of an `act`-byte (rows, S, D) activation, each way: g's all-reduce forward
    (f's backward); under sequence parallelism a pair, f's all-gather and g's reduce-scatter (the same bytes)."""
    return [("all_gather", act), ("reduce_scatter", act)] if sequence_parallel else [("all_reduce", act)]


def block_forward_collectives(cfg, rows: int, seq_len: int, sequence_parallel: bool, element_size: int = 4,
                              route_counts: bool = True) -> list[tuple[str, int]]:
    """(kind, bytes) of one block's forward "tp" collectives (tp_collectives): each region's (the attention,
    and the MLP if dense) and a mixture's expert-count sum under SP. What a recomputation of the whole block
    runs again."""
    act = rows * seq_len * cfg.dim * element_size
    counts = _count_sums(cfg, rows, sequence_parallel, route_counts)
    return _split_regions(cfg) * _region_collectives(act, sequence_parallel) + counts


def tp_gradient_collectives(cfg, tp: int, sequence_parallel: bool, n_layers: int, last: bool = True,
                            ep: int = 1) -> list:
    """(kind, bytes) of `sync_tp_gradients`' all-reduces, once per step: under SP every norm gain
    (2 per block, the final norm on the last stage) and, in a mixture of experts, each block's router
    (E, D) and the 3 weights of each of its E/ep experts (chapter 05 spreads them over `ep` ranks);
    with K < tp every block's wk and wv as one (K, hd, D) buffer each. Parameters and their gradients
    are fp32."""
    norms = (2 * n_layers + last) * [("all_reduce", cfg.dim * 4)] if sequence_parallel else []
    if sequence_parallel and cfg.n_experts:
        router, expert = ("all_reduce", cfg.n_experts * cfg.dim * 4), ("all_reduce", cfg.expert_hidden * cfg.dim * 4)
        norms += n_layers * ([router] + 3 * cfg.n_experts // ep * [expert])
    kv = 2 * n_layers * [("all_reduce", cfg.n_kv_heads * cfg.head_dim * cfg.dim * 4)] if cfg.n_kv_heads < tp else []
    return norms + kv


def tp_to_full(name: str, local: torch.Tensor, tp_group, n_kv_heads=None) -> torch.Tensor:
    """The full single-device tensor from every rank's `local` (a weight or an AdamW moment).
    A collective: every rank of the TP group calls it, in the same order."""
    tp = dist.get_world_size(tp_group)
    dim = split_dim(name)
    if dim is None or tp == 1:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.detach().contiguous(), group=tp_group)   # checkpointing: not counted
    if _kv_replicated(name, tp, n_kv_heads):
        parts = parts[::tp // n_kv_heads]        # one copy of each KV head: its first holder's
    return torch.cat(parts, dim=dim)


def tp_to_local(name: str, full: torch.Tensor, tp_rank: int, tp_size: int, n_kv_heads=None) -> torch.Tensor:
    """This rank's slice of a full single-device tensor (the inverse of tp_to_full)."""
    dim = split_dim(name)
    if dim is None or tp_size == 1:
        return full
    if _kv_replicated(name, tp_size, n_kv_heads):
        return full.chunk(n_kv_heads, dim=0)[tp_rank // (tp_size // n_kv_heads)]
    return full.chunk(tp_size, dim=dim)[tp_rank]

