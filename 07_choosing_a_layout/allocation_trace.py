"""A step's allocations and frees, in the order its operators make them: what a caching allocator is asked.

    with AllocationTrace() as trace:          # any tensors: real ones, or FakeTensorMode's (shapes, no data)
        ...one training step...
    trace.events                              # [Event("alloc" | "free", key, nbytes, stream), ...]

common/live_memory.py's meter (LiveTensors) counts the bytes live at once; this is the same meter writing
down each change: an operator's output on a new storage is an allocation of its bytes, the storage's end
(its last tensor gone) its free. Two things more than the meter:
  - a storage first seen as an operator's *input* existed before the trace (a weight, a buffer): neither it
    nor a view of it is an allocation of the step (but for the tensor torch.tensor(data) has just made);
  - a storage resized in place is a free and an allocation (FSDP2 frees a block's gathered weights by
    resizing their storage to 0 bytes and allocates them again by resizing it back, outside the operators
    a dispatch mode sees): every storage is read again at each of FSDP2's own operators (torch.ops.fsdp:
    the copies into and out of its gathers and its reductions), the next thing it does after a resize,
    and at the trace's end. (A reduction's input buffer, made just before its copy-in, then comes before
    the weights the same backward freed; reading the storages found resized again before every operator,
    tried, left the published run's peak and reserve as they are);
and each allocation is tagged with the stream current when it is made: torch.cpu's streams are
placeholders that device-agnostic code such as FSDP2 switches between exactly as it switches CUDA streams
(it gathers on its all-gather streams, reduces on its reduce-scatter stream), and a caching allocator keeps
each stream's blocks apart (caching_allocator.py).

Run on FakeTensorMode's tensors, a step of a model that no machine here could hold is traced in seconds:
the operators compute only shapes (torchtitan_step.fake_trace).
"""
import weakref
from typing import NamedTuple

import torch

from common.live_memory import LiveTensors, plain_tensors


# operators whose input is a tensor just made from Python data (torch.tensor(...)), not one from before
FRESH = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


class Event(NamedTuple):
    kind: str                   # "alloc" or "free"
    key: int                    # the allocation's number in the trace (its free has the same)
    nbytes: int
    stream: str                 # "compute" (the default stream) or "stream n" (the n-th other)


class AllocationTrace(LiveTensors):
    def __init__(self, resident=()):
        self.events: list[Event] = []
        self._allocation: dict[int, tuple[int, str]] = {}   # a live storage -> (its allocation's key, stream)
        self._before: dict[int, weakref.ref] = {}            # storages that existed before the trace
        self._streams = {id(torch.cpu.current_stream()): "compute"}
        self._made = 0                                       # allocations so far
        super().__init__(resident)

    def __exit__(self, *exc):
        self.resync()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fsdp":        # FSDP2's own operators: where its buffers have changed size
            self.resync()
        for t in plain_tensors((args, kwargs)) if func not in FRESH else ():
            storage = t.untyped_storage()
            if id(storage) not in self.bytes and not self._existed(storage):
                self._before[id(storage)] = weakref.ref(storage)
        out = func(*args, **(kwargs or {}))
        for t in plain_tensors(out):
            if not self._existed(t.untyped_storage()):
                self.note(t)
        return out

    def _existed(self, storage) -> bool:
        ref = self._before.get(id(storage))
        return ref is not None and ref() is storage

    def resized(self, key: int, nbytes: int) -> None:
        old = self.bytes[key]
        super().resized(key, nbytes)
        if nbytes != old:
            self._end(key, old)
            if nbytes:
                stream = self._streams.setdefault(id(torch.cpu.current_stream()), f"stream {len(self._streams)}")
                self._allocation[key] = (self._made, stream)
                self.events.append(Event("alloc", self._made, nbytes, stream))
                self._made += 1

    def freed(self, key: int) -> None:
        self._end(key, self.bytes[key])
        super().freed(key)

    def _end(self, key: int, nbytes: int) -> None:
        if nbytes:
            ident, stream = self._allocation.pop(key)
            self.events.append(Event("free", ident, nbytes, stream))


def live_peak(events) -> int:
    """The most bytes live at once along `events`: what the tensors alone need."""
    live = peak = 0
    for e in events:
        live += e.nbytes if e.kind == "alloc" else -e.nbytes
        peak = max(peak, live)
    return peak
