"""The bookkeeping around the context-parallel attention: what it computed, when, and what it sent.

None of it is inside the attention (ring_attention.py, allgather_attention.py, alltoall_attention.py hold the
math and nothing else): the work depends only on the shapes and the split's chunk pairs, so it is counted from
them, by the caller; the ring's timeline spans are recorded by a `span` the caller hands to the ring.

    call_entries  the score entries one attention call's forward computes on a CP rank, from the split's pairs
                  (ring, all-gather), or the causal S(S+1)/2 of the rank's head group (the all-to-all variants)
    WORK          what this rank has computed since the step began: context_parallel.ContextParallelAttention
                  adds each call's entries (and its backward's, which recomputes the same ones); train_cp.py and
                  train_5d.py reset it every step; context_parallel.cp_step_metrics turns it into
                  attn_work_imbalance
    RingSpans     a `span` for ring_attention: each part of a ring step (post, compute, wait) as a span on a
                  common/timeline.Timeline (train_cp.py --timeline, overlap_cp.py)
    cp_bytes      the bytes one attention call sends and receives under "cp", for each of the four variants
                  (ring, allgather, alltoall, alltoall+ring): what common/comm.py must count, to the byte.
"""
import time
from contextlib import contextmanager

from .cp_split import SequenceSplit


def call_entries(variant: str, split: SequenceSplit, rank: int, B: int, h: int) -> int:
    """Score entries (one query against one key, one head, one sequence row) that one attention call's forward
    computes on cp rank `rank`, whose q is (B, h, S/cp, hd):
      ring, allgather  every chunk pair of its queries with any rank's keys: B·h·split.work(rank)
      alltoall         causal attention of its h/cp heads over all S positions: B·(h/cp)·S(S+1)/2
      alltoall+ring    the ring over the cp/K groups on h/K heads: B·(h/K)·outer.work(rank // K)
    The backward recomputes each probability from the saved log-sum-exp: the same entries again."""
    if variant == "alltoall":
        return B * (h // split.cp) * split.seq_len * (split.seq_len + 1) // 2
    if variant == "alltoall+ring":
        return B * (h // split.inner) * split.outer().work(rank // split.inner)
    return B * h * split.work(rank)


class WorkTally:
    """Score entries this rank has computed since `reset()`: every attention call's forward, and the
    backward's recomputation of the same entries."""

    def __init__(self):
        self.entries = 0

    def reset(self):
        self.entries = 0

    def add(self, entries: int) -> None:
        self.entries += entries


WORK = WorkTally()


class RingSpans:
    """ring_attention's `span`: given a common/timeline.Timeline, `with spans("compute", t):` records its body
    as ring step t's "compute" (or "post", "wait"), the wall-clock span and this thread's CPU seconds inside
    it. The wait is the transfer that did NOT hide under the compute. Timing only: no number changes."""

    def __init__(self, timeline):
        self.timeline = timeline

    @contextmanager
    def __call__(self, kind: str, t: int):
        start, cpu = self.timeline.now(), time.thread_time()
        yield
        # cpu_s: this thread's CPU seconds inside the span, the work itself: ranks that share cores are
        # descheduled mid-span, which the wall-clock span counts and cpu_s does not
        self.timeline.add(kind, start, self.timeline.now(), ring_step=t, cpu_s=time.thread_time() - cpu)


def cp_bytes(variant: str, B: int, S: int, cp: int, kv: int, hd: int, element_size: int, forward_runs: int = 1,
             h: int = 0, K: int = 1) -> int:
    """Bytes one rank sends + receives under "cp" for one attention call, forward and backward.

    blk = B·(S/cp)·kv·hd·element_size is one rank's K (or V) block. The gradients travel in the compute
    dtype (fp32, or fp64 for fp64 inputs): their block is gblk. A rank receives what it sends.
      ring       forward: K and V, cp−1 hops;  backward: K and V, cp−1 hops, and dK and dV, cp−1 hops
                 sent = 2(cp−1)·blk + 2(cp−1)·blk + 2(cp−1)·gblk
      allgather  forward: one all-gather of K and V (n = cp·2·blk);  backward: one reduce-scatter of dK and
                 dV (n = cp·2·gblk); each sends (cp−1)/cp·n:  sent = 2(cp−1)·blk + 2(cp−1)·gblk
      alltoall   (h: this rank's query heads) forward: all-to-alls of q, k, v (qkv = B·(S/cp)·(h+2kv)·hd·e)
                 and of the output (o = B·(S/cp)·h·hd·e); backward: the same of dout and dq, dk, dv, in the
                 tensors' own dtype. Each sends (cp−1)/cp of its tensor:  sent = 2·(cp−1)/cp·(qkv + o)
      alltoall+ring  the all-to-alls over K ranks ((K−1)/K instead of (cp−1)/cp), plus the ring over the cp/K
                 groups on h/K, kv/K heads and S·K/cp positions: the ring's blk is the same, its hops cp/K − 1
    The ring moves K and V twice (the backward sends them around again, where the all-gather kept the
    gathered copy); that copy is the all-gather's memory cost: every rank holds the whole sequence's K/V.
    The all-to-all's tensors are ∝ S/cp and it sends nearly all of them: its bytes per rank fall as 1/cp,
    where the ring's (cp−1)·blk stay nearly constant.
    `forward_runs` 2: --recompute full reruns each block's forward in backward, its hops included."""
    if variant in ("alltoall", "alltoall+ring"):
        n = cp if variant == "alltoall" else K
        qkv, o = (B * (S // cp) * heads * hd * element_size for heads in (h + 2 * kv, h))
        sent = (forward_runs + 1) * (n - 1) * (qkv + o) // n
        if variant == "alltoall+ring":
            sent += cp_bytes("ring", B, S, cp // K, kv // K, hd, element_size, forward_runs) // 2
        return 2 * sent
    blk = B * (S // cp) * kv * hd * element_size
    gblk = blk // element_size * max(element_size, 4)
    kv_trips = {"ring": 1 + forward_runs, "allgather": forward_runs}[variant]
    sent = kv_trips * 2 * (cp - 1) * blk + 2 * (cp - 1) * gblk
    return 2 * sent
