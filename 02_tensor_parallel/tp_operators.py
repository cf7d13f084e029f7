"""The communication operators of tensor parallelism, each an autograd Function.

Megatron-LM (Shoeybi et al., 2019, §3) needs only two operators, and they are *conjugates*: what
one does in the forward pass, the other does in the backward pass.

    f  identity forward, all-reduce backward  `copy_to_tp_region`       (enters a parallel region)
    g  all-reduce forward, identity backward  `reduce_from_tp_region`   (leaves a parallel region)

Why: a column-parallel linear needs the whole input X on every rank (f forward: nothing to do), and
each rank's slice of the output depends on all of X, so dL/dX is a sum over ranks (f backward:
all-reduce). A row-parallel linear produces on each rank a partial sum of the output (g forward:
all-reduce), and the gradient of a sum reaches each term unchanged (g backward: identity).

Sequence parallelism (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large
Transformer Models", §4.2.2) keeps the activations between the parallel regions split along the
sequence, and replaces f and g by another conjugate pair (the paper calls them g and ḡ):

    all-gather forward / reduce-scatter backward   `gather_from_sequence_parallel_region`   (replaces f)
    reduce-scatter forward / all-gather backward   `reduce_scatter_to_sequence_parallel_region`   (replaces g)

An all-reduce *is* a reduce-scatter followed by an all-gather, so the pair moves the same bytes as
f and g, but the norms and residual adds in between now work on S/tp tokens instead of S.

One more trade makes SP what the paper counts (its sbh(34/t) per layer): the column-parallel layers
after the all-gather must not keep the gathered (B, S, D) input for backward. `GatherThenColumnLinears`
fuses the all-gather with the linears that read it, keeps the (B, S/tp, D) shard, and all-gathers it
again in backward for the weight gradients: one more all-gather per gathered input, tp× fewer bytes kept.

Every collective goes through common.comm with name="tp", so its bytes are counted. Every operator
takes its process group as an argument: the TP group may be a small part of the world (chapter 04
runs it under pipeline stages and data parallelism).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import comm

from .tp_trace import untimed


# --- collectives along any dimension (comm's wrappers gather and scatter along dim 0) ---------------

def _all_reduce(x, group):
    x = x.clone()                        # never reduce in place into a tensor autograd still holds
    comm.all_reduce(x, group=group, name="tp")
    return x


def _all_gather(x, dim, group, span=untimed):
    """Concatenate every rank's x along `dim`. Bytes: (N-1)/N of the gathered tensor, each way. `span`: the
    caller's timer (tp_trace.py), or `untimed`."""
    N = dist.get_world_size(group)
    if N == 1:
        return x
    shard = x.movedim(dim, 0).contiguous()                                        # (n, ...)
    out = torch.empty((N * shard.shape[0],) + shard.shape[1:], dtype=x.dtype, device=x.device)  # (N·n, ...)
    with span("collective"):             # timing only, when overlap_tp.py draws the timeline
        comm.all_gather_into(out, shard, group=group, name="tp")
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x, dim, group, span=untimed):
    """Sum x over ranks; rank i keeps the i-th chunk along `dim`. Bytes: (N-1)/N of x, each way."""
    N = dist.get_world_size(group)
    if N == 1:
        return x
    full = x.movedim(dim, 0).contiguous()                                         # (N·n, ...)
    out = torch.empty((full.shape[0] // N,) + full.shape[1:], dtype=x.dtype, device=x.device)   # (n, ...)
    with span("collective"):
        comm.reduce_scatter_into(out, full, group=group, name="tp")
    return out.movedim(0, dim).contiguous()


# --- Megatron's f and g -------------------------------------------------------------------------------

class CopyToTensorParallelRegion(torch.autograd.Function):
    """`f` in the Megatron-LM paper: identity forward, all-reduce backward. Conjugate of `g`."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):             # every rank's slice of the output used all of x: sum the grads
        # >>> exercise 02.f_g
        return _all_reduce(grad, ctx.group), None
        # <<< exercise 02.f_g


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """`g` in the Megatron-LM paper: all-reduce forward, identity backward. Conjugate of `f`."""

    @staticmethod
    def forward(ctx, x, group):
        # >>> exercise 02.f_g
        return _all_reduce(x, group)
        # <<< exercise 02.f_g

    @staticmethod
    def backward(ctx, grad):             # d(sum of partials)/d(partial) = 1
        # >>> exercise 02.f_g
        return grad, None
        # <<< exercise 02.f_g


# --- sequence parallelism: the all-reduce split into its two halves ------------------------------------

class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """`g` in the sequence-parallelism paper (it replaces Megatron's f before a column-parallel layer):
    all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, dim, group, span):   # (B, S/tp, D) -> (B, S, D)
        ctx.dim, ctx.group, ctx.span = dim, group, span
        return _all_gather(x, dim, group, span)

    @staticmethod
    def backward(ctx, grad):             # (B, S, D) partial on each rank -> summed, (B, S/tp, D)
        return _reduce_scatter(grad, ctx.dim, ctx.group, ctx.span), None, None, None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """`ḡ` in the sequence-parallelism paper (it replaces Megatron's g after a row-parallel layer):
    reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, dim, group, span):   # (B, S, D) partial sums -> (B, S/tp, D) complete
        ctx.dim, ctx.group, ctx.span = dim, group, span
        return _reduce_scatter(x, dim, group, span)

    @staticmethod
    def backward(ctx, grad):             # (B, S/tp, D) -> (B, S, D), the same on every rank
        return _all_gather(grad, ctx.dim, ctx.group, ctx.span), None, None, None


# --- sequence parallelism as Megatron-LM runs it: keep the shard, gather it again in backward ------------

class GatherThenColumnLinears(torch.autograd.Function):
    """SP's entrance (the paper's g: all-gather along S) fused with the column-parallel linears that read
    its output (q, k, v; gate, up; the LM head), keeping only this rank's SHARD of the input for backward.

    Unfused, `gather_from_sequence_parallel_region` then F.linear: F.linear saves its input, the gathered
    (B, S, D), tp times the shard, and it lives until the block's backward. The weight gradients do need
    all S positions (dW = dyᵀ X sums over every token), but not before backward: Megatron-LM's
    column-parallel linear under sequence_parallel saves the shard and all-gathers it again there. The
    trade, per gathered input: (tp−1)/tp·B·S·D values fewer kept, one all-gather of (B, S, D) more in
    backward (Megatron hides it behind the dX matmul; here it blocks).

        forward    x (B, S/tp, D) --all-gather--> X (B, S, D) --> y_i = X W_iᵀ, each (B, S, out_i/tp)
                   X is freed when forward returns: autograd holds x (and the weights, not activations)
    """

    @staticmethod
    def forward(ctx, x, dim, group, span, *weights):   # x (B, S/tp, D); weights (out_i/tp, D) each
        ctx.dim, ctx.group, ctx.span = dim, group, span
        ctx.save_for_backward(x, *weights)              # the shard, not the gathered X
        X = _all_gather(x, dim, group, span)            # (B, S, D), the same on every rank
        return tuple(F.linear(X, w) for w in weights)   # (B, S, out_i/tp): this rank's features of each

    @staticmethod
    def backward(ctx, *dys):                            # dy_i (B, S, out_i/tp), this rank's features
        x, *weights = ctx.saved_tensors
        # Step 1: X again, for the weight gradients: the extra all-gather (counted under "tp").
        X = _all_gather(x, ctx.dim, ctx.group, ctx.span)                             # (B, S, D)
        # Step 2: this rank's part of dL/dX, from its features of every output. Under autocast dy is
        # bf16: multiply in its dtype, add in x's (as autograd adds the linears' input gradients).
        dX = sum((dy @ w.to(dy.dtype)).to(x.dtype) for dy, w in zip(dys, weights))   # (B, S, D), partial
        # Step 3: summed over the TP group, each rank keeps its positions: the all-gather's backward.
        dx = _reduce_scatter(dX, ctx.dim, ctx.group, ctx.span)                        # (B, S/tp, D)
        # Step 4: dW_i = dy_iᵀ X over all B·S positions, the whole weight gradient of this rank's rows.
        X2 = X.reshape(-1, X.shape[-1])                                               # (B·S, D)
        dWs = [(dy.reshape(-1, dy.shape[-1]).t() @ X2.to(dy.dtype)).to(w.dtype)       # (out_i/tp, D)
               for dy, w in zip(dys, weights)]
        return (dx, None, None, None, *dWs)


# Short functional names, as used by the layers. `dim` is the sequence dimension (1 in (B, S, D)); `span`: the
# caller's timer of SP's collectives (tp_trace.TPSpans), or `untimed`.
def copy_to_tp_region(x, group):
    return CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tp_region(x, group):
    return ReduceFromTensorParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, group, dim=1, span=untimed):
    return GatherFromSequenceParallelRegion.apply(x, dim, group, span)


def reduce_scatter_to_sequence_parallel_region(x, group, dim=1, span=untimed):
    return ReduceScatterToSequenceParallelRegion.apply(x, dim, group, span)


def gather_then_column_linears(x, weights, group, dim=1, span=untimed):
    """(B, S/tp, D) and column-parallel weights -> [(B, S, out_i/tp)]; backward keeps x, not the gathered."""
    return list(GatherThenColumnLinears.apply(x, dim, group, span, *weights))
