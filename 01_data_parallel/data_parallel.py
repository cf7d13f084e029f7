"""Data parallelism by hand: every rank holds the whole model and a slice of the batch.

After backward each rank holds the gradient of *its* slice's share of the loss. Summing those over
the data-parallel group (an all-reduce) gives every rank the gradient of the whole batch, so every
rank takes the same optimizer step and the replicas stay identical.

Two versions of the same idea:
- `allreduce_gradients` (naive): wait until backward is completely finished, then all-reduce every
  gradient, one collective per tensor. Simple, but the network idles during backward and the
  compute idles during communication, and many small messages each pay the latency cost.
- `BucketedDataParallel`: gradient hooks notice each gradient as soon as backward produces it;
  gradients are packed into buckets of ~`bucket_mb` MB, and a full bucket's all-reduce starts
  asynchronously while backward is still computing the earlier layers. Overlap + fewer messages.
  This is what torch.nn.parallel.DistributedDataParallel does (in C++).

The loss is the *sum* over tokens divided by the global token count, so the all-reduce sums
(it does not average) the gradients.

`train_dp.py` drives either through the step protocol (common/step_protocol.py): `NaiveDP` and
`BucketedDP` at the bottom of this file are the small trainers that expose its verbs, and
`ForwardBackward`, the verb every trainer of the chapter shares, is there too (ZeRO's trainers and
PyTorch's adapters, torch_dp.py and zero_torch.py, reuse it).
"""
from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn

from common import comm
from common.model import loss_sum
from common.optim import build_adamw, clip_by_global_norm, optim_bytes
from common.step_protocol import OptimizerVerbs
from common.training import load_optim_state_by_name, optim_state_by_name


def allreduce_gradients(model: nn.Module, group) -> None:
    """Naive DP: one blocking all-reduce per gradient tensor, after backward. Bytes: 2(N-1)/N·M."""
    for p in model.parameters():
        if p.grad is not None:
            comm.all_reduce(p.grad, group=group, name="dp")


def broadcast_parameters(model: nn.Module, group, src: int = 0) -> None:
    """Make every replica start from rank `src`'s weights (they already agree here, as every rank
    builds the model from the same seed, but a real job must not rely on that)."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            comm.broadcast(t.data, src=src, group=group, name="dp")


class _Bucket:
    """Some parameters whose gradients travel together, in one flat buffer and one all-reduce."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)   # (numel,)
        self.ready = 0          # gradients of this bucket produced so far in this backward
        self.work = None        # the in-flight async all-reduce

    def launch(self, group) -> None:
        """Copy the gradients into the buffer and start summing it over `group` in the background."""
        offset = 0
        for p in self.params:
            self.buffer[offset:offset + p.numel()].copy_(p.grad.flatten())
            offset += p.numel()
        self.work = comm.all_reduce(self.buffer, group=group, name="dp", async_op=True)

    def wait(self) -> None:
        """Wait for the sum and copy it back into each .grad."""
        if self.work is not None:                  # None: world size 1, nothing was sent
            self.work.wait()
        offset = 0
        for p in self.params:
            p.grad.copy_(self.buffer[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        self.work = None


class AsyncGradAllReduce:
    """Sum sets of gradients over `group` in the background, for callers that know when a set is final
    (chapter 04: when a pipeline stage has run its last backward of the step).

    launch(params)  copy their gradients into one flat buffer (a bucket), start an async all-reduce, return
    wait()          wait for every launch and copy the sums back into .grad
    Bytes are those of the naive all-reduce (the same tensors, summed once), in fewer messages."""

    def __init__(self, group):
        self.group, self.pending = group, []

    def launch(self, params: list[nn.Parameter]) -> None:
        bucket = _Bucket([p for p in params if p.grad is not None])
        bucket.launch(self.group)
        self.pending.append(bucket)

    def wait(self) -> None:
        for bucket in self.pending:
            bucket.wait()
        self.pending = []


class BucketedDataParallel(nn.Module):
    """Overlap the gradient all-reduce with backward, bucket by bucket."""

    def __init__(self, module: nn.Module, group, bucket_mb: float = 25.0):
        super().__init__()
        self.module, self.group = module, group
        self.sync = True               # False inside no_sync(): accumulate locally, communicate nothing
        self.launch_log: list[tuple[int, int]] = []   # (bucket index, hooks fired so far), for tests
        self._hooks_fired = 0
        broadcast_parameters(module, group)

        # Backward produces gradients roughly in reverse order of the forward, so buckets are filled
        # from the last parameters to the first: the first bucket is ready (and sent) earliest.
        params = [p for p in module.parameters() if p.requires_grad]
        limit = bucket_mb * 1024 * 1024
        self.buckets, current, size = [], [], 0
        for p in reversed(params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= limit:
                self.buckets.append(_Bucket(current))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(current))
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        for p in params:
            # Runs right after p.grad has been accumulated for this backward pass.
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside only add into .grad, no communication."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        self._hooks_fired += 1
        if not self.sync:
            return
        bucket = self.bucket_of[p]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):      # the bucket is full: send it now, asynchronously
            bucket.launch(self.group)
            self.launch_log.append((self.buckets.index(bucket), self._hooks_fired))

    def sync_gradients(self) -> None:
        """Wait for every bucket's all-reduce and copy the summed gradients back into .grad."""
        for bucket in self.buckets:
            if bucket.ready != len(bucket.params):
                # Fewer: a parameter got no gradient (unused in forward): the bucket was never sent and
                # its buffer holds last step's sums. More: backward ran twice outside no_sync(), and
                # the second pass was never sent. Either way the sums would be wrong: refuse, loudly.
                raise RuntimeError(f"bucket {self.buckets.index(bucket)} saw {bucket.ready} gradients for its "
                                   f"{len(bucket.params)} parameters; every parameter must be used in forward, "
                                   "and all but the last micro-batch's backward must run inside no_sync()")
            bucket.wait()
            bucket.ready = 0
        self._hooks_fired = 0


# --- the step protocol ----------------------------------------------------------------------------

class ForwardBackward:
    """`forward_backward`, the verb that every trainer of this chapter shares: the whole model runs on
    this rank's rows. A trainer says how the model runs (`forward`), what keeps a backward from
    communicating while more micro-batches follow (`no_sync`), and how backward starts (`backward`)."""

    def __init__(self, tokens_per_step: int, bf16: bool = False):
        self.tokens_per_step, self.bf16 = tokens_per_step, bf16

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, sync: bool = True) -> torch.Tensor:
        """x, y: (B/N/micro-batches, S), this rank's rows of one micro-batch. Returns its loss, detached."""
        with (nullcontext() if sync else self.no_sync()), \
                torch.autocast(x.device.type, torch.bfloat16, enabled=self.bf16):
            loss = loss_sum(self.forward(x), y) / self.tokens_per_step   # this micro-batch's share of the mean
            self.backward(loss)
        return loss.detach()

    def no_sync(self):
        """Gradient accumulation: a context in which backward only adds into .grad (default: nothing to
        hold back, because this trainer's backward communicates nothing, or must: ZeRO 2 and 3)."""
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def comm_bytes(self) -> dict:
        """This step's bytes on the wire as common/comm.py counted them: sent + received, and sent."""
        return {"comm_bytes": comm.COUNTER.total(), "comm_bytes_sent": sum(comm.COUNTER.sent.values())}


class Replicas(OptimizerVerbs, ForwardBackward):
    """Every rank holds the whole model, the whole gradient and the whole AdamW: M(1+1+α) bytes.
    Everything but the gradient sync, which is what NaiveDP, BucketedDP and DDP do differently.
    `module` is what forward runs: the model, or a wrapper around it that hooks its gradients."""

    def __init__(self, model: nn.Module, module: nn.Module, optimizer, tokens_per_step: int, bf16: bool = False):
        super().__init__(tokens_per_step, bf16)
        self.model, self.module, self.optimizer = model, module, optimizer
        self.named = list(model.named_parameters())

    def forward(self, x):
        return self.module(x)                                            # (B, S) -> (B, S, V)

    def clip_grad_norm(self, max_norm: float) -> float:
        # Every replica now holds the full gradient: its norm is already global, no collective needed.
        return clip_by_global_norm([p.grad for p in self.model.parameters()], max_norm)

    def memory(self) -> dict:
        params = list(self.model.parameters())
        return {"param_bytes": _bytes(params), "grad_bytes": _bytes(p.grad for p in params if p.grad is not None),
                "optim_bytes": optim_bytes(self.optimizer)}

    def full_state(self):
        """(model state, AdamW state by name): every replica holds it whole."""
        return self.model.state_dict(), optim_state_by_name(self.optimizer, self.named)

    def load_optim_state(self, states: dict) -> None:
        load_optim_state_by_name(self.optimizer, self.named, states)


class NaiveDP(Replicas):
    """`--impl naive`: backward runs undisturbed, then every gradient is all-reduced, one by one."""

    def __init__(self, model, group, lr: float, weight_decay: float, tokens_per_step: int, bf16: bool = False):
        broadcast_parameters(model, group)
        super().__init__(model, model, build_adamw(model.named_parameters(), lr, weight_decay),
                         tokens_per_step, bf16)
        self.group = group

    def sync_gradients(self) -> None:
        allreduce_gradients(self.model, self.group)     # after backward, one collective per tensor


class BucketedDP(Replicas):
    """`--impl bucketed`: the all-reduce of each bucket starts during backward (BucketedDataParallel)."""

    def __init__(self, model, group, lr: float, weight_decay: float, tokens_per_step: int, bf16: bool = False,
                 bucket_mb: float = 25.0):
        super().__init__(model, BucketedDataParallel(model, group, bucket_mb),
                         build_adamw(model.named_parameters(), lr, weight_decay), tokens_per_step, bf16)

    def no_sync(self):
        return self.module.no_sync()              # only the last micro-batch's backward sends buckets

    def sync_gradients(self) -> None:
        self.module.sync_gradients()              # wait for the buckets' all-reduces, started in backward


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
