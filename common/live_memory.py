"""Measuring all the memory a CPU rank's tensors hold at once: the counter a GPU's allocator has built in.

On a GPU, `torch.cuda.max_memory_allocated` is the peak of everything (weights, gradients, optimizer state,
activations, and the working set around them: logits, their gradient, recomputed blocks, communication
buffers). A CPU has no such counter, so this file keeps one:

  - `LiveTensors`, a dispatch mode: every tensor an operation returns passes through it; it notes the
    storage behind it (once, however many views share it) and a finaliser that subtracts its bytes when
    the storage is freed (a tensor that wraps others, a DTensor, by the local shard it wraps: its own
    storage is a shape). What existed before (the trainer's weights, gradients, AdamW state, buffers)
    is counted at the start, found by walking what the trainer holds. A storage resized in place (ZeRO-2
    and 3 empty their full buffers between steps and fill them again, as FSDP does) counts at the size
    it had when an operation last returned it, and every storage is read again after each verb.
  - `LivePeak`, a trainer (common/step_protocol.py) whose verbs run inside that mode; `memory()` adds
    `live_peak_bytes`, the most bytes live at once since the last call (one step's peak), then resets it.

What it does not see: tensors made on other threads (chapter 05's --pair-overlap), the allocator's own
slack, and memory outside tensors. It slows a step (every operation passes through Python), so scripts
use it only when asked (`--measure-memory`).
"""
import types
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


class LiveTensors(TorchDispatchMode):
    """Bytes of the distinct storages alive now (`live`) and the most at once since `reset` (`peak`)."""

    def __init__(self, resident=()):
        super().__init__()
        self.bytes: dict[int, int] = {}          # id of a live storage → its bytes when last seen
        self.storages: dict[int, weakref.ref] = {}
        self.live = self.peak = 0
        for t in resident:
            self.note(t)

    def note(self, t: torch.Tensor) -> None:
        for plain in plain_tensors(t):            # a DTensor: its local shard (its own storage is a shape)
            storage = plain.untyped_storage()
            key = id(storage)
            if key not in self.bytes:
                self.bytes[key], self.storages[key] = 0, weakref.ref(storage)
                weakref.finalize(storage, self.freed, key)
            self.resized(key, storage.nbytes())

    def resized(self, key: int, nbytes: int) -> None:
        """A storage seen again at `nbytes` (ZeRO's flat buffers grow and shrink in place, FSDP's way)."""
        self.live += nbytes - self.bytes[key]
        self.bytes[key] = nbytes
        self.peak = max(self.peak, self.live)

    def resync(self) -> None:
        """Every live storage's bytes read again: what was resized in place since an operation last
        returned it (a buffer emptied between steps) counts as it is now."""
        for key, ref in list(self.storages.items()):
            storage = ref()
            if storage is not None:
                self.resized(key, storage.nbytes())

    def freed(self, key: int) -> None:
        self.live -= self.bytes.pop(key)
        del self.storages[key]

    def reset(self) -> int:
        """The peak since the last reset; from now on the peak starts at what is live."""
        peak, self.peak = self.peak, self.live
        return peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.note(t)
        return out


def plain_tensors(tree) -> list[torch.Tensor]:
    """The plain tensors in `tree` (a tensor, or containers of them); a tensor that wraps others (a DTensor
    wraps its local shard) stands for those it wraps: its own storage is a shape, not memory."""
    out = []
    for t in tree_flatten(tree)[0]:
        if is_traceable_wrapper_subclass(t):
            out += plain_tensors([getattr(t, name) for name in t.__tensor_flatten__()[0]])
        elif isinstance(t, torch.Tensor):
            out.append(t)
    return out


def held_tensors(root) -> list[torch.Tensor]:
    """Every tensor `root` holds, through its attributes, containers, modules and optimizers (not through
    Python modules, classes or functions: what a trainer holds, not the whole program)."""
    found, seen, todo = [], set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType, types.MethodType,
                                               str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            if obj.grad is not None:
                todo.append(obj.grad)
            continue
        if isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__"):
            todo.extend(vars(obj).values())
    return found


class LivePeak:
    """A trainer measured whole: each verb runs inside one `LiveTensors`, which starts with every tensor
    the trainer holds; `memory()` adds `live_peak_bytes` (this step's peak, everything included)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.meter = LiveTensors(held_tensors(trainer))

    def __getattr__(self, name):                 # attributes: the trainer's
        return getattr(self.trainer, name)

    def _measured(verb):
        def run(self, *args, **kwargs):
            with self.meter:
                for t in tree_flatten((args, kwargs))[0]:       # the batch, made before the step
                    if isinstance(t, torch.Tensor):
                        self.meter.note(t)
                out = getattr(self.trainer, verb)(*args, **kwargs)
            self.meter.resync()
            return out
        run.__name__ = verb
        return run

    forward_backward = _measured("forward_backward")
    sync_gradients = _measured("sync_gradients")
    clip_grad_norm = _measured("clip_grad_norm")
    step = _measured("step")
    zero_grad = _measured("zero_grad")
    del _measured

    def memory(self) -> dict:
        return {**self.trainer.memory(), "live_peak_bytes": self.meter.reset()}
