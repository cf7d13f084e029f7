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
"""
from typing import Protocol

import torch

from .optim import set_lr, zero_grads


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


class OptimizerVerbs:
    """`step`, `zero_grad` and `set_lr` for a trainer whose `self.optimizer` is one plain torch
    optimizer over every tensor this rank updates (the replicas of chapter 01, TP, the pipeline).
    Gradients are zeroed in place, not set to None: the flat buffers and hooks that hold them stay."""

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        zero_grads(self.optimizer)

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
