"""Measuring the activation bytes autograd keeps: what common/activation_ledger.py predicts.

Every tensor autograd saves for the backward passes through a `saved_tensors_hooks` pack hook; the
meter notes its storage (counted once, however many views of it are saved) unless it holds a
parameter (saved too, but not an activation). Two users:

  - `ActivationMeter`: bytes held per (micro-batch, stage) in flight and their peak sum, for a
    pipeline (chapter 03's MeasuredExecutor feeds it action by action);
  - `MeasuredActivations`: a trainer (common/step_protocol.py) whose `forward_backward` runs one
    micro-batch at a time; the peak of a step is its largest micro-batch's saved bytes, reported by
    `memory()` as `peak_activation_bytes` beside the ledger's `activation_bytes_predicted`.
"""
from contextlib import contextmanager

import torch


def parameter_storages(model) -> set[int]:
    """Where the parameters live now (ZeRO may have moved them into flat buffers: ask after it)."""
    return storages(model.parameters())


def storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


class ActivationMeter:
    """Bytes autograd keeps for each (micro-batch, stage) in flight on this rank, and their peak sum."""

    def __init__(self, param_storages: set[int]):
        self.param_storages = param_storages     # parameters and token ids: saved, but not activations
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
        """Bytes of the distinct storages among `tensors`, parameters (and token ids) left out."""
        return sum(distinct_storages(tensors, self.param_storages).values())


def distinct_storages(tensors, leave_out: set[int], found: dict | None = None) -> dict[int, int]:
    """{storage address: bytes} of the storages behind `tensors`, those in `leave_out` left out."""
    found = {} if found is None else found
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in leave_out:
            found.setdefault(ptr, t.untyped_storage().nbytes())
    return found


@contextmanager
def saved_storages(leave_out: set[int]):
    """Inside: every tensor autograd saves adds its storage to the yielded {address: bytes} dict. The
    hook keeps no reference, so backward frees each tensor as it would unmeasured."""
    found: dict[int, int] = {}

    def pack(t):
        distinct_storages((t,), leave_out, found)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield found


class MeasuredActivations:
    """A trainer of one micro-batch at a time (forward then backward), measured: every verb is the
    wrapped trainer's; `forward_backward` also counts the bytes the forward saves, and `memory()` adds
    the step's peak (`peak_activation_bytes`, then reset) and the ledger's prediction. `measure=False`:
    a trainer whose tensors are not plain storages (PyTorch's DTensor, FSDP2) reports null for both."""

    def __init__(self, trainer, model, predicted: int | None, measure: bool = True):
        self.trainer, self.measure = trainer, measure
        self.predicted = predicted if measure else None
        self.param_storages = parameter_storages(model) if measure else set()   # (a DTensor has no plain storage)
        self.peak = None

    def __getattr__(self, name):                 # every other verb and attribute: the trainer's
        return getattr(self.trainer, name)

    def forward_backward(self, x, y, sync: bool = True):
        if not self.measure:
            return self.trainer.forward_backward(x, y, sync)
        with saved_storages(self.param_storages | storages((x, y))) as found:
            loss = self.trainer.forward_backward(x, y, sync)
        self.peak = max(self.peak or 0, sum(found.values()))
        return loss

    def memory(self) -> dict:
        peak, self.peak = self.peak, None
        return {**self.trainer.memory(), "peak_activation_bytes": peak, "activation_bytes_predicted": self.predicted}
