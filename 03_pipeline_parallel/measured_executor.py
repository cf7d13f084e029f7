"""The executor and what the chapter measures about it, side by side: a thin wrapper.

`PipelineExecutor` (pipeline_executor.py) is the algorithm and measures nothing. `MeasuredExecutor`
runs it unchanged and records, around the same four methods (receive, compute, send, wait_sends):

  - a timeline (common/timeline.py) of each rank's step: an F, B, W or BW span per action (compute
    only), a "recv" span for the time an action waited for its message, a "send" span for posting
    each isend and one for the wait, at the end of the step, until every send is done. The
    measured bubble is computed from these spans (pipeline_trainer.step_stats), and
    plot_timeline.py draws them;
  - the activation bytes alive (common/activation_meter.py's `ActivationMeter`): every tensor
    autograd saves for the backward during an F, counted once per storage, parameters and the
    step's token ids left out, held until the micro-batch's last
    backward action on that stage frees it. With zero bubble, B frees the graph but leaves each
    linear layer's (x, dy) for W: from B to W those are what the micro-batch holds.
    `peak_activation_bytes`: the most bytes alive at once during the last step.

Both are on by default. The meter is the dearer of the two (a Python call for every tensor autograd
saves, and a storage look-up for each at the end of every F); `meter_activations=False`
(`--no-activation-meter`, a flag of every script) leaves it out, and the peak is then None (not measured).
breakdown_pp.py measures what each costs per step.
"""
import threading

import torch

from common.activation_meter import ActivationMeter, parameter_storages, storages

from . import pipeline_executor


class MeasuredExecutor(pipeline_executor.PipelineExecutor):
    """A PipelineExecutor whose steps leave their spans in `timeline` and their activation peak in
    `peak_activation_bytes` (None before the first step, or with meter_activations=False). Arguments:
    PipelineExecutor's, the rank's common.timeline.Timeline, and whether to meter the activations."""

    def __init__(self, *args, timeline, meter_activations: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.timeline, self.meter_activations = timeline, meter_activations
        self.peak_activation_bytes = None

    def run(self, schedule, tokens: list, targets: list, on_stage_grads_ready=None) -> torch.Tensor:
        if not self.meter_activations:
            return super().run(schedule, tokens, targets, on_stage_grads_ready)
        # where the parameters live now: ZeRO (chapter 04) moves them into flat buffers, and its stage 3
        # gives those their storage back at every step
        self.meter = ActivationMeter(parameter_storages(self.model) | storages(tokens + targets))
        loss = super().run(schedule, tokens, targets, on_stage_grads_ready)
        self.peak_activation_bytes = self.meter.peak
        return loss

    def receive(self, a):
        start = self.timeline.now()
        received = super().receive(a)
        need = pipeline_executor.needed_message(a, self.n, self.p, self.rank_of)
        if need is not None and need[1] != self.me:                  # waited for another rank
            self.timeline.add("recv", start, self.timeline.now(), mb=a.mb, stage=a.stage)
        return received

    def compute(self, a, received, tokens: list, targets: list):
        saved = []                    # F: every tensor autograd keeps for the backward
        start = self.timeline.now()
        if a.kind == "F" and self.meter_activations:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                outgoing = super().compute(a, received, tokens, targets)
        else:
            outgoing = super().compute(a, received, tokens, targets)
        thread = threading.current_thread().name       # another than the main one: chapter 05's pairs
        self.timeline.add(a.kind, start, self.timeline.now(), mb=a.mb, stage=a.stage,   # compute only
                          **({} if thread == "MainThread" else {"thread": thread}))
        if self.meter_activations:
            self._count_activations(a, saved)
        return outgoing

    def _count_activations(self, a, saved: list) -> None:
        key = (a.mb, a.stage)
        if a.kind == "F":
            self.meter.hold(key, saved)
        elif key not in self.in_flight:                               # its last backward action
            self.meter.free(key)
        elif self.in_flight[key].pending is not None:                 # zero bubble's B: (x, dy) until W
            self.meter.hold(key, [t for _, x, dy in self.in_flight[key].pending for t in (x, dy)])

    def send(self, key, dst: int, tensor) -> None:
        start = self.timeline.now()
        super().send(key, dst, tensor)
        if dst != self.me:                                            # posting the isend: a span of its own
            self.timeline.add("send", start, self.timeline.now(), mb=key[1], stage=key[2], what=key[0])

    def wait_sends(self) -> None:
        start = self.timeline.now()
        super().wait_sends()
        self.timeline.add("send", start, self.timeline.now(), wait="all")   # blocked until every send is done
