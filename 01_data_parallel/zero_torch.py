"""PyTorch's own sharded data parallelism, set up to train exactly like ours (for comparison only).

  stage 1  torch.distributed.optim.ZeroRedundancyOptimizer over DistributedDataParallel. It shards
           the optimizer state by *whole tensors* (each tensor is owned by one rank, assigned
           greedily by size), not element-wise; after the step each owner broadcasts its tensors.
  stage 2  FSDP2 `fully_shard(..., reshard_after_forward=False)`: parameters stay gathered from
           forward to backward (like stage 2, where every rank holds them all during compute), while
           gradients and optimizer state are sharded. It is *not* literally stage 2: at rest (between
           steps) FSDP2 still keeps only parameter shards, so its resting memory is stage 3's.
  stage 3  FSDP2 `fully_shard` on every block and on the root (embedding, final norm, head).

FSDP2 averages gradients over ranks (divides the reduce-scatter by N); our loss is already divided
by the global token count and wants a sum. FSDP2's `set_gradient_divide_factor(1.0)` needs the
PREMUL_SUM reduction, which gloo lacks, so the training loop multiplies the loss by N instead
(exact for N a power of two; otherwise a round-off of ~1e-7).
"""
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from common.optim import build_adamw, clip_by_global_norm, decays

dp_lib = __import__("importlib").import_module("01_data_parallel.data_parallel")


def wrap_fsdp2(model, group, device, stage: int):
    """Shard the model in place with FSDP2; returns the AdamW over its DTensor parameters."""
    mesh = DeviceMesh.from_group(group, device.type)
    keep = stage == 2              # reshard_after_forward=False ≈ stage 2
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=not keep)
    fully_shard(model, mesh=mesh, reshard_after_forward=not keep)
    return build_adamw(model.named_parameters(), 0.0, 0.0)


def build_zero1(model, group, lr: float, weight_decay: float, bucket_mb: float = 25.0):
    """DDP (counted all-reduce, summing) + ZeroRedundancyOptimizer with our AdamW settings."""
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mb)
    ddp.register_comm_hook(group, dp_lib.counted_allreduce_hook)
    named = list(model.named_parameters())
    decay = [p for n, p in named if decays(n)]
    opt = ZeroRedundancyOptimizer(decay, optimizer_class=torch.optim.AdamW, process_group=group, lr=lr,
                                  betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, foreach=False)
    opt.add_param_group({"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0})
    return ddp, opt


def clip_fsdp2(model, max_norm: float, group) -> float:
    """Global norm over DTensor gradients: each rank's local shard counts once, summed over DP."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
             for p in model.parameters() if p.grad is not None]
    return clip_by_global_norm(grads, max_norm, groups=(group,))


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def measured_memory(model, optimizer) -> dict:
    """What can be measured honestly: bytes of the local parameter / gradient shards and of the
    optimizer state this rank keeps. Not measured: FSDP2's transient unsharded parameters and
    reduce-scatter buffers, DDP's gradient buckets (another M bytes), ZeRO's broadcast buffers."""
    params = [_local(p) for p in model.parameters()]
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    states = getattr(optimizer, "optim", optimizer).state.values()      # ZeRO wraps a local AdamW
    return {"param_bytes": sum(t.numel() * t.element_size() for t in params),
            "grad_bytes": sum(t.numel() * t.element_size() for t in grads),
            "optim_bytes": sum(_local(t).numel() * _local(t).element_size()
                               for st in states for k, t in st.items() if k != "step" and torch.is_tensor(t))}
