"""All-gather-KV attention: the context-parallel attention Llama 3's pretraining used.

Instead of passing K/V blocks around a ring, every rank gathers the whole sequence's K and V at once (one
all-gather over the CP group) and computes its queries against all of them, chunk pair by chunk pair, with
the same math as the ring (ring_attention.py's `attend_block`, `block_grads`). The backward computes the
gradient of every rank's K/V block locally and reduce-scatters them: each rank receives the sum of every
rank's share for its own block.

Why it can pay: under grouped-query attention K and V are small (kv heads, not h), so gathering them costs
little, and one collective replaces cp−1 dependent hops. What it costs: every rank holds the whole
sequence's K/V for the backward, O(S·kv·hd) instead of the ring's O(S/cp·kv·hd). Bytes per call: see
attention_bookkeeping.cp_bytes.
"""
import torch
import torch.distributed as dist

from common import comm

from .cp_split import SequenceSplit
from .ring_attention import attend_block, backward_start, block_grads, forward_start


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, split: SequenceSplit):
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        kv = torch.stack([k, v])                                              # (2, B, kv, S/cp, hd)
        kv_all = kv.new_empty((cp * 2, *kv.shape[1:]))
        comm.all_gather_into(kv_all, kv, group, "cp")                         # rank j's K, V at rows 2j, 2j+1
        kv_all = kv_all.view(cp, *kv.shape)                                   # (cp, 2, B, kv, S/cp, hd)
        with torch.autocast(q.device.type, enabled=False):                # the softmax math in fp32
            qf, out, lse = forward_start(q)                                   # out, lse: the running result
            for j in range(cp):                                               # every rank's block, in turn
                attend_block(qf, kv_all[j], split.pairs(r, j), out, lse)
        ctx.save_for_backward(q, kv_all, out, lse)
        ctx.group, ctx.split = group, split
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, kv_all, out, lse = ctx.saved_tensors
        group, split = ctx.group, ctx.split
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        with torch.autocast(q.device.type, enabled=False):
            qf, do, delta, dq = backward_start(q, out, dout)                  # dO, D = rowsum(dO∘O), dq
            dkv_all = torch.zeros(kv_all.shape, dtype=out.dtype, device=q.device)  # (cp, 2, B, kv, S/cp, hd)
            for j in range(cp):                                               # this rank's share of each block
                block_grads(qf, kv_all[j], split.pairs(r, j), do, lse, delta, dq, dkv_all[j])
        dkv = dkv_all.new_empty(dkv_all.shape[1:])                            # (2, B, kv, S/cp, hd)
        comm.reduce_scatter_into(dkv, dkv_all.view(cp * 2, *dkv.shape[1:]), group, "cp")   # Σ over ranks, ours
        return dq.to(q.dtype), dkv[0].to(kv_all.dtype), dkv[1].to(kv_all.dtype), None, None


def allgather_attention(q, k, v, group, split: SequenceSplit) -> torch.Tensor:
    """The same contract as ring_attention.ring_attention: q (B, h, S/cp, hd), k and v (B, kv, S/cp, hd),
    rotated at their global positions; returns this rank's rows (B, h, S/cp, hd) of causal attention."""
    return AllGatherAttention.apply(q, k, v, group, split)
