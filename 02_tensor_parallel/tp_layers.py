"""The tensor-parallel layers: each holds a slice of a single-device layer's weight.

Every layer is built from its single-device twin, keeps the parameter name `weight` (so checkpoints
and weight decay see the reference names), and takes its TP process group as an argument. Local
shapes are written in the comments: tp = the TP degree, SP = sequence parallel.

    ColumnParallelLinear   weight (out/tp, in)    f, then this rank's out/tp outputs (with SP fused: see below)
    RowParallelLinear      weight (out, in/tp)    a partial sum of all outputs, then g
    ParallelAttention      f; query heads split; KV heads split, or replicated when K < tp; g
    ParallelSwiGLU         f; gate, up column-parallel; down row-parallel; g
    VocabParallelEmbedding rows of the table split by vocabulary range, then g
    vocab_parallel_cross_entropy   the loss from (N, V/tp) logits, never gathering the vocabulary

Column then row (Megatron-LM §3): a column-parallel layer leaves its output split along the
feature dimension, which is exactly the input a row-parallel layer wants, and an elementwise
function in between (SiLU·up, or attention per head) needs no communication. So an MLP or an
attention block costs one f at the entrance and one g at the exit (`TPRegion`), written out in
the block's forward: two all-reduces per block and direction, each of B·S·D activations.

Under sequence parallelism the entrance is the all-gather, fused with the column-parallel products
that read it (`f_then_columns`, tp_operators.GatherThenColumnLinears): backward keeps the (B, S/tp, D)
shard and all-gathers it again, as Megatron-LM does, instead of keeping the gathered (B, S, D).
Under --tp-overlap (SP only) the entrance's all-gather and the exit's product + reduce-scatter (`row_then_g`)
are tp_overlap.py's ring operators: each hop travels while a sequence chunk is multiplied.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from common import comm
from common.model import swiglu
from common.step_protocol import mark_replicated

from . import tp_operators, tp_overlap
from .tp_trace import untimed


def _shard(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return full.chunk(size, dim=dim)[rank].detach().clone()


def mark_layout(p: nn.Parameter, split_dim, replicas: int) -> nn.Parameter:
    """Tag a parameter with how it is laid out over the TP group: `tp_split_dim` (None: whole) and the
    number of TP ranks holding the same values (1 for a slice of its own), which the one counting
    predicate reads (common/step_protocol.py: counted_here(replicas(p), coords))."""
    p.tp_split_dim = split_dim
    return mark_replicated(p, "tp", replicas)


class TPRegion(nn.Module):
    """A module that enters a tensor-parallel region with `f` and leaves it with `g`.

    Without sequence parallelism the activations outside the region are whole on every rank:
        f = `copy_to_tp_region`       identity forward, all-reduce backward (Megatron-LM's f)
        g = `reduce_from_tp_region`   all-reduce forward, identity backward (Megatron-LM's g)
    With sequence parallelism (`self.sequence_parallel`) they are split along the sequence, and the
    all-reduce splits into its two halves, one on each side (Korthikanti et al.'s g and ḡ):
        f = all-gather along S forward, reduce-scatter backward
        g = reduce-scatter along S forward, all-gather backward
    Subclasses set `self.group` and `self.sequence_parallel`.
    """
    # SP only, for the chapter's comparison (bench_tp.py): keep the gathered (B, S, D) input for backward,
    # as f then nn.Linear would, instead of re-gathering the shard. parallelize_model(keep_gathered=True).
    keep_gathered = False
    # --tp-overlap (SP only): the entrance's all-gather and the exit's reduce-scatter decomposed into ring
    # steps under the matmuls' chunks (tp_overlap.py). parallelize_model(overlap=True).
    overlap = False
    # The timer handed to the operators (tp_trace.py): each SP collective, each ring step's parts; none by
    # default. parallelize_model(span=...).
    span = staticmethod(untimed)

    def f(self, x):                      # enter: (B, S, D) whole, or (B, S/tp, D) with SP -> (B, S, D)
        if self.sequence_parallel:
            return tp_operators.gather_from_sequence_parallel_region(x, self.group, span=self.span)
        return tp_operators.copy_to_tp_region(x, self.group)

    def g(self, y):                      # leave: (B, S, D) partial sums -> (B, S, D), or (B, S/tp, D) with SP
        if self.sequence_parallel:
            return tp_operators.reduce_scatter_to_sequence_parallel_region(y, self.group, span=self.span)
        return tp_operators.reduce_from_tp_region(y, self.group)

    def row_then_g(self, row, x):
        """Leave the region through the row-parallel layer `row`: its partial sum, then g. -> (B, S, D), or
        (B, S/tp, D) with SP. Under --tp-overlap the product and the reduce-scatter are one ring operator
        (tp_overlap.py): each chunk's partial sum travels while the next chunk is multiplied."""
        if self.sequence_parallel and self.overlap:
            return tp_overlap.row_linear_then_ring_reduce_scatter(x, row.weight, self.group, span=self.span)
        return self.g(row(x))            # (B, S, D) partial sums on each rank, then g

    def regathers(self) -> bool:
        """Does the entrance keep only the sequence shard and all-gather it again in backward?"""
        return self.sequence_parallel and not self.keep_gathered

    def f_then_columns(self, x, *columns):
        """Enter the region and apply the column-parallel layers that read its input: f once for all
        (q, k, v; gate, up), so f's backward sums their input gradients before ONE all-reduce (or
        reduce-scatter). -> [(B, S, out_i/tp)], one per layer. Under SP (`regathers`) the all-gather
        and the products are one operator that keeps the (B, S/tp, D) shard for backward; it
        multiplies by the layers' weights itself, so their forward (the same F.linear) is not called."""
        if self.regathers():             # (B, S/tp, D) -> all-gather + products; backward re-gathers
            weights = [c.weight for c in columns]
            if self.overlap:             # --tp-overlap: the all-gather's hops under the products' chunks
                return tp_overlap.ring_gather_then_column_linears(x, weights, self.group, span=self.span)
            return tp_operators.gather_then_column_linears(x, weights, self.group, span=self.span)
        x = self.f(x)                    # f: (B, S, D) on every rank, kept by each product for backward
        return [c(x) for c in columns]


class ColumnParallelLinear(TPRegion):
    """y = x Wᵀ with W's output rows split: this rank computes y[..., rank·out/tp : (rank+1)·out/tp].

    Each output slice depends on all of x, so the layer starts with f (the sum of the ranks' input
    gradients in backward). `apply_f=False`: the caller enters the region once for several layers
    reading the same input (q, k, v; gate, up: `f_then_columns`): three f's would all-reduce three
    gradients instead of their sum. The output stays split: the next layer (row-parallel, or the
    vocab-parallel loss after the LM head) wants it so. Under SP the entrance (all-gather) and the
    product are one operator that keeps only the input's sequence shard for backward."""

    def __init__(self, weight, group, sequence_parallel=False, apply_f=True):
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.sequence_parallel, self.apply_f = group, sequence_parallel, apply_f
        self.weight = mark_layout(nn.Parameter(_shard(weight, 0, rank, size)), 0, 1)   # (out/tp, in)

    def forward(self, x):                # (B, S, in), or (B, S/tp, in) with SP
        if self.apply_f and self.regathers():    # SP: all-gather + product, backward keeps the shard
            return self.f_then_columns(x, self)[0]   # (B, S, out/tp)
        if self.apply_f:
            x = self.f(x)                # f: (B, S, in), whole on every rank
        return F.linear(x, self.weight)  # (B, S, out/tp): this rank's output features


class RowParallelLinear(TPRegion):
    """y = x Wᵀ with W's input columns split: x arrives split (B, S, in/tp), each rank's product is a
    partial sum of the whole y, and g (or the reduce-scatter with SP) adds the partials.
    `apply_g=False`: return the partial sum; the caller applies g (written out in its forward)."""

    def __init__(self, weight, group, sequence_parallel=False, apply_g=True):
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.sequence_parallel, self.apply_g = group, sequence_parallel, apply_g
        self.weight = mark_layout(nn.Parameter(_shard(weight, 1, rank, size)), 1, 1)   # (out, in/tp)

    def forward(self, x):                # (B, S, in/tp)
        # >>> exercise 02.row_parallel
        y = F.linear(x, self.weight)     # (B, S, out): a partial sum on each rank
        return self.g(y) if self.apply_g else y   # g: (B, S, out), or (B, S/tp, out) with SP
        # <<< exercise 02.row_parallel


class ReplicatedKVHead(nn.Module):
    """The rows of wk or wv for ONE KV head, the same copy on the tp/K ranks whose query heads read it
    (when K < tp). No communication of its own: the block's f and g surround it."""

    def __init__(self, weight, head: int, head_dim: int, replicas: int):
        super().__init__()
        rows = weight[head * head_dim:(head + 1) * head_dim].detach().clone()
        self.weight = mark_layout(nn.Parameter(rows), None, replicas)                   # (hd, D)

    def forward(self, x):                # (B, S, D) -> (B, S, hd)
        return F.linear(x, self.weight)


class ParallelAttention(TPRegion):
    """Grouped-query attention with the heads split over the TP group: f, the local heads, g.

    Rank r holds query heads [r·H/tp, (r+1)·H/tp). When K ≥ tp it holds KV heads [r·K/tp, (r+1)·K/tp),
    which are exactly the ones its query heads read. When K < tp (tp a multiple of K) the tp/K ranks
    whose query heads share one KV head each hold a copy of it: each copy's gradient only sees that
    rank's query heads, so the copies' gradients must be summed (`sync_replicated_kv_grads`).
    """

    def __init__(self, dense, group, sequence_parallel=False):
        super().__init__()
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        H, K, hd = dense.n_heads, dense.n_kv_heads, dense.head_dim
        self.group, self.sequence_parallel = group, sequence_parallel
        self.n_heads, self.head_dim, self.total_kv_heads = H // tp, hd, K
        # f (with q, k, v) and g are written out in forward, once for the whole block.
        self.wq = ColumnParallelLinear(dense.wq.weight, group, sequence_parallel, apply_f=False)   # (H/tp·hd, D)
        self.wo = RowParallelLinear(dense.wo.weight, group, sequence_parallel, apply_g=False)      # (D, H/tp·hd)
        if K >= tp:
            self.n_kv_heads, self.kv_replicas = K // tp, 1
            self.wk = ColumnParallelLinear(dense.wk.weight, group, sequence_parallel, apply_f=False)   # (K/tp·hd, D)
            self.wv = ColumnParallelLinear(dense.wv.weight, group, sequence_parallel, apply_f=False)
        else:
            self.n_kv_heads, self.kv_replicas = 1, tp // K
            self.kv_head = rank // self.kv_replicas          # the one KV head this rank's queries read
            self.wk = ReplicatedKVHead(dense.wk.weight, self.kv_head, hd, self.kv_replicas)          # (hd, D)
            self.wv = ReplicatedKVHead(dense.wv.weight, self.kv_head, hd, self.kv_replicas)
        self.attend = dense.attend       # the attention core on the local heads (common.model.Attention)

    def forward(self, x, cos, sin):      # (B, S, D), or (B, S/tp, D) with SP
        q, k, v = self.f_then_columns(x, self.wq, self.wk, self.wv)   # f, once for all three: (B, S, ·/tp)
        B, S, _ = q.shape
        q = q.view(B, S, self.n_heads, self.head_dim).transpose(1, 2)              # (B, H/tp, S, hd)
        k = k.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)           # (B, K/tp or 1, S, hd)
        v = v.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        heads = self.attend(q, k, v, cos, sin)             # (B, S, H/tp·hd)
        return self.row_then_g(self.wo, heads)   # wo, a partial sum, then g: (B, S, D), or (B, S/tp, D) with SP


class ParallelSwiGLU(TPRegion):
    """down(silu(gate(x)) · up(x)): gate and up split by columns, down by rows; F/tp hidden units here."""

    def __init__(self, dense, group, sequence_parallel=False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        # f (with gate and up) and g are written out in forward, once for the whole MLP.
        self.w_gate = ColumnParallelLinear(dense.w_gate.weight, group, sequence_parallel, apply_f=False)  # (F/tp, D)
        self.w_up = ColumnParallelLinear(dense.w_up.weight, group, sequence_parallel, apply_f=False)      # (F/tp, D)
        self.w_down = RowParallelLinear(dense.w_down.weight, group, sequence_parallel, apply_g=False)     # (D, F/tp)

    def forward(self, x):                # (B, S, D), or (B, S/tp, D) with SP
        gate, up = self.f_then_columns(x, self.w_gate, self.w_up)   # f, once for both: (B, S, F/tp) each
        hidden = swiglu(gate, up)        # (B, S, F/tp)
        return self.row_then_g(self.w_down, hidden)   # down, a partial sum, then g: (B, S, D), or (B, S/tp, D) with SP


class VocabParallelEmbedding(TPRegion):
    """Rows [r·V/tp, (r+1)·V/tp) of the table on rank r. A token outside this range looks up a dummy
    row whose output is zeroed; summing over ranks (g, or a reduce-scatter along the sequence with SP)
    then gives every token the one row that some rank holds."""

    def __init__(self, weight, group, sequence_parallel=False):
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start = rank * weight.shape[0] // size
        self.weight = mark_layout(nn.Parameter(_shard(weight, 0, rank, size)), 0, 1)   # (V/tp, D)

    def forward(self, tokens):           # (B, S) ints in [0, V)
        local = tokens - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])                   # (B, S) bool
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)  # (B, S, D)
        out = out * inside.unsqueeze(-1).to(out.dtype)                            # foreign tokens: zero rows, zero grads
        return self.g(out)               # g: (B, S, D), or (B, S/tp, D) with SP


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy from vocabulary-split logits, never materialising (N, V) on any rank.

    loss_i = log Σ_v exp(z_iv) − z_i,t  needs, over the whole vocabulary, only three numbers per
    token: the max (for a stable exp), the sum of exps, and the target's logit (held by one rank).
    Three all-reduces of N floats each replace an all-gather of N·V logits. The gradient
    softmax − onehot is local: each rank already holds its columns of the softmax.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):    # (N, V/tp) floats, (N,) ints
        # >>> exercise 02.vocab_ce
        logits = logits.float()
        z_max = logits.max(dim=-1).values                                          # (N,)
        comm.all_reduce(z_max, group=group, name="tp", op=dist.ReduceOp.MAX)
        shifted = logits - z_max.unsqueeze(-1)                                     # (N, V/tp), ≤ 0
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)                                                  # (N,)
        comm.all_reduce(sum_exp, group=group, name="tp")
        local_t = targets - vocab_start
        inside = (local_t >= 0) & (local_t < logits.shape[-1])                     # (N,) this rank holds the target
        local_t = local_t.clamp(0, logits.shape[-1] - 1)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * inside   # (N,) zero elsewhere
        comm.all_reduce(target_logit, group=group, name="tp")
        softmax = exp / sum_exp.unsqueeze(-1)                                      # (N, V/tp) this rank's columns
        ctx.save_for_backward(softmax, local_t, inside)
        return (sum_exp.log() - target_logit).sum()
        # <<< exercise 02.vocab_ce

    @staticmethod
    def backward(ctx, grad):             # d(sum loss)/dz = softmax − onehot(target), local columns only
        # >>> exercise 02.vocab_ce
        softmax, local_t, inside = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_t] -= inside.to(g.dtype)
        return g * grad, None, None, None
        # <<< exercise 02.vocab_ce


def vocab_parallel_cross_entropy(local_logits, targets, group):
    """(B, S, V/tp) logits and (B, S) targets -> the SUMMED loss over all B·S tokens (like loss_sum)."""
    rank = dist.get_rank(group)
    V_local = local_logits.shape[-1]
    return VocabParallelCrossEntropy.apply(local_logits.flatten(0, 1), targets.flatten(), rank * V_local, group)
