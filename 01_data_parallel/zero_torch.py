"""PyTorch's own sharded data parallelism behind the verbs of ours, set up to train exactly like
ours (for comparison only; train_zero.py --impl torch).

  stage 1  torch.distributed.optim.ZeroRedundancyOptimizer over DistributedDataParallel. It shards
           the optimizer state by *whole tensors* (each tensor is owned by one rank, assigned
           greedily by size), not element-wise; after the step each owner broadcasts its tensors.
  stage 2  FSDP2 `fully_shard(..., reshard_after_forward=False)`: parameters stay gathered from
           forward to backward (like stage 2, where every rank holds them all during compute), while
           gradients and optimizer state are sharded. It is *not* literally stage 2: at rest (between
           steps) FSDP2 still keeps only parameter shards, so its resting memory is stage 3's.
  stage 3  FSDP2 `fully_shard` on every block and on the root (embedding, final norm, head).

Each is an adapter of the step protocol beside ours: stage 1 is torch_dp.TorchDDP stepping a
ZeroRedundancyOptimizer (`torch_zero1`), stages 2 and 3 are `TorchFSDP2`.

FSDP2 averages gradients over ranks (divides the reduce-scatter by N); our loss is already divided
by the global token count and wants a sum. FSDP2's `set_gradient_divide_factor(1.0)` needs the
PREMUL_SUM reduction, which gloo lacks, so `TorchFSDP2.forward_backward` divides the loss by N times
fewer tokens instead (exact for N a power of two; otherwise a round-off of ~1e-7).

Bytes on the wire: DDP's all-reduce goes through our counting hook (torch_dp.py), so stage 1's
`comm_bytes` holds it alone; ZeroRedundancyOptimizer's broadcasts and FSDP2's collectives bypass
common/comm.py and are not counted (FSDP2's `comm_bytes` is null: not measured).
"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

from common.optim import build_adamw, clip_by_global_norm, decays, set_lr

from .dp_trainer import forward_backward_rows
from .replicated_adamw import ReplicatedAdamW
from .torch_dp import TorchDDP, local, measured_memory


def torch_zero1(model, group, lr: float, weight_decay: float, tokens_per_step: int, bf16: bool = False,
                bucket_mb: float = 25.0) -> TorchDDP:
    """Stage 1: DDP (counted all-reduce, summing) stepping a ZeroRedundancyOptimizer, which shards
    AdamW (our settings: decay by name, betas, eps) over the ranks by whole tensors."""
    named = list(model.named_parameters())
    optimizer = ZeroRedundancyOptimizer([p for n, p in named if decays(n)], optimizer_class=torch.optim.AdamW,
                                        process_group=group, lr=lr, betas=(0.9, 0.95), eps=1e-8,
                                        weight_decay=weight_decay, foreach=False)
    optimizer.add_param_group({"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0})
    return TorchDDP(model, group, ReplicatedAdamW(named, optimizer=optimizer), tokens_per_step, bf16, bucket_mb)


class TorchFSDP2:
    """Stages 2 and 3: FSDP2 shards the model in place; its hooks all-gather and reduce-scatter."""

    def __init__(self, model, group, device, stage: int, lr: float, weight_decay: float, tokens_per_step: int,
                 bf16: bool = False):
        mesh = DeviceMesh.from_group(group, device.type)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=stage == 3)   # False ≈ stage 2
        fully_shard(model, mesh=mesh, reshard_after_forward=stage == 3)
        self.model, self.group, self.world = model, group, dist.get_world_size(group)
        # built here, not handed in: PyTorch's own comparison, and FSDP2 wants AdamW built after fully_shard,
        # on the DTensor shards it creates (the course's trainers are handed theirs)
        self.optimizer = build_adamw(model.named_parameters(), lr, weight_decay)     # over DTensor shards
        self.tokens_per_step, self.bf16 = tokens_per_step, bf16
        self.measured = {}

    def forward_backward(self, x, y, sync: bool = True):
        # FSDP2 divides the summed gradients by N: hand it N times our share (the loss over N times fewer
        # tokens), so that its average is our sum. Exact for N a power of two; the share logged is ours.
        share = forward_backward_rows(self.model, x, y, self.tokens_per_step // self.world, self.bf16)
        return share / self.world

    def sync_gradients(self) -> None:
        pass                    # FSDP2 waited for its reduce-scatters before backward returned

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global norm over DTensor gradients: each rank's local shard counts once, summed over DP."""
        grads = [local(p.grad) for p in self.model.parameters() if p.grad is not None]
        return clip_by_global_norm(grads, max_norm, groups=(self.group,))

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.measured = measured_memory(self.model, self.optimizer)   # the gradients still exist: measure now
        self.optimizer.zero_grad()

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def memory(self) -> dict:
        return self.measured

    def comm_bytes(self) -> dict:
        return {"comm_bytes": None, "comm_bytes_sent": None}     # FSDP2's collectives bypass our counter
