"""`--tp-overlap`: sequence parallelism's all-gather and reduce-scatter hidden under the matmuls that need them.

With sequence parallelism (tp_operators.py) each column-parallel product waits for a whole all-gather before
it starts, and each row-parallel product's output waits for a whole reduce-scatter after it: in every layer
the matmuls and the messages take turns. Both collectives are rings of tp − 1 hops, and each hop carries one
sequence chunk of (B, S/tp, ·). A matmul over the whole sequence is tp matmuls over its chunks. So interleave
them (Wang et al., 2023, "Overlap Communication with Dependent Computation via Decomposition in Large Deep
Learning Models"; Megatron-LM's --tp-comm-overlap; torchtitan's async TP): multiply the chunk held now while
the next one travels. The same bytes move, in tp − 1 messages, and each message hides under a chunk's matmul
when that matmul takes longer than the hop.

The ring (tp = 4): rank r sends to r+1 and receives from r−1, every step, all ranks at once.

    all-gather → matmul  (which rank's shard each rank holds at step t; it multiplies it, and passes it on)
        step 0     step 1     step 2     step 3
        r0: x0     r0: x3     r0: x2     r0: x1          held at step t: x_{(r − t) mod tp}
        r1: x1     r1: x0     r1: x3     r1: x2
        r2: x2     r2: x1     r2: x0     r2: x3
        r3: x3     r3: x2     r3: x1     r3: x0

    matmul → reduce-scatter  (which chunk's partial sum passes through each rank at step t)
        step 0     step 1     step 2     step 3
        r0: y3     r0: y2     r0: y1     r0: y0 ✓        computed at step t: chunk j = (r − t − 1) mod tp,
        r1: y0     r1: y3     r1: y2     r1: y1 ✓        added to the partial sum that arrived from r−1
        r2: y1     r2: y0     r2: y3     r2: y2 ✓        (rank r−1 worked on chunk j one step earlier),
        r3: y2     r3: y1     r3: y0     r3: y3 ✓        sent on to r+1; at step tp−1, j = r: complete

The backward is the same two rings the other way round (the gradient of an all-gather is a reduce-scatter,
and of a reduce-scatter an all-gather). The column entrance's backward runs both at once: the shard travels
again for the weight gradients (sequence parallelism's re-gather, tp_operators.GatherThenColumnLinears) while
the input gradient's partial sums travel toward their owners. Every message goes through common.comm.exchange
under "tp": chunk bytes, counted exactly, which add up to chapter 02's all-gather and reduce-scatter formulas.

Equal to the plain operators to float round-off, not to the bit: a chunk's partial sums are added in ring
order, where gloo's reduce-scatter adds them in its own, and a weight gradient is a sum of tp chunk products
where the plain backward makes one product over all positions.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import comm
from common.compile import eager

from .tp_trace import untimed


def ring_neighbours(group) -> tuple[int, int, int, int]:
    """(tp, r, next, previous): the TP degree, this rank's place in the group, its neighbours' global ranks."""
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    return tp, r, ranks[(r + 1) % tp], ranks[(r - 1) % tp]


def wait(works: list) -> None:
    for w in works:
        w.wait()


# --- the ring step: post the next hop, compute on what is held, wait ------------------------------------

def ring_step(t: int, pairs: list, compute, nxt: int, prv: int, group, span=untimed):
    """One step of a ring: post every (outgoing, incoming) pair to the neighbours, run `compute()` while
    they travel, wait for them, return what `compute` returned. Posting BEFORE the compute is the whole
    trick: posted after it, the hop would wait for the matmul and the matmul for nothing. `span`: the
    caller's timer of each part (tp_trace.py), or `untimed`."""
    # >>> exercise 02.ring_step
    with span("post", ring_step=t):
        works = comm.exchange(pairs, nxt, prv, group, "tp")       # [] when nothing travels this step
    with span("compute", ring_step=t):
        out = compute()
    with span("wait", ring_step=t):
        wait(works)                                               # what the compute did not cover
    return out
    # <<< exercise 02.ring_step


# --- the column-parallel entrance: all-gather → matmul, chunk by chunk -------------------------------------

class RingGatherThenColumnLinears(torch.autograd.Function):
    """tp_operators.GatherThenColumnLinears decomposed: the same result and the same bytes, the all-gather's
    tp − 1 hops each under one chunk's products. Keeps this rank's (B, S/tp, D) shard for backward, like it."""

    @staticmethod
    def forward(ctx, x, dim, group, span, *weights):    # x (B, S/tp, D); weights (out_i/tp, D) each
        ctx.dim, ctx.group, ctx.span = dim, group, span
        ctx.save_for_backward(x, *weights)              # the shard, never the gathered X
        tp, r, nxt, prv = ring_neighbours(group)
        parts = [[None] * tp for _ in weights]          # parts[i][j]: (B, S/tp, out_i/tp), rows of rank j's shard
        held = x.contiguous()                           # (B, S/tp, D): at step t, rank (r − t)'s shard
        for t in range(tp):
            src = (r - t) % tp
            arriving = torch.empty_like(held) if t < tp - 1 else None     # the shard of rank r − t − 1
            hop = [(held, arriving)] if t < tp - 1 else []

            def products(held=held, src=src):
                for i, w in enumerate(weights):
                    parts[i][src] = F.linear(held, w)    # (B, S/tp, out_i/tp): rank src's positions
            ring_step(t, hop, products, nxt, prv, group, span)
            held = arriving
        return tuple(torch.cat(p, dim) for p in parts)  # (B, S, out_i/tp) each, positions in rank order

    @staticmethod
    def backward(ctx, *dys):                            # dy_i (B, S, out_i/tp): this rank's features
        x, *weights = ctx.saved_tensors
        tp, r, nxt, prv = ring_neighbours(ctx.group)
        dy_chunks = [dy.chunk(tp, ctx.dim) for dy in dys]          # [i][j]: (B, S/tp, out_i/tp)
        dws = [torch.zeros_like(w) for w in weights]               # (out_i/tp, D), summed over the chunks
        held, partial = x.contiguous(), None            # the shard travelling again; dX's partial sum
        for t in range(tp):
            # Step 1: post both rings' hops. The shard goes on (the re-gather, tp − 1 hops: t < tp − 1), and
            # last step's partial sum of dX goes toward its owner (tp − 1 hops: t ≥ 1).
            hop = []
            if t < tp - 1:
                arriving = torch.empty_like(held)                  # (B, S/tp, D): rank r − t − 1's shard
                hop.append((held, arriving))
            if partial is not None:
                incoming = torch.empty_like(partial)               # (B, S/tp, D): chunk j's sum so far
                hop.append((partial, incoming))
            src, j = (r - t) % tp, (r - t - 1) % tp                # the shard held; dX's chunk this step

            def chunk_grads(held=held, src=src, j=j):
                # Step 2: the weight gradients from the held shard: dW_i += dy_i[src]ᵀ x_src. Under autocast
                # dy is bf16: multiply in its dtype, add in the weight's (as GatherThenColumnLinears does).
                for dw, dyc, w in zip(dws, dy_chunks, weights):
                    dw.add_((dyc[src].flatten(0, -2).t() @ held.flatten(0, -2).to(dyc[src].dtype)).to(w.dtype))
                # Step 3: this rank's share of dX for chunk j, from its features of every output
                return sum((dyc[j] @ w.to(dyc[j].dtype)).to(x.dtype) for dyc, w in zip(dy_chunks, weights))
            mine = ring_step(t, hop, chunk_grads, nxt, prv, ctx.group, ctx.span)          # (B, S/tp, D)
            # Step 4: the shares of ranks j+1 .. r−1 arrived; add ours. At t = tp − 1, j = r: dx is complete.
            partial = mine if partial is None else incoming + mine
            if t < tp - 1:
                held = arriving
        return (partial, None, None, None, *dws)        # dx (B, S/tp, D): summed over the TP group


# --- the row-parallel exit: matmul → reduce-scatter, chunk by chunk ------------------------------------------

class RowLinearThenRingReduceScatter(torch.autograd.Function):
    """A row-parallel product and SP's exit (the reduce-scatter along S) as one ring: at each step this rank
    multiplies one sequence chunk of its input while the previous chunk's partial sum travels."""

    @staticmethod
    def forward(ctx, x, weight, dim, group, span):      # x (B, S, in/tp), weight (D, in/tp)
        ctx.dim, ctx.group, ctx.span = dim, group, span
        ctx.save_for_backward(x, weight)                # what F.linear would keep
        tp, r, nxt, prv = ring_neighbours(group)
        x_chunks = x.chunk(tp, dim)                     # [j]: (B, S/tp, in/tp)
        partial = None                                  # the partial sum leaving this rank at the next step
        for t in range(tp):
            j = (r - t - 1) % tp                        # the chunk whose sum passes through here now
            hop = []
            if partial is not None:
                incoming = torch.empty_like(partial)    # (B, S/tp, D): chunk j's sum over ranks j+1 .. r−1
                hop = [(partial, incoming)]
            mine = ring_step(t, hop, lambda j=j: F.linear(x_chunks[j], weight), nxt, prv, group, span)
            partial = mine if not hop else incoming + mine
        return partial                                  # (B, S/tp, D): chunk r, complete

    @staticmethod
    def backward(ctx, grad):                            # grad (B, S/tp, D): this rank's positions
        x, weight = ctx.saved_tensors
        tp, r, nxt, prv = ring_neighbours(ctx.group)
        x_chunks = x.chunk(tp, ctx.dim)                 # [j]: (B, S/tp, in/tp)
        dx_parts = [None] * tp                          # [j]: (B, S/tp, in/tp)
        dw = torch.zeros_like(weight)                   # (D, in/tp), summed over the chunks
        held = grad.contiguous()                        # at step t: rank (r − t)'s gradient chunk
        for t in range(tp):
            src = (r - t) % tp
            arriving = torch.empty_like(held) if t < tp - 1 else None
            hop = [(held, arriving)] if t < tp - 1 else []

            def chunk_grads(held=held, src=src):        # the all-gather's ring, each chunk used on arrival
                dx_parts[src] = (held @ weight.to(held.dtype)).to(x.dtype)                       # (B, S/tp, in/tp)
                dw.add_((held.flatten(0, -2).t() @ x_chunks[src].flatten(0, -2).to(held.dtype)).to(weight.dtype))
            ring_step(t, hop, chunk_grads, nxt, prv, ctx.group, ctx.span)
            held = arriving
        return torch.cat(dx_parts, ctx.dim), dw, None, None, None   # dx (B, S, in/tp), dW (D, in/tp)


# Functional names, as the layers call them. `dim` is the sequence dimension (1 in (B, S, D)). Under --compile
# each ring runs eagerly as a whole (common/compile.py's `eager`), its block's other pieces compiled around it.
# `span`: the caller's timer of every ring step's parts (tp_trace.TPSpans), or `untimed`.
@eager
def ring_gather_then_column_linears(x, weights, group, dim=1, span=untimed):
    """(B, S/tp, D) and column-parallel weights -> [(B, S, out_i/tp)]: the all-gather under the products."""
    return list(RingGatherThenColumnLinears.apply(x, dim, group, span, *weights))


@eager
def row_linear_then_ring_reduce_scatter(x, weight, group, dim=1, span=untimed):
    """(B, S, in/tp) and a row-parallel weight (D, in/tp) -> (B, S/tp, D), summed over the TP group."""
    return RowLinearThenRingReduceScatter.apply(x, weight, dim, group, span)
