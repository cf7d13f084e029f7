"""torchtitan's training step for a Llama under FSDP2, on the course's model: what torchtitan_memory.py counts,
run. A job for one rank of an initialised process group, on real tensors (a miniature on this CPU) or on
FakeTensorMode's (the published model's shapes, no data: allocation_trace.py records what it asks).

    fully_shard      on each block and on the root; bf16 weights to compute, fp32 reductions; every block but
                     the last resharded after its forward (its backward comes first), the root never
    checkpointing    torchtitan's selective "op" policy on each block: keep the output of every other matmul
                     (the 1st, 3rd, ...) and of the attention kernel, recompute the rest in backward
    the loss         cross-entropy of the bf16 logits cast to fp32, the logits deleted before backward
    the optimizer    torch's AdamW; the gradients set to None as a step starts
"""
from importlib import import_module

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from common.live_memory import held_tensors
from common.model import Transformer, init_weights

allocation_trace = import_module("07_choosing_a_layout.allocation_trace")   # this chapter: a step's allocations

# the attention kernel scaled_dot_product_attention runs: on a CPU, on a GPU (flash attention)
ATTENTION_KERNELS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                     torch.ops.aten._scaled_dot_product_flash_attention.default}


def op_policy():
    """torchtitan's "op" policy: keep the output of every other matmul (the 1st, 3rd, ...) and of the attention
    kernel, recompute everything else. Returns (the policy, the list of the forward's matmuls it counted)."""
    matmuls = []

    def policy(ctx, func, *args, **kwargs):
        if func is torch.ops.aten.mm.default:
            if not ctx.is_recompute:
                matmuls.append(func)
            return CheckpointPolicy.MUST_SAVE if len(matmuls) % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in ATTENTION_KERNELS else CheckpointPolicy.PREFER_RECOMPUTE
    return policy, matmuls


class Checkpointed(torch.nn.Module):
    """A block whose forward runs under the op policy, a fresh count of its matmuls each time (torchtitan
    wraps each block so)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, cos, sin):                          # (B, S, D) -> (B, S, D)
        return checkpoint(self.block.body, x, cos, sin, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(op_policy()[0]))


def sharded_model(cfg, mesh, seed: int = 0, initialise: bool = True):
    """The model under torchtitan's FSDP2 and checkpointing (`initialise`: the course's weights; False under
    FakeTensorMode, where there is nothing to initialise)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = Transformer(cfg)
    if initialise:
        init_weights(model, seed)
    model.layers = torch.nn.ModuleList(Checkpointed(block) for block in model.layers)
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers):
        fully_shard(block, mesh=mesh, mp_policy=precision, reshard_after_forward=i < len(model.layers) - 1)
    return fully_shard(model, mesh=mesh, mp_policy=precision)


def train_step(model, optimizer, tokens):
    """One step: (B, S+1) tokens; the loss over fp32 logits, the logits freed before the backward."""
    optimizer.zero_grad()
    logits = model(tokens[:, :-1])                                   # (B, S, V) bf16
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    del logits
    loss.backward()
    optimizer.step()
    return loss


def fake_trace(cfg, world: int, rows: int, seq_len: int, steps: int = 2) -> list:
    """allocation_trace's events of `steps` steps of one of `world` ranks, each with `rows` sequences of `seq_len`
    in one micro-batch, on FakeTensorMode's tensors under PyTorch's fake process group (its collectives
    return at once: no data, no other rank): a published model's step in seconds. The sharded weights are the trace's first allocations; the first
    step makes AdamW's moments, the second is a step like every later one."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore     # registers PyTorch's "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        with FakeTensorMode():
            model = sharded_model(cfg, mesh, initialise=False)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            with allocation_trace.AllocationTrace(held_tensors(model)) as trace:
                for _ in range(steps):
                    train_step(model, optimizer, torch.randint(0, cfg.vocab_size, (rows, seq_len + 1)))
        return trace.events
    finally:
        dist.destroy_process_group()
