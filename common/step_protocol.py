"""The step protocol: the few verbs through which every way of training in the course is driven.

Every chapter's `train_*.py` loop is one straight path, the same shape in every chapter:

    for step in ...:
        trainer.set_lr(lr_at(step, ...))
        for xm, ym in micro_batches:                     # (or one call that runs a pipeline schedule)
            local_loss += trainer.forward_backward(xm, ym, sync=last)
        trainer.sync_gradients()                         # the chapter's collective, one call away
        grad_norm = trainer.clip_grad_norm(args.clip)
        trainer.step()
        trainer.zero_grad()
        memory = trainer.memory()

Whatever differs between implementations (ours by hand, or PyTorch's DDP, ZeroRedundancyOptimizer,
FSDP2, DTensor, torch.distributed.pipelining) lives behind these verbs, in the chapter's own files;
PyTorch's comparisons sit in adapters of their own, so the loop never branches on the implementation,
the ZeRO stage or the schedule.

The names, written down once:

- `forward_backward(x, y, sync=True) -> Tensor`: forward and backward of the rows this rank holds
  (one micro-batch, or, for a pipeline, the step's micro-batches through the schedule); the loss is
  summed over tokens and divided by the *global* token count, so gradients add up across ranks.
  Returns this rank's share of the loss, detached. `sync=False` means "more micro-batches follow:
  accumulate, do not communicate yet" (DDP's `no_sync`).
- `sync_gradients()`: finish the gradient collectives of the step (start those not started, wait
  for those in flight). Afterwards every gradient this rank's optimizer reads is complete. Lower-level
  asynchronous pieces (a bucket, a queue of reduce-scatters) call their waiting method `wait()`.
- `clip_grad_norm(max_norm) -> float`: the global gradient norm over every group that holds a
  different part of the model, each replicated gradient counted once (see `counted_here`), then
  scaled down to `max_norm` if larger (0: measure only).
- `step()`, `zero_grad()`, `set_lr(lr)`: the optimizer's verbs.
- `memory() -> dict`: bytes this rank holds, at least `param_bytes`, `grad_bytes`, `optim_bytes`.
- `counted_here(replicas(t), coords) -> bool`: the one predicate for "this rank counts this tensor" in a
  norm or a byte count, so a tensor replicated over several ranks is counted once (defined below).

The optimizer is an object of its own, passed to the trainer, with the same verbs whichever it is
(`Optimizer` below): replicated AdamW (01_data_parallel/replicated_adamw.py; on the grid,
04_3d_combined/replicated_3d.py) or ZeRO of any stage over the groups that sum each gradient
(01_data_parallel/zero_sharding.ZeroOptimizer; on the grid, one per kind, 04_3d_combined/zero_3d.py).
The trainer shows what its own dimension adds to the step (a pipeline's schedule, TP's partial sums, the
router's statistics) and hands the rest to its optimizer: no trainer subclass per optimizer.
"""
from typing import Protocol

import torch


def mark_replicated(t: torch.Tensor, dim: str, copies: int) -> torch.Tensor:
    """Note on tensor `t` that `copies` consecutive ranks along mesh dimension `dim` hold the same values:
    a norm gain on every TP rank (copies = tp), a KV head shared by tp/K ranks (copies = tp/K), a dense
    weight on every EP rank (copies = ep). DTensor would call it a Replicate placement."""
    t.replicated_over = {**replicas(t), dim: copies}
    return t


def replicas(t: torch.Tensor) -> dict[str, int]:
    """{dim: copies} for every mesh dimension over which `t` is replicated ({}: a shard of its own)."""
    return getattr(t, "replicated_over", {})


def counted_here(replicated_over: dict[str, int], coords: dict[str, int]) -> bool:
    """Does this rank count a tensor replicated as `replicated_over` ({dim: copies}) in a sum over the
    ranks (a gradient norm, a loss, a byte total)? Each copy is counted by the first of its holders,
    the rank whose coordinate along `dim` is a multiple of `copies`; a shard by the rank holding it.
    Only the dimensions the sum runs over matter (a norm is never summed over DP: its replicas agree)."""
    return all(coords[dim] % copies == 0 for dim, copies in replicated_over.items())


class Trainer(Protocol):
    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, sync: bool = True) -> torch.Tensor: ...

    def sync_gradients(self) -> None: ...

    def clip_grad_norm(self, max_norm: float) -> float: ...

    def step(self) -> None: ...

    def zero_grad(self) -> None: ...

    def set_lr(self, lr: float) -> None: ...

    def memory(self) -> dict: ...


class Optimizer(Protocol):
    """The optimizer a trainer is given. `begin_step` before the step's first forward; `grads_ready(params)`
    when those gradients are final for the step (a pipeline stage's: a replicated optimizer starts their
    all-reduce, ZeRO waits for the end); `sync_gradients(partial_sums)` sums every gradient over its
    replicas, running `partial_sums()` (the trainer's sums inside the piece, TP's) where the whole gradient
    is here; `clip_grad_norm(max_norm, groups)`: the norm summed over `groups`, the ranks holding
    different parts; then the update's verbs, the bytes held (`memory`, `formula`), the checkpoint's
    moments by name, and `gather`/`release` of the weights outside a step (ZeRO-3)."""

    def begin_step(self) -> None: ...

    def grads_ready(self, params) -> None: ...

    def sync_gradients(self, partial_sums=None) -> None: ...

    def clip_grad_norm(self, max_norm: float, groups=()) -> float: ...

    def step(self) -> None: ...

    def zero_grad(self) -> None: ...

    def set_lr(self, lr: float) -> None: ...

    def memory(self) -> dict: ...


class OptimizerVerbs:
    """`step`, `zero_grad` and `set_lr` for a trainer: its optimizer's (`self.optimizer`, an `Optimizer`
    it was given), unchanged. A trainer adds to them only what its own dimension needs (chapter 05: the
    router's statistics before the step)."""

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def set_lr(self, lr: float) -> None:
        self.optimizer.set_lr(lr)
