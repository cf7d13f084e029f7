"""The timeline of tensor parallelism's communication: off by default, timing only (no number changes).

    ring_span(kind, t)   around each part of a ring step of tp_overlap.py: "post" (the next hop handed to
                         the backend), "compute" (the chunk's matmuls), "wait" (the hop the compute did not
                         cover: exposed communication)
    collective_span()    around each blocking all-gather and reduce-scatter of tp_operators.py: the whole
                         collective is exposed, nothing runs beside it

overlap_tp.py gives TRACE a common/timeline.Timeline for a few steps and sums the exposed kinds per step.
"""
import time
from contextlib import contextmanager, nullcontext

EXPOSED = ("post", "wait", "collective")        # the kinds in which a rank computes nothing


class TPTrace:
    def __init__(self):
        self.timeline = None

    @contextmanager
    def span(self, kind: str, **labels):
        start, cpu = self.timeline.now(), time.thread_time()
        yield
        # cpu_s: this thread's CPU seconds inside the span: ranks that share cores are descheduled mid-span,
        # which the wall-clock span counts and cpu_s does not
        self.timeline.add(kind, start, self.timeline.now(), cpu_s=time.thread_time() - cpu, **labels)


TRACE = TPTrace()


def ring_span(kind: str, t: int):
    """`with ring_span("compute", t):` times its body as ring step t's `kind`, if TRACE has a timeline."""
    return TRACE.span(kind, ring_step=t) if TRACE.timeline is not None else nullcontext()


def collective_span():
    """Around a blocking collective; a plain nullcontext when off (the compiler traces through it)."""
    return TRACE.span("collective") if TRACE.timeline is not None else nullcontext()
