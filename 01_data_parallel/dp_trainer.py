"""The trainers of chapter 01 behind the step protocol (common/step_protocol.py).

`train_dp.py` and `train_zero.py` drive every way of training through the same verbs, so their loop
never branches on the implementation. This file holds what those trainers share, and the two
trainers of plain data parallelism:

- `forward_backward_rows`: forward and backward of this rank's rows, the loss divided by the
  *global* token count so that the ranks' gradients add up. Every trainer of the chapter calls it,
  ours and PyTorch's (torch_dp.py, zero_torch.py).
- `ForwardBackward`: the `forward_backward` verb of our trainers (here and ZeRO's, zero_sharding.py
  and zero_stage3.py): a trainer says how the model runs (`forward`) and, if its backward
  communicates, what holds that back while more micro-batches follow (`no_sync`); the optimizer's
  verbs are its optimizer object's, passed in (common/step_protocol.py).
- `Replicas`: every rank holds the whole model and gradient, and steps a replicated AdamW
  (replicated_adamw.py); `NaiveDP` and `BucketedDP` add the gradient sync of data_parallel.py, the one
  thing in which they differ.
"""
from contextlib import nullcontext

import torch
import torch.nn as nn

from common import comm
from common.model import loss_sum
from common.step_protocol import OptimizerVerbs

from .data_parallel import BucketedDataParallel, allreduce_gradients, broadcast_parameters


def forward_backward_rows(forward, x: torch.Tensor, y: torch.Tensor, tokens_per_step: int,
                          bf16: bool = False) -> torch.Tensor:
    """x, y: (B/N/micro-batches, S), this rank's rows of one micro-batch. Runs `forward` (tokens ->
    logits) and the backward of the rows' share of the step's mean loss; returns that share, detached."""
    with torch.autocast(x.device.type, torch.bfloat16, enabled=bf16):
        loss = loss_sum(forward(x), y) / tokens_per_step      # this micro-batch's share of the mean
        loss.backward()
    return loss.detach()


def counted_comm_bytes() -> dict:
    """This step's bytes on the wire as common/comm.py counted them: sent + received, and sent."""
    return {"comm_bytes": comm.COUNTER.total(), "comm_bytes_sent": sum(comm.COUNTER.sent.values())}


class ForwardBackward(OptimizerVerbs):
    """`forward_backward` for our trainers, which run the whole model on this rank's rows; `step`,
    `zero_grad`, `set_lr`, the clipping and the bytes are `optimizer`'s (replicated AdamW or ZeRO)."""

    def __init__(self, optimizer, tokens_per_step: int, bf16: bool = False):
        self.optimizer, self.tokens_per_step, self.bf16 = optimizer, tokens_per_step, bf16

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, sync: bool = True) -> torch.Tensor:
        with nullcontext() if sync else self.no_sync():
            return forward_backward_rows(self.forward, x, y, self.tokens_per_step, self.bf16)

    def no_sync(self):
        """Gradient accumulation: a context in which backward only adds into .grad (default: nothing to
        hold back, because this trainer's backward communicates nothing, or must: ZeRO 2 and 3)."""
        return nullcontext()

    def comm_bytes(self) -> dict:
        return counted_comm_bytes()

    def clip_grad_norm(self, max_norm: float) -> float:
        # a replica holds the full gradient: its norm is already global; ZeRO sums its shards' over DP
        return self.optimizer.clip_grad_norm(max_norm)

    def memory(self) -> dict:
        return self.optimizer.memory()

    def load_optim_state(self, states: dict) -> None:
        self.optimizer.load_optim_state(states)


class Replicas(ForwardBackward):
    """Every rank holds the whole model, the whole gradient and the whole AdamW (`optimizer`, a
    replicated_adamw.ReplicatedAdamW over the model's parameters): M(1+1+α) bytes. Everything but the
    gradient sync, which is what NaiveDP and BucketedDP do differently. `module` is what forward runs:
    the model, or a wrapper around it that hooks its gradients."""

    def __init__(self, model: nn.Module, module: nn.Module, optimizer, tokens_per_step: int, bf16: bool = False):
        super().__init__(optimizer, tokens_per_step, bf16)
        self.model, self.module = model, module

    def forward(self, x):
        return self.module(x)                                            # (B, S) -> (B, S, V)

    def full_state(self):
        """(model state, AdamW state by name): every replica holds it whole."""
        return self.model.state_dict(), self.optimizer.optim_state()


class NaiveDP(Replicas):
    """`--impl naive`: backward runs undisturbed, then every gradient is all-reduced, one by one."""

    def __init__(self, model, group, optimizer, tokens_per_step: int, bf16: bool = False):
        broadcast_parameters(model, group)
        super().__init__(model, model, optimizer, tokens_per_step, bf16)
        self.group = group

    def sync_gradients(self) -> None:
        allreduce_gradients(self.model, self.group)     # after backward, one collective per tensor


class BucketedDP(Replicas):
    """`--impl bucketed`: the all-reduce of each bucket starts during backward (BucketedDataParallel)."""

    def __init__(self, model, group, optimizer, tokens_per_step: int, bf16: bool = False, bucket_mb: float = 25.0):
        super().__init__(model, BucketedDataParallel(model, group, bucket_mb), optimizer, tokens_per_step, bf16)

    def no_sync(self):
        return self.module.no_sync()              # only the last micro-batch's backward sends buckets

    def sync_gradients(self) -> None:
        self.module.sync_gradients()              # wait for the buckets' all-reduces, started in backward

