"""PyTorch's own data parallelism, DistributedDataParallel, behind the verbs of ours (for comparison).

DDP does in C++ what BucketedDataParallel does in Python: gradient hooks fill buckets (25 MB by
default) in reverse order of the parameters, each full bucket is all-reduced asynchronously while
backward goes on, and backward does not return before every bucket has been summed. Two settings
make it train exactly like ours:
- a communication hook (`counted_allreduce_hook`) that *sums* the bucket (DDP's default divides by
  N: our loss is already divided by the global token count) and counts its bytes in common/comm.py;
- `no_sync()` for every micro-batch but the last, as ours.
"""
from contextlib import nullcontext

import torch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from common import comm
from common.step_protocol import OptimizerVerbs

from .dp_trainer import counted_comm_bytes, forward_backward_rows
from .replicated_adamw import tensor_bytes


def counted_allreduce_hook(group, bucket):
    """A DDP communication hook: sum (DDP's default averages) and count the bytes like ours."""
    work = comm.all_reduce(bucket.buffer(), group=group, name="dp", async_op=True)
    if work is None:                       # world size 1: nothing to wait for
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut
    return work.get_future().then(lambda fut: fut.value()[0])


def counted_ddp(model, group, bucket_mb: float) -> DistributedDataParallel:
    """The model wrapped in DDP (which broadcasts rank 0's parameters), summing and counting."""
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mb)
    ddp.register_comm_hook(group, counted_allreduce_hook)
    return ddp


class TorchDDP(OptimizerVerbs):
    """`train_dp.py --impl torch`: DistributedDataParallel behind the verbs of the step protocol, beside
    NaiveDP and BucketedDP (dp_trainer.py). `optimizer` is the caller's replicated_adamw.ReplicatedAdamW
    over `model`'s parameters, stepping AdamW here, ZeroRedundancyOptimizer for ZeRO stage 1
    (zero_torch.py); `step`, `zero_grad` and `set_lr` are its verbs (OptimizerVerbs)."""

    def __init__(self, model, group, optimizer, tokens_per_step: int, bf16: bool = False, bucket_mb: float = 25.0):
        self.model, self.optimizer = model, optimizer
        self.ddp = counted_ddp(model, group, bucket_mb)
        self.tokens_per_step, self.bf16 = tokens_per_step, bf16

    def forward_backward(self, x, y, sync: bool = True):
        # DDP's own no_sync(): the buckets are not sent in this backward, only the last one sends them
        with nullcontext() if sync else self.ddp.no_sync():
            return forward_backward_rows(self.ddp, x, y, self.tokens_per_step, self.bf16)

    def sync_gradients(self) -> None:
        pass    # nothing left: DDP's last backward waited for every bucket's all-reduce before returning

    def clip_grad_norm(self, max_norm: float) -> float:
        return self.optimizer.clip_grad_norm(max_norm)    # every replica holds the full gradient: no collective

    def memory(self) -> dict:
        return measured_memory(self.model, self.optimizer.optimizer)

    def comm_bytes(self) -> dict:
        return counted_comm_bytes()      # DDP's all-reduce goes through the counting hook

    def full_state(self):
        """(model state, AdamW state by name): every replica holds it whole."""
        return self.model.state_dict(), self.optimizer.optim_state()

    def load_optim_state(self, states: dict) -> None:
        self.optimizer.load_optim_state(states)


def local(t):
    """The part of `t` this rank holds: a DTensor's local shard (FSDP2), else `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def measured_memory(model, optimizer) -> dict:
    """What can be measured honestly: bytes of the local parameter / gradient shards and of the
    optimizer state this rank keeps. Not measured: FSDP2's transient unsharded parameters and
    reduce-scatter buffers, DDP's gradient buckets (another M bytes), ZeRO's broadcast buffers."""
    params = [local(p) for p in model.parameters()]
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    states = getattr(optimizer, "optim", optimizer).state.values()      # ZeRO wraps a local AdamW
    return {"param_bytes": tensor_bytes(params), "grad_bytes": tensor_bytes(grads),
            "optim_bytes": tensor_bytes(local(t) for st in states for k, t in st.items()
                                        if k != "step" and torch.is_tensor(t))}
