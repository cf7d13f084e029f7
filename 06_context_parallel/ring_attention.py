"""Ring attention: causal attention over a sequence split across the cp ranks, one K/V block at a time.

Each rank holds the queries, keys and values of its own S/cp positions (cp_split.py says which). Its
queries need the keys and values of every earlier position, which live on the other ranks. So the K/V
blocks travel around the ring of CP ranks: at step t rank r holds the block of rank (r − t) mod cp, computes
its queries against it, and passes it on to rank r+1. After cp steps every query has met every key, and no
rank ever held more than two blocks (the one it computes on, the one arriving) or an (S × S) matrix.

    step 0          step 1          step 2          step 3          (cp = 4: which rank's K/V each rank holds)
    r0: K/V0        r0: K/V3        r0: K/V2        r0: K/V1
    r1: K/V1        r1: K/V0        r1: K/V3        r1: K/V2
    ...

The next hop is posted *before* computing on the current block and waited for after, so the transfer hides
under the compute when a block's compute takes longer than its message (the ring-attention paper's
condition). Each block's result is merged into the running output with the online softmax (`merge`):
attention over all keys equals a weighted sum of attention over each block, the weights coming from each
block's log-sum-exp. The backward is written by hand: the K/V blocks go around again, together with the
partial sums of their gradients, and each block's probabilities are recomputed from the saved log-sum-exp.

Bytes per attention call (forward + backward, counted by common/comm.py under "cp"), with
blk = B·(S/cp)·kv·hd·element_size, one rank's K (or V) block: the forward sends K and V cp−1 times; the
backward sends them cp−1 times again and the partial dK and dV cp−1 times (attention_bookkeeping.cp_bytes).
Nothing here counts or times: the work is the split's pairs (attention_bookkeeping.call_entries, counted by the
caller), and a caller that draws the ring on a timeline hands it a `span` (attention_bookkeeping.RingSpans).
"""
from contextlib import nullcontext

import torch
import torch.distributed as dist

from common import comm

from .cp_split import Pair, SequenceSplit


# --- the math of one chunk pair, shared by the ring and the all-gather variant --------------------------

def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for the softmax and its sums, or fp64 when the inputs are fp64."""
    return torch.promote_types(t.dtype, torch.float32)


def expand_heads(kv: torch.Tensor, h: int) -> torch.Tensor:
    """(B, kv, L, hd) -> (B, h, L, hd): grouped-query attention's K/V heads, each repeated for the h/kv query
    heads it serves (query head i uses K/V head i // (h/kv), as scaled_dot_product_attention's enable_gqa).
    Done here, on the block being computed: the ring carries the small kv heads."""
    return kv.repeat_interleave(h // kv.shape[1], dim=1)


def sum_heads(grad: torch.Tensor, kv: int) -> torch.Tensor:
    """(B, h, L, hd) -> (B, kv, L, hd): a K/V head's gradient is the sum over the query heads that used it."""
    B, h, L, hd = grad.shape
    return grad.view(B, kv, h // kv, L, hd).sum(2)


def scores(q, k, pair: Pair):
    """S = q·kᵀ/√hd, −∞ where the key comes after the query. q: (B, h, Lq, hd), k: (B, h, Lk, hd)."""
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5                       # (B, h, Lq, Lk)
    return s if pair.mask is None else s.masked_fill(pair.mask, float("-inf"))


def merge(out, lse, out_b, lse_b):
    """The online softmax: fold one block's attention (out_b, lse_b) into the running (out, lse).

    Over the keys seen so far, out = Σⱼ e^(sⱼ − lse)·vⱼ with lse = log Σⱼ e^sⱼ; the same for the block. Over
    both, lse' = log(e^lse + e^lse_b), and each part's softmax is rescaled by its share of the new sum:
    out' = out·e^(lse − lse') + out_b·e^(lse_b − lse'). Subtracting the running max m first keeps every
    exponent ≤ 0, so nothing overflows. Before any key, lse = −∞: its weight e^(−∞) is 0.
    out: (B, h, Lq, hd), lse: (B, h, Lq)."""
    # >>> exercise 06.merge
    m = torch.maximum(lse, lse_b)                                   # running max of the log-sum-exps
    new_lse = m + torch.log(torch.exp(lse - m) + torch.exp(lse_b - m))
    new_out = out * torch.exp(lse - new_lse)[..., None] + out_b * torch.exp(lse_b - new_lse)[..., None]
    return new_out, new_lse
    # <<< exercise 06.merge


def attend_block(q, kv, pairs: list[Pair], out, lse) -> None:
    """This rank's queries against one held K/V block, every chunk pair merged into (out, lse) in place.
    q: (B, h, S/cp, hd) in the compute dtype; kv: (2, B, kv, S/cp, hd), K and V stacked."""
    k, v = (expand_heads(t, q.shape[1]).to(q.dtype) for t in kv)           # (B, h, S/cp, hd) each
    for p in pairs:
        s = scores(q[:, :, p.q_rows], k[:, :, p.k_rows], p)                   # (B, h, Lq, Lk)
        lse_b = torch.logsumexp(s, dim=-1)                                    # (B, h, Lq)
        out_b = torch.exp(s - lse_b[..., None]) @ v[:, :, p.k_rows]           # softmax(S)·v: (B, h, Lq, hd)
        out[:, :, p.q_rows], lse[:, :, p.q_rows] = merge(out[:, :, p.q_rows], lse[:, :, p.q_rows], out_b, lse_b)


def block_grads(q, kv, pairs: list[Pair], do, lse, delta, dq, dkv) -> None:
    """The backward of `attend_block` (the ring backward's step 3): adds this rank's queries' share to dq
    (in place) and to dkv, the gradient of the held block (2, B, kv, S/cp, hd). The probabilities are
    recomputed, P = e^(S − lse) with the forward's final lse, so P is already normalised over *all* keys,
    not only this block's. do: dL/dout (B, h, S/cp, hd); delta: rowsum(dO∘O) (B, h, S/cp)."""
    h, n_kv = q.shape[1], kv.shape[2]
    k, v = (expand_heads(t, h).to(q.dtype) for t in kv)                    # (B, h, S/cp, hd) each
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for p in pairs:
        qi, ki, vj, doi = q[:, :, p.q_rows], k[:, :, p.k_rows], v[:, :, p.k_rows], do[:, :, p.q_rows]
        P = torch.exp(scores(qi, ki, p) - lse[:, :, p.q_rows, None])          # (B, h, Lq, Lk)
        dP = doi @ vj.transpose(-1, -2)                                       # dL/dP
        dS = P * (dP - delta[:, :, p.q_rows, None])                           # softmax backward
        dq[:, :, p.q_rows] += dS @ ki / q.shape[-1] ** 0.5                     # S = q·kᵀ/√hd
        dk[:, :, p.k_rows] += dS.transpose(-1, -2) @ qi / q.shape[-1] ** 0.5
        dv[:, :, p.k_rows] += P.transpose(-1, -2) @ doi
    dkv[0] += sum_heads(dk, n_kv)
    dkv[1] += sum_heads(dv, n_kv)


# --- what the ring's and the all-gather's autograd Functions both start with ----------------------------

def forward_start(q):
    """What both forwards start with (autocast off): q in the compute dtype, and the running (out, lse)
    before any key: out = 0 (B, h, S/cp, hd) and lse = −∞ (B, h, S/cp), whose weight in `merge` is 0."""
    qf = q.to(compute_dtype(q))                                               # (B, h, S/cp, hd)
    return qf, torch.zeros_like(qf), torch.full(qf.shape[:-1], float("-inf"), dtype=qf.dtype, device=q.device)


def backward_start(q, out, dout):
    """The start of both backwards (the ring backward's step 1; autocast off), once for every block: q and
    dO = dL/dout in the forward's compute dtype (the saved out's), D = rowsum(dO∘O) (B, h, S/cp) for the
    softmax backward, and dq = 0, to which every block adds its share."""
    qf, do = q.to(out.dtype), dout.to(out.dtype)
    return qf, do, (do * out).sum(-1), torch.zeros_like(qf)


def wait(works: list) -> None:
    for w in works:
        w.wait()


def untimed(kind: str, t: int):
    """The ring's `span` when nobody draws it: `with span("compute", t):` times nothing."""
    return nullcontext()


# --- the ring -----------------------------------------------------------------------------------------

class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, split: SequenceSplit, span):
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        nxt, prv = ranks[(r + 1) % cp], ranks[(r - 1) % cp]                # global ranks of the neighbours
        # span(kind, t): the caller's timer of each part of ring step t (post, compute, wait), or `untimed`
        with torch.autocast(q.device.type, enabled=False):                # the softmax math in fp32
            qf, out, lse = forward_start(q)                                   # out, lse: the running result
            kv = torch.stack([k, v])                                          # (2, B, kv, S/cp, hd), travels
            for t in range(cp):
                if t < cp - 1:          # post the next hop first: it travels while this block computes
                    kv_next = torch.empty_like(kv)
                    with span("post", t):
                        works = comm.exchange([(kv, kv_next)], nxt, prv, group, "cp")
                with span("compute", t):
                    attend_block(qf, kv, split.pairs(r, (r - t) % cp), out, lse)   # held: rank (r − t)'s block
                if t < cp - 1:
                    with span("wait", t):
                        wait(works)
                    kv = kv_next
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.split = group, split
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, split = ctx.group, ctx.split
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        nxt, prv = ranks[(r + 1) % cp], ranks[(r - 1) % cp]
        with torch.autocast(q.device.type, enabled=False):
            qf, do, delta, dq = backward_start(q, out, dout)                  # Step 1: dO, D = rowsum(dO∘O), dq
            kv = torch.stack([k, v])                                          # (2, B, kv, S/cp, hd)
            # The gradient of block j gathers a share from every rank. Its partial sum starts at rank j+1
            # (the first to hold block j after its owner), follows the block around the ring, and its last
            # hop brings it home to rank j, which adds its own share, computed at ring step 0: cp−1 hops, like
            # the block itself. Steps 2 to 4 run at every ring step t, step 5 once after them.
            own = partial = None        # our own block's share; the partial sum of the block held last step
            for t in range(cp):
                # Step 2: post the hop to rank r+1, the held K/V block and last step's partial sum.
                hop = []                                                      # what goes to rank r+1 now
                if t < cp - 1:
                    kv_next = torch.empty_like(kv)
                    hop.append((kv, kv_next))
                if partial is not None:     # last step's partial sum: its block is the one rank r+1 holds now
                    partial_in = torch.empty_like(partial)
                    hop.append((partial, partial_in))
                works = comm.exchange(hop, nxt, prv, group, "cp")
                # Step 3: while they travel, this rank's share of the held block's gradient (`block_grads`).
                dkv = torch.zeros(kv.shape, dtype=out.dtype, device=q.device)   # our share of block r−t
                block_grads(qf, kv, split.pairs(r, (r - t) % cp), do, lse, delta, dq, dkv)
                # Step 4: wait; the partial sum that arrived joins our share, which stays home if the block
                # is our own (t = 0) and otherwise goes on to rank r+1 at the next ring step.
                wait(works)
                if partial is not None:
                    dkv += partial_in                                         # the shares of ranks r−t+1 .. r−1
                if t == 0:
                    own = dkv
                else:
                    partial = dkv
                if t < cp - 1:
                    kv = kv_next
            if partial is not None:     # Step 5, the last hop: every partial sum is complete and goes home
                home = torch.empty_like(partial)
                wait(comm.exchange([(partial, home)], nxt, prv, group, "cp"))
                own += home
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, group, split: SequenceSplit, span=untimed) -> torch.Tensor:
    """Causal attention of this rank's queries over every earlier global position of the sequence.

    q: (B, h, S/cp, hd), k and v: (B, kv, S/cp, hd) with h a multiple of kv, all already rotated by RoPE at
    their global positions (`split.positions(rank)`). Returns (B, h, S/cp, hd), this rank's rows of
    softmax(QKᵀ/√hd + causal mask)·V. `group` is the CP group; with one rank this is plain attention.
    `span(kind, t)`: a context manager around each part of ring step t, for a caller that draws the ring on a
    timeline (attention_bookkeeping.RingSpans); by default nothing is timed."""
    return RingAttention.apply(q, k, v, group, split, span)
