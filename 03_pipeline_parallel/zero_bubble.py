"""Zero bubble's split of a backward pass: B (input gradients, now) and W (weight gradients, later).

For a linear layer y = x Wᵀ the backward is two matmuls:
    dx = dy W      the previous stage is waiting for it        -> B
    dW = dyᵀ x     nobody is waiting for it                    -> W, in a slot where the rank would idle
Autograd computes both in one node, so nn.Linear gets a backward of its own here: `SplitLinear`
computes dx and, while a B action runs, leaves (W, x, dy) in a `WeightGradStore` instead of computing
dW. The W action then does the one remaining matmul per layer. Nothing is computed twice; what ZB-H1
pays instead is memory: every linear layer's x and dy stay alive from B until W.

Parameters that are not in an nn.Linear (RMSNorm weights, tensor-parallel layers) get their gradients
in B, as in a plain backward; they are a small part of the work.
"""
import threading
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F


class WeightGradStore:
    """Where SplitLinear leaves its postponed weight gradients while `deferring()` is on."""

    def __init__(self):
        self.pending = None       # None: compute dW at once (a plain backward)
        self.thread = threading.local()   # .native, per thread: chapter 05 runs a forward beside a backward
                                          # (and a backward's recomputation runs forwards in its own thread)

    @property
    def native(self) -> bool:
        """True inside `whole()` on this thread: SplitLinear is nn.Linear."""
        return getattr(self.thread, "native", False)

    @contextmanager
    def deferring(self):
        """Inside, SplitLinear backwards append (weight, x, dy) to the list this yields."""
        self.pending = []
        try:
            yield self.pending
        finally:
            self.pending = None

    @contextmanager
    def whole(self):
        """For a forward whose backward will be one whole pass (an F marked `whole`: its backward is a BW
        action; or on stage 0, whose W is the whole backward): inside, SplitLinear runs as nn.Linear, whose
        forward and backward are PyTorch's own, a little faster than this file's Python ones, and the same
        numbers (dx = dy W, dW = dyᵀ x). The executor enters it for the action, on the thread that runs it."""
        before, self.thread.native = self.native, True
        try:
            yield
        finally:
            self.thread.native = before


def weight_grad(weight, x, dy) -> torch.Tensor:
    """dW = dyᵀ x over every token: (out, N) @ (N, in) -> (out, in), in the weight's dtype."""
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]).to(dy.dtype)
    return (dy2.t() @ x2).to(weight.dtype)


@torch.no_grad()
def apply_weight_grads(pending: list) -> None:
    """The W action: the postponed dW = dyᵀ x of each layer, added into .grad. Outside autograd: x is
    an activation of the graph, so dyᵀ x would otherwise be a gradient that itself requires grad (and
    drags a graph into every collective that later reads .grad)."""
    for weight, x, dy in pending:
        g = weight_grad(weight, x, dy)
        weight.grad = g if weight.grad is None else weight.grad.add_(g)


class _SplitLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, store):            # x (..., in), weight (out, in) -> (..., out)
        ctx.save_for_backward(x)
        # The Parameter itself, not a saved copy of it: W adds into ITS .grad. (A saved tensor may come
        # back as another tensor object sharing the storage, whose .grad nobody reads.)
        ctx.weight, ctx.store = weight, store
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, dy):                          # dy (..., out)
        (x,), weight = ctx.saved_tensors, ctx.weight
        dx = dy @ weight.to(dy.dtype)               # (..., in): B's part
        if ctx.store.pending is not None:           # inside B: postpone dW
            ctx.store.pending.append((weight, x, dy))
            return dx, None, None
        return dx, weight_grad(weight, x, dy), None


class SplitLinear(nn.Module):
    """nn.Linear (no bias) whose weight gradient can wait. It holds the SAME Parameter as the layer
    it replaces, so the optimizer, parameter names and checkpoints do not change."""

    def __init__(self, linear: nn.Linear, store: WeightGradStore):
        super().__init__()
        assert linear.bias is None, "the model's linear layers have no bias"
        self.weight, self.store = linear.weight, store
        self.in_features, self.out_features = linear.in_features, linear.out_features   # as nn.Linear's (a router reads E)

    def forward(self, x):
        if self.store.native:                       # its backward will not be split: plain nn.Linear
            return F.linear(x, self.weight)
        return _SplitLinearFunction.apply(x, self.weight, self.store)


def split_linears(model: nn.Module, store: WeightGradStore) -> set[int]:
    """Replace every nn.Linear in `model` by a SplitLinear; returns the ids of their weights."""
    deferred = set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, SplitLinear(child, store))
                deferred.add(id(child.weight))
    return deferred
