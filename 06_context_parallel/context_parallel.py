"""Context parallelism: each rank of a CP group holds S/cp positions of every sequence in its rows.

Every layer but one works position by position and needs nothing from the other CP ranks: the
embedding, the norms, the MLP (or the experts), the head and the loss. RoPE needs each token's
*global* position. Attention is the one layer that mixes positions: a query at position i reads the
keys and values of every position j ≤ i, most of which live on other ranks. This file puts a
context-parallel core in place of each attention's (the `attend` attribute of common/model.py's
Attention and of chapter 02's ParallelAttention), and nothing else changes in the model:

    attend(q, k, v, cos, sin)        q: (B, h, S/cp, hd), k and v: (B, kv, S/cp, hd), this rank's positions
        rotate q and k by the angles of their global positions      (cos, sin: the model's whole tables)
        attention(q, k, v), built once per run by `build_attention`:
          ring          K/V blocks travel the ring (ring_attention.py), or
          allgather     K/V all-gathered, dK/dV reduce-scattered (allgather_attention.py)
          alltoall      heads re-partitioned: all S positions, h/cp heads (alltoall_attention.py)
          alltoall+ring the all-to-all over K ranks, the ring over cp/K groups (the same file)
        count the score entries computed (attention_bookkeeping: from the split's pairs, not inside the kernels)
        -> (B, S/cp, h·hd)

Gradients. Every weight is replicated over the CP ranks, and each CP rank's gradient comes from its
own positions: like data parallelism's rows, they are summed — over one dp × cp group, with a single
all-reduce per tensor. The loss is summed over this rank's tokens and divided by the *global* token
count, so that sum is exactly the single-device gradient of the mean loss.
"""

import math
from functools import partial

import torch
import torch.distributed as dist

from common.compile import eager
from common.domains import POSITIVE_INT
from common.errors import require
from common.model import apply_rope
from common.recompute import is_recomputing

from .allgather_attention import allgather_attention
from .alltoall_attention import HybridGroups, alltoall_attention, hybrid_attention
from .attention_bookkeeping import WORK, call_entries
from .cp_split import SPLITS, SequenceSplit, check_split, n_chunks
from .ring_attention import ring_attention, untimed

ATTENTIONS = ("ring", "allgather", "alltoall", "alltoall+ring")


def build_attention(variant: str, group, split: SequenceSplit, span=untimed):
    """The CP attention of `variant`, a callable (q, k, v) -> out with ring_attention's contract, built once
    per run (the all-to-all's order of positions is computed here). `group`: the CP group, or for alltoall+ring
    its HybridGroups. `span`: the ring's timer of each ring step's parts (attention_bookkeeping.RingSpans)."""
    if variant == "ring":
        return partial(ring_attention, group=group, split=split, span=span)
    if variant == "allgather":
        return partial(allgather_attention, group=group, split=split)
    if variant == "alltoall":
        return alltoall_attention(group, split)
    return hybrid_attention(group, split, span)


def add_cp_args(p, cp_help: str) -> None:
    g = p.add_argument_group("context parallelism")
    g.add_argument("--cp", type=POSITIVE_INT, default=None, help=cp_help)
    g.add_argument("--cp-split", default="zigzag", choices=SPLITS,
                   help="who holds which positions: zigzag (2·cp chunks, rank r holds chunks r and 2cp−1−r: "
                        "equal causal work) or contiguous (rank r holds the r-th S/cp)")
    g.add_argument("--cp-attention", default="ring", choices=ATTENTIONS,
                   help="ring: K/V blocks passed around the CP ring, overlapping compute; allgather: K/V "
                        "all-gathered before local attention, dK/dV reduce-scattered; alltoall (Ulysses): one "
                        "all-to-all to (all S positions, h/cp heads), local attention, one back; alltoall+ring: "
                        "the all-to-all over groups of --cp-alltoall ranks, the ring across the groups")
    g.add_argument("--cp-alltoall", type=POSITIVE_INT, default=None, metavar="K",
                   help="with --cp-attention alltoall+ring: the all-to-all's degree, K consecutive CP ranks "
                        "(K divides --cp; the ring runs over the cp/K groups)")


def sequence_split(args, cp: int) -> SequenceSplit:
    """Who holds which positions, for this run's flags (the hybrid cuts each group's chunks over its K ranks)."""
    inner = args.cp_alltoall if args.cp_attention == "alltoall+ring" and cp > 1 else 1
    return SequenceSplit(args.seq_len, cp, args.cp_split, inner)


def check_alltoall(args, cp: int, cfg, tp: int = 1) -> None:
    """The all-to-all variants split this rank's heads (n_heads/tp, and KV heads kv_heads_per_rank(tp)) over
    their degree: cp for alltoall, K for alltoall+ring. DeepSpeed-Ulysses requires the degree to divide the
    heads; some implementations replicate KV heads when it does not divide them. The course refuses."""
    variant, K = args.cp_attention, args.cp_alltoall
    require(K is None or variant == "alltoall+ring",
            f"--cp-alltoall {K} sets the all-to-all degree of --cp-attention alltoall+ring only; leave it out "
            f"with --cp-attention {variant}")
    if cp == 1 or variant not in ("alltoall", "alltoall+ring"):
        return
    require(variant == "alltoall" or K is not None,
            f"--cp-attention alltoall+ring needs --cp-alltoall K, the ranks of one all-to-all (a divisor of --cp {cp})")
    degree = cp if variant == "alltoall" else K
    require(cp % degree == 0, f"--cp-alltoall {K} must divide --cp {cp}; use a divisor of {cp}")
    h, kv = cfg.n_heads // tp, cfg.kv_heads_per_rank(tp)
    require(kv % degree == 0,
            f"--cp-attention {variant} splits this rank's {h} heads and {kv} KV heads (--tp {tp}) over {degree} "
            f"ranks, and {degree} does not divide {kv}: the course does not replicate KV heads; use "
            f"--cp-attention ring or allgather, or an all-to-all degree that divides {kv}")


def check_cp(args, cp: int, tp: int = 1, cfg=None) -> None:
    """The CP checks that need no communication (the caller checks cp against the world size). Under
    sequence parallelism (train_5d.py) the residual stream of this rank's S/cp positions is split again
    over the tp ranks, (B, S/cp/tp, D), and chapter 02's f gathers it back before each attention, so the
    CP core sees its S/cp positions as without SP: only the lengths must split."""
    check_split(args.seq_len, cp, args.cp_split)
    if cfg is not None:
        check_alltoall(args, cp, cfg, tp)
    if getattr(args, "sequence_parallel", False) and tp > 1:
        multiple = math.lcm(n_chunks(cp, args.cp_split), cp * tp)
        require(args.seq_len // cp % tp == 0,
                f"--sequence-parallel splits each CP rank's {args.seq_len // cp} positions (--seq-len {args.seq_len} "
                f"over --cp {cp}) over --tp {tp} ranks, and {args.seq_len // cp} is not a multiple of {tp}; use a "
                f"--seq-len that is a multiple of {multiple}")


class ContextParallelAttention:
    """The attention core of every block over the CP group (a plain callable: it holds no weights).
    `span`: a timer of the ring's steps (attention_bookkeeping.RingSpans, train_cp.py --timeline), or none."""

    def __init__(self, group, split: SequenceSplit, variant: str, span=untimed):
        self.split, self.variant, self.rank = split, variant, dist.get_rank(group)
        self.positions = split.positions(self.rank)                     # (S/cp,): my global positions
        if variant == "alltoall+ring":             # its two sub-groups, made on every rank in the same order
            group = HybridGroups(group, split.inner)
        self.attention = build_attention(variant, group, split, span)
        self.tables = None                                              # my rows of the RoPE tables

    def rope_rows(self, cos, sin):
        """cos and sin at my positions, (S/cp, hd/2) each: gathered once, then shared by every layer and
        step (one copy in memory, like the model's own tables)."""
        if self.tables is None or self.tables[0].device != cos.device:
            at = self.positions.to(cos.device)
            self.tables = (cos[at], sin[at])
        return self.tables

    @eager                          # --compile: the CP exchanges and their bookkeeping run eagerly (common/compile.py)
    def __call__(self, q, k, v, cos, sin):     # q (B, h, S/cp, hd), k v (B, kv, S/cp, hd), cos sin (max S, hd/2)
        cos, sin = self.rope_rows(cos, sin)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)         # each token's own angle
        out = self.attention(q, k, v)                                    # its softmax math in fp32, under any autocast
        self.count_work(q)
        B, h, S, hd = out.shape                                          # (B, h, S/cp, hd)
        return out.transpose(1, 2).reshape(B, S, h * hd)                 # (B, S/cp, h·hd)

    def count_work(self, q) -> None:
        """Bookkeeping: add this call's score entries to attention_bookkeeping.WORK, and its backward's (the
        same entries, recomputed from the saved log-sum-exp) when it will be differentiated. A recomputation
        (--recompute full) is a forward again; its backward is the one already counted."""
        forward = call_entries(self.variant, self.split, self.rank, q.shape[0], q.shape[1])
        backward = torch.is_grad_enabled() and q.requires_grad and not is_recomputing()
        WORK.add(forward * (2 if backward else 1))


def attention_over_cp(model, group, split: SequenceSplit, variant: str, span=untimed) -> None:
    """The step inserted into a composition: every attention of this rank's piece (single-device or
    TP-sharded: both call `self.attend`) gets the context-parallel core. Nothing else changes."""
    core = ContextParallelAttention(group, split, variant, span)       # one for all: one copy of its tables
    for module in model.modules():
        if hasattr(module, "attend"):
            module.attend = core


def cp_step_metrics(group, cp: int, device) -> dict:
    """`attn_work_imbalance`: max over min, over the CP ranks, of the attention score entries each
    computed this step (attention_bookkeeping.WORK; an all-gather of one number: bookkeeping, not counted)."""
    mine = torch.tensor([float(WORK.entries)], dtype=torch.float64, device=device)
    every = [mine]
    if cp > 1:
        every = [torch.zeros_like(mine) for _ in range(cp)]
        dist.all_gather(every, mine, group=group)
    works = [t.item() for t in every]
    return {"attn_work_imbalance": max(works) / min(works) if min(works) > 0 else None}
