"""The bookkeeping around the context-parallel attention: what it computed, when, and what it sent.

None of it changes a number of the attention (ring_attention.py, allgather_attention.py hold the math):

    WORK        the score entries this rank has computed (a query against a key, one head, one sequence
                row): `attend_block` and `block_grads` add each block's pairs. train_cp.py and train_5d.py
                reset it every step; context_parallel.cp_step_metrics turns it into attn_work_imbalance.
    ring_span   a timeline span around one part of a ring step (post, compute, wait), recorded only when
                TRACE has a timeline (overlap_cp.py gives it one).
    cp_bytes    the bytes one attention call sends and receives under "cp", for each of the four variants
                (ring, allgather, alltoall, alltoall+ring): what common/comm.py must count, to the byte.
"""
import time
from contextlib import contextmanager

import torch

from .cp_split import Pair


class WorkTally:
    """Score entries (one query against one key, one head, one sequence row) this rank has computed since
    `reset()`: every chunk pair of the forward and of the backward's recomputation."""

    def __init__(self):
        self.entries = 0

    def reset(self):
        self.entries = 0

    def count(self, q: torch.Tensor, pairs: list[Pair]) -> None:
        """One block: q (B, h, S/cp, hd) against each pair's keys, len_q·len_k entries per head and row."""
        B, h = q.shape[0], q.shape[1]
        self.entries += sum(B * h * (p.q_rows.stop - p.q_rows.start) * (p.k_rows.stop - p.k_rows.start)
                            for p in pairs)

    def add(self, entries: int) -> None:
        """Entries computed outside the chunk pairs: the all-to-all variant's local attention."""
        self.entries += entries


WORK = WorkTally()


class RingTrace:
    """Off by default (`timeline` None). Given a common/timeline.Timeline, the ring's forward records, per ring
    step t, the time spent posting the next hop, computing on the held block, and waiting for the next block
    to arrive: the wait is the transfer that did NOT hide under the compute. Timing only: no number changes.
    bench_cp.py's overlap part turns it on (06_context_parallel/overlap_cp.py)."""

    def __init__(self):
        self.timeline = None

    @contextmanager
    def span(self, kind: str, t: int):
        start = self.timeline.now() if self.timeline is not None else None
        cpu = time.thread_time()
        yield
        if self.timeline is not None:
            # cpu_s: this thread's CPU seconds inside the span, the work itself: ranks that share cores are
            # descheduled mid-span, which the wall-clock span counts and cpu_s does not
            self.timeline.add(kind, start, self.timeline.now(), ring_step=t, cpu_s=time.thread_time() - cpu)


TRACE = RingTrace()


def ring_span(kind: str, t: int):
    """`with ring_span("compute", t):` times its body as ring step t's `kind` on TRACE's timeline, if any."""
    return TRACE.span(kind, t)


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
