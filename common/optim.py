"""AdamW, the learning-rate schedule, and gradient clipping by the global norm.

AdamW is elementwise: the update of one weight depends only on that weight, its gradient and its
own two moments. So a rank that holds a slice of a weight (TP, ZeRO) and runs AdamW on the slice
computes exactly the slice of the single-device update. That is why every chapter can use the plain
AdamW below on whatever it holds. Only two things need the whole model: weight decay must
know which tensors are matrices (we look at the parameter's name, which sharding keeps), and the
gradient norm for clipping must be summed over every rank (below).
"""
import math

import torch
import torch.distributed as dist


def decays(name: str) -> bool:
    """Weight decay applies to matrices (linear layers, embeddings), not to norm gains."""
    return not name.endswith("norm.weight")


def build_adamw(named_params, lr: float, weight_decay: float) -> "AdamW":
    """AdamW over (name, tensor) pairs; the names pick the weight-decay group."""
    named_params = list(named_params)
    groups = [
        {"params": [p for n, p in named_params if decays(n)], "weight_decay": weight_decay},
        {"params": [p for n, p in named_params if not decays(n)], "weight_decay": 0.0},
    ]
    return AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95), eps=1e-8,
                 fused=any(p.is_cuda for _, p in named_params))


class AdamW:
    """AdamW, written out: for each tensor p with gradient g, at step t (counted per tensor, from 1),

        p ← p·(1 − lr·wd)                      decoupled weight decay
        m ← m + (g − m)·(1 − β1)               first moment  (= β1·m + (1 − β1)·g)
        v ← v·β2 + (1 − β2)·g²                 second moment
        p ← p − lr/(1 − β1^t) · m / (√v / √(1 − β2^t) + ε)

    Op for op the arithmetic of torch.optim.AdamW, so the bits are PyTorch's (tests/test_common.py runs both
    side by side, both kernels). It keeps what a trainer reads the same way too: `param_groups` (lr, betas, eps,
    weight_decay, params), `state[p]` = {"step", "exp_avg", "exp_avg_sq"} once p has had a step, `defaults`.

    Two kernels, one formula; the trade is between speed and bits:
      the loop (CPU)   a Python loop over the tensors, ~8 elementwise ops each: every element goes through the
                       same ops whatever the tensor's shape, so a shard's update (TP, ZeRO) is the slice of the
                       full update *bit for bit*. On a GPU that is ~8 kernel launches per tensor (~1,800 a step
                       for a 1 B model's 219 tensors), which show in the step time when the step is short.
      fused (GPU)      torch._fused_adamw_, the one kernel torch.optim.AdamW(fused=True) calls: every tensor of a
                       group in one launch, each element on its own with the same formula, so a shard is still
                       updated as its slice of the whole would be.
    (PyTorch has a third, foreach: the same ops over lists, but it regroups the arithmetic, so a shard's bits can
    differ from the slice's in the last place; the course does not use it.) Written here rather than imported:
    torch.optim's methods carry a guard against the compiler that imports it (torch._dynamo, ~1 s of CPU) in every
    process that builds an optimizer, compiled or not: each rank of every run paid it."""

    def __init__(self, groups: list[dict], lr: float, betas=(0.9, 0.999), eps: float = 1e-8, fused: bool = False):
        self.defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0, "fused": fused}
        self.param_groups = [{**self.defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[torch.Tensor, dict] = {}       # a tensor's moments, made at its first step

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p not in self.state:
                    self.state[p] = {"step": self._zero_step(p), "exp_avg": torch.zeros_like(p),
                                     "exp_avg_sq": torch.zeros_like(p)}
            (self._fused if self.defaults["fused"] else self._loop)(group, params)

    def _zero_step(self, p: torch.Tensor) -> torch.Tensor:
        """The step count: a float32 scalar on the CPU for the loop (read once a step, no device sync), beside the
        weight for the fused kernel (which reads it there)."""
        return torch.zeros((), dtype=torch.float32, device=p.device if self.defaults["fused"] else "cpu")

    def _loop(self, group: dict, params: list) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for p in params:
            st = self.state[p]
            st["step"] += 1
            if wd != 0:
                p.mul_(1 - lr * wd)
            st["exp_avg"].lerp_(p.grad, 1 - beta1)
            st["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            t = st["step"].item()
            step_size = lr / (1 - beta1 ** t)
            denom = (st["exp_avg_sq"].sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)
            p.addcdiv_(st["exp_avg"], denom, value=-step_size)

    def _fused(self, group: dict, params: list) -> None:
        by_kind: dict[tuple, list] = {}                 # one launch per device and dtype
        for p in params:
            by_kind.setdefault((p.device, p.dtype), []).append(p)
        (beta1, beta2) = group["betas"]
        for ps in by_kind.values():
            steps = [self.state[p]["step"] for p in ps]
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(ps, [p.grad for p in ps], [self.state[p]["exp_avg"] for p in ps],
                                [self.state[p]["exp_avg_sq"] for p in ps], [], steps, amsgrad=False,
                                lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                                eps=group["eps"], maximize=False, grad_scale=None, found_inf=None)

    def zero_grad(self) -> None:
        """Every gradient dropped (set to None), as PyTorch's reference trainers expect; the course's own trainers
        zero theirs in place (zero_grads below), where flat buffers and hooks hold them."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


def saved_step(optimizer: AdamW, step: torch.Tensor, device) -> torch.Tensor:
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


def set_lr(optimizer: AdamW, lr: float) -> None:
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


def zero_grads(optimizer: AdamW) -> None:
    """Every gradient the optimizer updates set to zero in place, in one call (not set to None: the flat
    buffers and hooks that hold them stay)."""
    by_kind = {}                       # one call per kind of tensor (a list may not mix DTensors with tensors)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                by_kind.setdefault(type(p.grad), []).append(p.grad)
    for grads in by_kind.values():
        torch._foreach_zero_(grads)


def optim_bytes(optimizer: AdamW) -> int:
    """Bytes of the optimizer's state tensors on this rank (AdamW: the two moments, α = 2 per element)."""
    return sum(t.numel() * t.element_size() for st in optimizer.state.values()
               for k, t in st.items() if k != "step" and torch.is_tensor(t))
