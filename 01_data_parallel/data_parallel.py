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

`AsyncGradAllReduce` is the bucket without the hooks, for callers that know themselves when a set
of gradients is final (a pipeline stage after its last backward: chapters 03 to 05).
`train_dp.py` drives these algorithms through the step protocol (common/step_protocol.py): the
small trainers that expose its verbs are in dp_trainer.py.
"""
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from common import comm

from .flat_buffers import FlatLayout, groups_by_size


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
        layout = FlatLayout(params)                                    # world 1: no padding
        self.buffer = torch.zeros(layout.padded, dtype=params[0].dtype, device=params[0].device)  # (numel,)
        self.slots = layout.split(self.buffer)     # each parameter's place in the buffer, shaped like it
        self.ready = 0          # gradients of this bucket produced so far in this backward
        self.work = None        # the in-flight async all-reduce

    def launch(self, group) -> None:
        """Copy the gradients into the buffer and start summing it over `group` in the background."""
        if dist.get_world_size(group) == 1:        # a group of one: the sum is .grad itself, copy nothing
            self.work = None
            return
        for slot, p in zip(self.slots, self.params):
            slot.copy_(p.grad)
        self.work = comm.all_reduce(self.buffer, group=group, name="dp", async_op=True)

    def wait(self) -> None:
        """Wait for the sum and copy it back into each .grad."""
        if self.work is None:                      # world size 1: nothing was sent, .grad is the sum
            return
        self.work.wait()
        for slot, p in zip(self.slots, self.params):
            p.grad.copy_(slot)
        self.work = None


class AsyncGradAllReduce:
    """Sum sets of gradients over `group` in the background, for callers that know when a set is final
    (chapters 03 to 05: when a pipeline stage has run its last backward of the step).

    launch(params)  copy their gradients into one flat buffer (a bucket), start an async all-reduce, return
    wait()          wait for every launch and copy the sums back into .grad
    Bytes are those of the naive all-reduce (the same tensors, summed once), in fewer messages."""

    def __init__(self, group):
        self.group, self.pending = group, []

    def launch(self, params: list[nn.Parameter]) -> None:
        if dist.get_world_size(self.group) == 1:       # a group of one: the gradients are the sums already
            return
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
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.alone = dist.get_world_size(group) == 1   # a group of one: nothing to send, no bucket, no hook
        groups = [] if self.alone else groups_by_size(reversed(named), bucket_mb)
        self.buckets = [_Bucket([p for _, p in some]) for some in groups]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        for p in self.bucket_of:
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
        # >>> exercise 01.bucket_hook
        bucket = self.bucket_of[p]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):      # the bucket is full: send it now, asynchronously
            bucket.launch(self.group)
            self.launch_log.append((self.buckets.index(bucket), self._hooks_fired))
        # <<< exercise 01.bucket_hook

    def sync_gradients(self) -> None:
        """Wait for every bucket's all-reduce and copy the summed gradients back into .grad."""
        if self.alone:                                 # world size 1: .grad is already the sum
            return
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
