"""AdamW, the learning-rate schedule, and gradient clipping by the global norm.

AdamW is elementwise: the update of one weight depends only on that weight, its gradient and its
own two moments. So a rank that holds a slice of a weight (TP, ZeRO) and runs AdamW on the slice
computes exactly the slice of the single-device update. That is why every chapter can use the plain
torch.optim.AdamW on whatever it holds. Only two things need the whole model: weight decay must
know which tensors are matrices (we look at the parameter's name, which sharding keeps), and the
gradient norm for clipping must be summed over every rank (below).
"""
import math

import torch
import torch.distributed as dist


def decays(name: str) -> bool:
    """Weight decay applies to matrices (linear layers, embeddings), not to norm gains."""
    return not name.endswith("norm.weight")


def build_adamw(named_params, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over (name, tensor) pairs; the names pick the weight-decay group."""
    named_params = list(named_params)
    groups = [
        {"params": [p for n, p in named_params if decays(n)], "weight_decay": weight_decay},
        {"params": [p for n, p in named_params if not decays(n)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95), eps=1e-8,
                             **adamw_kernel(named_params))


def adamw_kernel(named_params) -> dict:
    """How AdamW runs its arithmetic: the trade between speed and bits.

    torch.optim.AdamW has three implementations of the same formula:
      foreach=False  a Python loop over the tensors, ~10 elementwise ops each: every element goes through
                     the same ops whatever the tensor's shape, so a shard's update (TP, ZeRO) is the slice
                     of the full update *bit for bit*. On a GPU it launches ~10 kernels per tensor: for a
                     1 B model (219 tensors) ~2,000 launches a step, whose launch time shows in the step
                     time when the step is short. On a CPU it is what torch picks by itself.
      foreach=True   the same ops, each over a list of tensors at once: fewer launches, but its ops regroup
                     the arithmetic (a step size computed once per list), so a shard's bits can differ
                     from the slice's in the last place; we do not use it.
      fused=True     one kernel over every tensor (a GPU's, or a CPU's), each element on its own: one
                     launch per list instead of thousands, the same formula element by element, so a
                     shard is updated as its slice of the whole would be.
    The course takes fused on a GPU (launches, not arithmetic, are what a GPU waits for; every layout
    still updates each element with the same arithmetic) and the plain loop on a CPU (bit for bit with the
    reference, and no slower there: one CPU thread runs one op after another either way)."""
    on_gpu = any(p.is_cuda for _, p in named_params)
    return {"fused": True} if on_gpu else {"foreach": False}


def saved_step(optimizer: torch.optim.Optimizer, step: torch.Tensor, device) -> torch.Tensor:
    """A checkpoint's step count as `optimizer` keeps it: beside the weights (`device`) for the fused
    kernel, on the CPU for the per-tensor loop."""
    return step.clone().to(device if optimizer.defaults.get("fused") else "cpu")


def lr_at(step: int, peak: float, warmup: int, total: int, floor_ratio: float = 0.1) -> float:
    """Linear warmup to `peak` over `warmup` steps, then cosine decay to floor_ratio·peak at `total`.

    `step` counts from 1. The schedule depends only on the step number, so resuming needs no state.
    """
    if warmup > 0 and step <= warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_by_global_norm(owned_grads, max_norm: float, groups=(), all_grads=None) -> float:
    """Scale gradients so that the norm of the *whole model's* gradient is at most max_norm.

    owned_grads: gradient tensors this rank counts toward the norm; every element of the model's
                 gradient must be counted by exactly one rank (a replicated tensor, e.g. a norm gain
                 held by every TP rank, is counted by one of them only).
    groups:      process groups whose ranks hold *different* parts of the model (TP, PP, ZeRO
                 shards); the squared norms are summed over them. Data-parallel replicas hold the
                 same gradients after the all-reduce and are not summed over.
    all_grads:   every gradient tensor this rank holds, to be scaled (default: owned_grads).
    Returns the global norm before clipping (the same value on every rank).
    """
    owned_grads = [g for g in owned_grads if g is not None]
    norm = sum_of_squares(owned_grads, groups).sqrt().item()
    clip_to(norm, max_norm, all_grads if all_grads is not None else owned_grads)
    return norm


def sum_of_squares(grads, groups=()) -> torch.Tensor:
    """Σ g² over `grads` (in float64), then summed over each process group in turn: clip_by_global_norm's
    first half, for a caller that adds several such sums (chapter 04's ZeRO, one per kind of state)."""
    grads = [g for g in grads if g is not None]
    if grads:   # each tensor's norm in float64: one op (not .double().pow(2).sum(), three), squared and added
        sq = torch.stack([torch.linalg.vector_norm(g.detach(), dtype=torch.float64) for g in grads]).square().sum()
    else:
        sq = torch.zeros((), dtype=torch.float64)
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
    return sq


def clip_to(norm: float, max_norm: float, grads) -> None:
    """The second half: scale every gradient by max_norm / norm when the global norm is larger."""
    if max_norm > 0 and norm > max_norm:
        # one multiply over the list (each element scaled exactly as g.mul_(scale) would: the same bits)
        torch._foreach_mul_([g for g in grads if g is not None], max_norm / (norm + 1e-6))


def zero_grads(optimizer: torch.optim.Optimizer) -> None:
    """Every gradient the optimizer updates set to zero in place, in one call (not set to None: the flat
    buffers and hooks that hold them stay). torch's own `zero_grad(set_to_none=False)` zeroes them one by
    one when the optimizer runs per tensor, as the course's does on a CPU."""
    by_kind = {}                       # one call per kind of tensor (a list may not mix DTensors with tensors)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                by_kind.setdefault(type(p.grad), []).append(p.grad)
    for grads in by_kind.values():
        torch._foreach_zero_(grads)


def optim_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors on this rank (AdamW: the two moments, α = 2 per element)."""
    return sum(t.numel() * t.element_size() for st in optimizer.state.values()
               for k, t in st.items() if k != "step" and torch.is_tensor(t))
