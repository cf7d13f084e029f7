"""Collectives that count their bytes: the project's communication accounting.

Every collective a chapter runs goes through these wrappers, which add to a per-group counter the
bytes this rank sends and receives *under the standard ring algorithms*, for a tensor of n bytes in
a group of N ranks:

    all-reduce      sends 2(N-1)/N·n and receives 2(N-1)/N·n   (reduce-scatter, then all-gather)
    all-gather      sends (N-1)/N·n, receives (N-1)/N·n        (n = the gathered output)
    reduce-scatter  sends (N-1)/N·n, receives (N-1)/N·n        (n = the full input)
    broadcast       the root sends n, every other rank receives n
    send / recv     exactly the tensor's bytes (also each message of a ring's `exchange`)
    all-to-all      exactly the bytes that leave (and arrive at) this rank: (N-1)/N·n in equal pieces

These are the volumes the textbook formulas talk about; the backend may move bytes differently
(NCCL picks trees or rings, gloo has its own algorithms), so this counts the algorithmic volume, not
what a packet sniffer would see. The scalar bookkeeping (the loss and gradient norm for printing,
a few bytes per step) is not counted.
"""
import threading
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist

from common.compile import eager


class CommCounter:
    """Bytes sent + received, per named group, since the last `reset()`."""

    def __init__(self):
        self.sent = defaultdict(int)
        self.received = defaultdict(int)
        self.lock = threading.Lock()       # two threads of one rank may count at once (chapter 05's pairs)
        self.calls = None                  # a list inside `logging_calls()`

    def add(self, name: str, sent: float, received: float, call: tuple = (None, None)):
        """`call`: (the collective, the shape of its tensor), logged inside `logging_calls()`."""
        with self.lock:
            self.sent[name] += int(sent)
            self.received[name] += int(received)
            if self.calls is not None:
                self.calls.append((*call, name, int(sent) + int(received)))

    @contextmanager
    def logging_calls(self):
        """`with COUNTER.logging_calls() as calls:` each collective inside appends (collective, tensor shape,
        group name, bytes sent + received) to `calls`: a call-by-call account (chapter 02's bench_tp.py)."""
        self.calls = []
        try:
            yield self.calls
        finally:
            self.calls = None

    def reset(self):
        self.sent.clear()
        self.received.clear()

    def total(self, name: str | None = None) -> int:
        names = [name] if name else set(self.sent) | set(self.received)
        return sum(self.sent[n] + self.received[n] for n in names)

    def by_group(self) -> dict:
        return {n: self.sent[n] + self.received[n] for n in sorted(set(self.sent) | set(self.received))}


COUNTER = CommCounter()

# Every collective below runs as written, never traced by `--compile` (common/compile.py's `eager`): the
# compiler cuts a block's graph at the call, compiles the pieces on each side, and runs the call itself
# eagerly, counter and all. A chapter's autograd Function that calls one (TP's f and g, the ring's exchange)
# then runs eagerly as a whole, between two compiled pieces.


# Twin communicators. A rank that runs two pieces of work at once on two threads (chapter 05 runs DualPipeV's
# pair, one micro-batch's forward beside another's backward) must not let both talk on one process group: the
# peers would see the two threads' collectives in whichever order the threads happened to reach them. So the
# second thread talks on a twin of each group (the same ranks, its own communicator): inside
# `with on_twins({group: twin})` every collective below that names `group` runs on `twin`, in this thread only.
_THREAD = threading.local()


@contextmanager
def on_twins(twins: dict):
    _THREAD.twins = twins
    try:
        yield
    finally:
        _THREAD.twins = {}


def _on(group):
    """The group a collective of this thread runs on: its twin inside `on_twins`, else itself."""
    return getattr(_THREAD, "twins", {}).get(group, group)


# Where a run draws its all-to-alls on a timeline (chapter 05), it hands `time_all_to_alls` a span: a
# function(name) that returns a context manager timing one exchange, entered in the thread that runs it.
_all_to_all_span = None


def time_all_to_alls(span) -> None:
    """From now on, every all_to_all_single of this process runs inside `span(name)` (None: untimed)."""
    global _all_to_all_span
    _all_to_all_span = span


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# What one rank sends (and receives) in one ring collective on n bytes over N ranks: the table above.
RING_SHARE = {"all_reduce": lambda N: 2 * (N - 1) / N, "all_gather": lambda N: (N - 1) / N,
              "reduce_scatter": lambda N: (N - 1) / N,
              "all_to_all": lambda N: (N - 1) / N}      # equal pieces: all but my own leave (all_to_all_single)


def collective_bytes(kind: str, n: int, N: int) -> int:
    """Bytes sent + received by one rank in one `kind` collective on n bytes over N ranks, exactly as
    the counter adds them (each direction rounded down): what a planner predicts a step's
    comm_bytes_* from (07_choosing_a_layout/choose_layout.py)."""
    return 2 * int(RING_SHARE[kind](N) * n)


@eager
def all_reduce(t, group=None, name="dp", async_op=False, op=dist.ReduceOp.SUM):
    n, N = _nbytes(t), dist.get_world_size(group)
    COUNTER.add(name, RING_SHARE["all_reduce"](N) * n, RING_SHARE["all_reduce"](N) * n, ("all_reduce", t.shape))
    if N == 1:
        return None
    return dist.all_reduce(t, op=op, group=_on(group), async_op=async_op)


@eager
def all_gather_into(output, shard, group=None, name="dp", async_op=False):
    """Gather every rank's `shard` (equal sizes) into `output` = concatenation along dim 0."""
    n, N = _nbytes(output), dist.get_world_size(group)
    COUNTER.add(name, RING_SHARE["all_gather"](N) * n, RING_SHARE["all_gather"](N) * n,
                ("all_gather_into", output.shape))
    if N == 1:
        output.copy_(shard.reshape(output.shape))
        return None
    return dist.all_gather_single(output, shard, group=_on(group), async_op=async_op)


@eager
def reduce_scatter_into(output, full, group=None, name="dp", async_op=False, op=dist.ReduceOp.SUM):
    """Sum `full` over the group; rank i keeps the i-th equal chunk (along dim 0) in `output`."""
    n, N = _nbytes(full), dist.get_world_size(group)
    COUNTER.add(name, RING_SHARE["reduce_scatter"](N) * n, RING_SHARE["reduce_scatter"](N) * n,
                ("reduce_scatter_into", full.shape))
    if N == 1:
        output.copy_(full.reshape(output.shape))
        return None
    return dist.reduce_scatter_single(output, full, op=op, group=_on(group), async_op=async_op)


@eager
def broadcast(t, src: int, group=None, name="dp"):
    """`src` is a global rank, as in torch.distributed."""
    N = dist.get_world_size(group)
    if N == 1:
        return
    me = dist.get_rank()
    COUNTER.add(name, _nbytes(t) if me == src else 0, 0 if me == src else _nbytes(t), ("broadcast", t.shape))
    dist.broadcast(t, src=src, group=_on(group))


@eager
def send(t, dst: int, group=None, name="pp"):
    COUNTER.add(name, _nbytes(t), 0, ("send", t.shape))
    return dist.isend(t.contiguous(), dst=dst, group=_on(group))


@eager
def recv(t, src: int, group=None, name="pp"):
    COUNTER.add(name, 0, _nbytes(t), ("recv", t.shape))
    return dist.irecv(t, src=src, group=_on(group))


@eager
def exchange(pairs: list, dst: int, src: int, group=None, name="pp") -> list:
    """One hop of a ring: each (outgoing, incoming) pair sends `outgoing` to global rank `dst` and receives
    `incoming` from global rank `src`. All are posted together as one batch and the works returned: wait on
    them before reading an incoming tensor or writing an outgoing one. Message i carries tag i, so several
    messages in flight between the same two ranks never mix (every rank posts the same list). One batch,
    not separate isend/irecv calls, because NCCL runs a rank's sends and receives to one peer in order: in
    a ring of two, each rank would wait in its send for a neighbour waiting in its own."""
    ops = []
    for tag, (outgoing, incoming) in enumerate(pairs):
        COUNTER.add(name, _nbytes(outgoing), _nbytes(incoming), ("exchange", outgoing.shape))
        ops += [dist.P2POp(dist.isend, outgoing.contiguous(), dst, _on(group), tag),
                dist.P2POp(dist.irecv, incoming, src, _on(group), tag)]
    return dist.batch_isend_irecv(ops) if ops else []


@eager
def all_to_all_single(output, inp, output_splits, input_splits, group=None, name="ep"):
    """Rows of `inp` go to ranks by `input_splits`; rows arrive by `output_splits`."""
    me = dist.get_rank(group)
    row_in = _nbytes(inp) // max(1, inp.shape[0]) if inp.shape[0] else 0
    row_out = _nbytes(output) // max(1, output.shape[0]) if output.shape[0] else 0
    COUNTER.add(name, row_in * (sum(input_splits) - input_splits[me]),
                row_out * (sum(output_splits) - output_splits[me]), ("all_to_all_single", inp.shape))
    if dist.get_world_size(group) == 1:
        output.copy_(inp)
        return
    if _all_to_all_span is None:
        dist.all_to_all_single(output, inp, output_splits, input_splits, group=_on(group))
        return
    with _all_to_all_span(name):
        dist.all_to_all_single(output, inp, output_splits, input_splits, group=_on(group))
