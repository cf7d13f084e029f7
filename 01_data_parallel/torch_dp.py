"""PyTorch's own data parallelism, DistributedDataParallel, behind the verbs of ours (for comparison).

DDP does in C++ what BucketedDataParallel does in Python: gradient hooks fill buckets (25 MB by
default) in reverse order of the parameters, each full bucket is all-reduced asynchronously while
backward goes on, and backward does not return before every bucket has been summed. Two settings
make it train exactly like ours:
- a communication hook (`counted_allreduce_hook`) that *sums* the bucket (DDP's default divides by
  N: our loss is already divided by the global token count) and counts its bytes in common/comm.py;
- `no_sync()` for every micro-batch but the last, as ours.
"""
import torch
from torch.nn.parallel import DistributedDataParallel

from common import comm
from common.optim import build_adamw

from .data_parallel import Replicas


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


class TorchDDP(Replicas):
    """`train_dp.py --impl torch`: DistributedDataParallel, with the same verbs as NaiveDP and BucketedDP."""

    def __init__(self, model, group, lr: float, weight_decay: float, tokens_per_step: int, bf16: bool = False,
                 bucket_mb: float = 25.0):
        super().__init__(model, counted_ddp(model, group, bucket_mb),
                         build_adamw(model.named_parameters(), lr, weight_decay), tokens_per_step, bf16)

    def no_sync(self):
        return self.module.no_sync()        # DDP's own: the buckets are not sent in this backward

    def sync_gradients(self) -> None:
        pass    # nothing left: DDP's last backward waited for every bucket's all-reduce before returning
