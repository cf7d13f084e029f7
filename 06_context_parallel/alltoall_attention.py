"""All-to-all attention (DeepSpeed-Ulysses), and its hybrid with the ring: split the heads, not the keys.

The ring and the all-gather keep every rank's queries where they are and bring the keys to them. Ulysses
moves the *split* instead. Before attention, one all-to-all over the CP group re-partitions q, k and v from
"every rank S/cp positions, all h heads" to "every rank all S positions, h/cp heads"; attention is then
ordinary local causal attention of h/cp heads over the whole sequence (scaled_dot_product_attention); one
all-to-all after it brings the output back to "S/cp positions, all heads" for the output projection.

    before:  rank r holds (B, h, S/cp, hd)  = its positions, every head
    a2a:     rank r sends head group j of its positions to rank j, and receives head group r of every
             rank's positions:  (B, h/cp, S, hd)  = every position, its head group
    attend:  causal attention of the h/cp heads, every query against every earlier key, all on this rank
    a2a:     the reverse: (B, h, S/cp, hd) again

Two things to get right. (1) The positions: the split (cp_split.py) gives rank j zig-zag chunks, so the
gathered sequence arrives in rank order, not position order; before the causal mask it is put in global
order (`Repartition.to_heads`), and back to rank order after (`Repartition.to_positions`). (2) The heads:
each rank takes head group r of q *and* of k and v; under grouped-query attention query head i reads KV
head i // (h/kv), so head group r of q (heads r·h/cp ..) reads exactly KV head group r (r·kv/cp ..) when cp
divides kv. When it does not, DeepSpeed-Ulysses refuses (the degree must divide the heads); other
implementations replicate the KV heads over the ranks that share one. The course refuses, with one line,
before any communication (context_parallel.check_alltoall).

Why no attention backward is written by hand. The attention itself is local, so autograd differentiates
scaled_dot_product_attention as on one device. What is not local is the re-partition, and an all-to-all is
a permutation of data between ranks: its gradient is the inverse permutation, which is the same all-to-all
(rank r's piece j went to rank j's piece r; the gradient of rank j's piece r comes back to rank r's piece j).
`AllToAll` is that one autograd Function; everything else (indexing, permutes) autograd knows.

The shape is DeepSpeed's `DistributedAttention(local_attention, sequence_process_group)`: the re-partition is
one object (`AllToAllAttention`) and the attention between its two all-to-alls is a parameter, plain causal
attention for Ulysses, the ring for the hybrid. It is built once per split (context_parallel.py), so the order
of the gathered positions is computed once, not at every call.

Bytes per call (attention_bookkeeping.cp_bytes): each all-to-all sends (cp−1)/cp of its tensor and receives
as much; forward q,k,v and out, backward dout and dq,dk,dv. Per rank ∝ S/cp: it falls as 1/cp.

The hybrid (`--cp-attention alltoall+ring --cp-alltoall K`): the all-to-all over each group of K consecutive
CP ranks (inside a node, say), the ring over the cp/K groups (across nodes). The split is defined at the group
level (cp_split.SequenceSplit's `inner`): the cp/K groups take zig-zag chunks, and the K ranks of a group cut
each of its chunks into K pieces. After the inner all-to-all a rank holds its group's positions whole, in the
outer split's local order, for h/K heads: exactly what ring_attention expects over the outer group.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import comm

from .cp_split import SequenceSplit
from .ring_attention import compute_dtype, ring_attention, untimed


class AllToAll(torch.autograd.Function):
    """x: (n, ...) with n the group's size: piece j goes to rank j, and piece j of the result came from rank
    j. Its gradient is the same exchange run on the gradient (a permutation's inverse: see the docstring)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group), None


def _exchange(x, group):
    n = x.shape[0]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    comm.all_to_all_single(out, x.contiguous(), [1] * n, [1] * n, group, "cp")   # (n−1)/n of x each way
    return out


class Repartition:
    """The all-to-all's two directions over `group` (n ranks), and the order of the gathered positions.

    `order` puts the gathered rows (rank 0's positions, then rank 1's, ...) in `target` order: gathered[order]
    is target. `target` is every position in global order (Ulysses), or the outer split's local order for
    this group's positions (the hybrid): what the attention after it needs."""

    def __init__(self, group, gathered: torch.Tensor, target: torch.Tensor):
        self.group, self.n = group, dist.get_world_size(group)
        by_position = torch.argsort(gathered)                                    # gathered[by_position]: sorted
        self.order = by_position[torch.searchsorted(gathered[by_position], target)]   # gathered[order] = target
        self.back = torch.argsort(self.order)                                    # target[back] = gathered

    def on(self, device) -> None:
        """Keep the two orders where the tensors are (one copy, at the first call on a device)."""
        if self.order.device != device:
            self.order, self.back = self.order.to(device), self.back.to(device)

    def to_heads(self, t):                   # (B, a, L, hd): my L positions, all a heads
        B, a, L, hd = t.shape
        t = t.view(B, self.n, a // self.n, L, hd).transpose(0, 1)                # (n, B, a/n, L, hd): head group j
        t = AllToAll.apply(t, self.group)                                        # piece j: rank j's positions
        t = t.permute(1, 2, 0, 3, 4).reshape(B, a // self.n, self.n * L, hd)     # (B, a/n, n·L, hd), rank order
        return t[:, :, self.order]                                               # target order

    def to_positions(self, t):               # (B, a/n, n·L, hd): every gathered position, my head group
        B, g, nL, hd = t.shape
        t = t[:, :, self.back]                                                   # rank order again
        t = t.view(B, g, self.n, nL // self.n, hd).permute(2, 0, 1, 3, 4)        # (n, B, a/n, L, hd): rank j's
        t = AllToAll.apply(t, self.group)                                        # piece j: head group j
        return t.transpose(0, 1).reshape(B, self.n * g, nL // self.n, hd)       # (B, a, L, hd)


def causal_local(q, k, v):
    """Plain causal attention of the heads this rank holds over the whole sequence, in fp32 (fp64 for fp64
    inputs) like the other variants: Ulysses' inner attention. q (B, h/cp, S, hd), k v (B, kv/cp, S, hd)."""
    with torch.autocast(q.device.type, enabled=False):
        dt = compute_dtype(q)
        out = F.scaled_dot_product_attention(q.to(dt), k.to(dt), v.to(dt), is_causal=True,
                                             enable_gqa=q.shape[1] != k.shape[1])
    return out.to(q.dtype)


class AllToAllAttention:
    """An attention over an all-to-all group: `inner` (q, k, v) -> out runs on every position of the group and
    its share of the heads, between the two re-partitions. Called like the ring: q (B, h, L, hd), k and v
    (B, kv, L, hd), this rank's L positions; returns (B, h, L, hd)."""

    def __init__(self, inner, repartition: Repartition):
        self.inner, self.re = inner, repartition

    def __call__(self, q, k, v):
        re = self.re
        re.on(q.device)
        q, k, v = re.to_heads(q), re.to_heads(k), re.to_heads(v)                 # (B, h/n | kv/n, n·L, hd)
        return re.to_positions(self.inner(q, k, v))                              # (B, h, L, hd)


def alltoall_attention(group, split: SequenceSplit) -> AllToAllAttention:
    """Ulysses over the CP group: causal attention of h/cp heads over all S positions, in global order. Called
    with the same contract as ring_attention.ring_attention (q (B, h, S/cp, hd), k and v (B, kv, S/cp, hd)
    rotated at their global positions, cp dividing h and kv); returns this rank's (B, h, S/cp, hd)."""
    gathered = torch.cat([split.positions(j) for j in range(split.cp)])          # every rank's, in rank order
    return AllToAllAttention(causal_local, Repartition(group, gathered, torch.arange(split.seq_len)))


class HybridGroups:
    """The two sub-groups of one CP group for the hybrid: `inner`, the K consecutive CP ranks I share an
    all-to-all with, and `outer`, the cp/K ranks at my place in every K-group, my ring. torch's new_group
    must be called by every rank of the world for every group, in the same order: each rank learns every CP
    group's ranks (one all_gather_object at setup) and creates all their sub-groups."""

    def __init__(self, group, K: int):
        me = dist.get_rank()
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, dist.get_process_group_ranks(group))
        for line in dict.fromkeys(tuple(ranks) for ranks in every):              # each CP group once, in order
            at = line.index(me) if me in line else None
            for sub in [line[g:g + K] for g in range(0, len(line), K)]:          # the K-groups: all-to-all
                made = dist.new_group(list(sub))
                if at is not None and sub == line[at // K * K:at // K * K + K]:
                    self.inner = made
            for sub in [line[i::K] for i in range(K)]:                           # the rings across them
                made = dist.new_group(list(sub))
                if at is not None and sub == line[at % K::K]:
                    self.outer = made


def hybrid_attention(groups: HybridGroups, split: SequenceSplit, span=untimed) -> AllToAllAttention:
    """All-to-all over my K-group, ring over the cp/K groups (`split.inner` = K), the ring's parts timed by
    `span` (ring_attention.ring_attention's). Called with the same contract as the others."""
    K, g, outer = split.inner, dist.get_rank(groups.outer), split.outer()       # g: my K-group, my ring rank
    gathered = torch.cat([split.positions(g * K + j) for j in range(K)])         # my K-group's, in rank order

    def ring(q, k, v):                                                           # (B, h/K | kv/K, S·K/cp, hd)
        return ring_attention(q, k, v, groups.outer, outer, span)

    return AllToAllAttention(ring, Repartition(groups.inner, gathered, outer.positions(g)))   # outer local order
