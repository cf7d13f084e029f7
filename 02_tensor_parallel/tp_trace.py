"""The timeline of tensor parallelism's communication: timing only (no number changes), handed in by the caller.

The operators hold the math; whoever draws their communication hands them a `span`, a function(kind, **labels)
that returns a context manager around one part:

    tp_overlap.py     each part of a ring step: "post" (the next hop handed to the backend), "compute" (the
                      chunk's matmuls), "wait" (the hop the compute did not cover: exposed communication),
                      labelled ring_step=t
    tp_operators.py   each blocking all-gather and reduce-scatter: "collective" (the whole collective is
                      exposed, nothing runs beside it)

`untimed` (the default everywhere) times nothing; `TPSpans(timeline)` records each part on a
common/timeline.Timeline. parallelize_model(..., span=) hands one to every TP layer (overlap_tp.py does, for a
few steps, and sums the exposed kinds per step).
"""
import time
from contextlib import contextmanager, nullcontext

EXPOSED = ("post", "wait", "collective")        # the kinds in which a rank computes nothing


def untimed(kind: str, **labels):
    """The operators' `span` when nobody draws them: `with span("collective"):` times nothing. A plain
    nullcontext: the compiler traces through it."""
    return nullcontext()


class TPSpans:
    """A `span` for the TP operators: `with spans("wait", ring_step=t):` records its body as a span of that
    kind on `timeline`, with its labels, the wall-clock span and this thread's CPU seconds inside it."""

    def __init__(self, timeline):
        self.timeline = timeline

    @contextmanager
    def __call__(self, kind: str, **labels):
        start, cpu = self.timeline.now(), time.thread_time()
        yield
        # cpu_s: this thread's CPU seconds inside the span: ranks that share cores are descheduled mid-span,
        # which the wall-clock span counts and cpu_s does not
        self.timeline.add(kind, start, self.timeline.now(), cpu_s=time.thread_time() - cpu, **labels)
