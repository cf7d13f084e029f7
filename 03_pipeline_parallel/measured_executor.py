"""The executor and what the chapter measures about it, side by side: a thin wrapper.

`PipelineExecutor` (pipeline_executor.py) is the algorithm and measures nothing. `MeasuredExecutor`
runs it unchanged and records, around the same four methods (receive, compute, send, wait_sends):

  - a timeline (common/timeline.py) of each rank's step: an F, B or W span per action (compute
    only), a "recv" span for the time an action waited for its message, a "send" span for posting
    each isend and one for the wait, at the end of the step, until every send is done. The
    measured bubble is computed from these spans (pipeline_trainer.step_stats), and
    plot_timeline.py draws them;
  - the activation bytes alive (`ActivationLedger`): every tensor autograd saves for the backward
    during an F, counted once per storage, parameters left out, held until the micro-batch's last
    backward action on that stage frees it. With zero bubble, B frees the graph but leaves each
    linear layer's (x, dy) for W: from B to W those are what the micro-batch holds.
    `peak_activation_bytes`: the most bytes alive at once during the last step.
"""
import torch

from . import pipeline_executor


class ActivationLedger:
    """Bytes autograd keeps for each (micro-batch, stage) in flight on this rank, and their peak sum."""

    def __init__(self, param_storages: set[int]):
        self.param_storages = param_storages     # where the parameters live: saved, but not activations
        self.held: dict[tuple[int, int], int] = {}
        self.live = self.peak = 0

    def hold(self, key: tuple[int, int], tensors) -> None:
        """From now on `key` holds `tensors` (instead of what it held before)."""
        nbytes = self.storage_bytes(tensors)
        self.live += nbytes - self.held.get(key, 0)
        self.held[key] = nbytes
        self.peak = max(self.peak, self.live)

    def free(self, key: tuple[int, int]) -> None:
        self.live -= self.held.pop(key)

    def storage_bytes(self, tensors) -> int:
        """Bytes of the distinct storages among `tensors`, parameters left out."""
        seen, total = set(self.param_storages), 0
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
        return total


class MeasuredExecutor(pipeline_executor.PipelineExecutor):
    """A PipelineExecutor whose steps leave their spans in `timeline` and their activation peak in
    `peak_activation_bytes` (None before the first step). Arguments: PipelineExecutor's, and the
    rank's common.timeline.Timeline."""

    def __init__(self, *args, timeline, **kwargs):
        super().__init__(*args, **kwargs)
        self.timeline = timeline
        # noted once, here: ZeRO (chapter 04) moves the parameters into flat buffers before this
        self.param_storages = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        self.peak_activation_bytes = None

    def run(self, schedule, tokens: list, targets: list, on_stage_grads_ready=None) -> torch.Tensor:
        self.ledger = ActivationLedger(self.param_storages)
        loss = super().run(schedule, tokens, targets, on_stage_grads_ready)
        self.peak_activation_bytes = self.ledger.peak
        return loss

    def receive(self, a):
        start = self.timeline.now()
        received = super().receive(a)
        need = pipeline_executor.needed_message(a, self.n, self.p)
        if need is not None and need[1] != self.me:                  # waited for another rank
            self.timeline.add("recv", start, self.timeline.now(), mb=a.mb, stage=a.stage)
        return received

    def compute(self, a, received, tokens: list, targets: list):
        saved = []                    # F: every tensor autograd keeps for the backward
        start = self.timeline.now()
        if a.kind == "F":
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                outgoing = super().compute(a, received, tokens, targets)
        else:
            outgoing = super().compute(a, received, tokens, targets)
        self.timeline.add(a.kind, start, self.timeline.now(), mb=a.mb, stage=a.stage)   # compute only
        self._count_activations(a, saved)
        return outgoing

    def _count_activations(self, a, saved: list) -> None:
        key = (a.mb, a.stage)
        if a.kind == "F":
            self.ledger.hold(key, saved)
        elif key not in self.in_flight:                               # its last backward action
            self.ledger.free(key)
        elif self.in_flight[key].pending is not None:                 # zero bubble's B: (x, dy) until W
            self.ledger.hold(key, [t for _, x, dy in self.in_flight[key].pending for t in (x, dy)])

    def send(self, key, dst: int, tensor) -> None:
        start = self.timeline.now()
        super().send(key, dst, tensor)
        if dst != self.me:                                            # posting the isend: a span of its own
            self.timeline.add("send", start, self.timeline.now(), mb=key[1], stage=key[2], what=key[0])

    def wait_sends(self) -> None:
        start = self.timeline.now()
        super().wait_sends()
        self.timeline.add("send", start, self.timeline.now(), wait="all")   # blocked until every send is done
