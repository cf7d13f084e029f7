"""The optimizer passed in, replicated: AdamW on every tensor this rank holds, with the step verbs.

A trainer runs forward and backward in its own way (one replica, TP shards, a pipeline's stages); what
it does with the gradients afterwards is an *optimizer object's*, handed to it whole, with the same
verbs whichever optimizer it is (common/step_protocol.py):

    optimizer.begin_step()                  before the step's first forward (ZeRO's full buffers back)
    optimizer.grads_ready(params)           these gradients are final for the step (a pipeline stage's)
    optimizer.sync_gradients(partial_sums)  every gradient summed over its replicas
    optimizer.clip_grad_norm(max_norm, groups)
    optimizer.step(), zero_grad(), set_lr(lr), memory(), optim_state(), load_optim_state(states)

Two kinds exist: this one, every rank holding the whole AdamW of what it holds, and ZeRO, which shards
it over the replicas (zero_sharding.ZeroOptimizer; chapter 04's zero_3d.ShardedOptimizers on the grid).

`group`: the ranks holding the same tensors, whose gradients are summed. Given one, a set of gradients
is summed in the background as soon as it is final (`grads_ready`, chapter 03's pipeline stages:
AsyncGradAllReduce), and `sync_gradients` waits for those sums. Without one (None) the trainer sums
the replicas itself (chapter 01's all-reduce after backward, or its buckets in backward), or there is
nothing to sum. `optimizer`: what steps the tensors (default the course's AdamW, common/optim.py, as everywhere in
the course; PyTorch's ZeroRedundancyOptimizer for its ZeRO-1 comparison, zero_torch.py).
"""
from common.optim import build_adamw, clip_by_global_norm, optim_bytes, set_lr, zero_grads
from common.training import load_optim_state_by_name, optim_state_by_name

from . import zero_accounting
from .data_parallel import AsyncGradAllReduce


class ReplicatedAdamW:
    """AdamW (or `optimizer`) over `named` ((name, tensor) pairs this rank holds), replicated over `group`."""

    def __init__(self, named, lr: float = 0.0, weight_decay: float = 0.0, group=None, optimizer=None):
        self.named = list(named)
        self.optimizer = optimizer if optimizer is not None else build_adamw(self.named, lr, weight_decay)
        self.replicas = AsyncGradAllReduce(group) if group is not None else None

    # --- gradients -----------------------------------------------------------------------------------
    def begin_step(self) -> None:
        pass                      # the gradients accumulate in .grad, which exists between steps

    def grads_ready(self, params) -> None:
        """`params`' gradients are final for this step: start their all-reduce over the replicas."""
        if self.replicas is not None:
            self.replicas.launch(params)

    def sync_gradients(self, partial_sums=None) -> None:
        """Wait for the all-reduces started in `grads_ready`; then `partial_sums()`, the sums a trainer's
        own dimension makes inside the piece a rank holds (TP's replicated tensors, chapter 04): here, on
        the whole gradient, once no all-reduce of it is in flight (its result is copied back on wait)."""
        if self.replicas is not None:
            self.replicas.wait()
        if partial_sums is not None:
            partial_sums()

    def clip_grad_norm(self, max_norm: float, groups=()) -> float:
        """Clip by the global norm: the squares of every gradient here, summed over `groups`, the ranks
        holding different parts of the model (none: a whole replica; the pipeline's stages)."""
        return clip_by_global_norm([p.grad for _, p in self.named], max_norm, groups=groups)

    # --- the update ---------------------------------------------------------------------------------
    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        zero_grads(self.optimizer)   # in place, not to None: flat buffers and hooks that hold them stay

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    # --- outside the step: accounting, checkpoints, the weights ----------------------------------------
    def memory(self) -> dict:
        """Bytes this rank holds: the tensors, their gradients, the optimizer's state (AdamW: 2 moments)."""
        params = [p for _, p in self.named]
        return {"param_bytes": tensor_bytes(params), "grad_bytes": tensor_bytes(p.grad for p in params),
                "optim_bytes": optim_bytes(self.optimizer)}

    def formula(self) -> dict:
        """What chapter 01's formula says this rank holds between steps: M, M, αM (no sharding)."""
        return zero_accounting.zero_memory_components(0, tensor_bytes(p for _, p in self.named), 1)

    def optim_state(self, to_full=lambda name, t: t) -> dict:
        """AdamW's moments by name (`to_full`: a local part made whole, e.g. a TP all-gather)."""
        return optim_state_by_name(self.optimizer, self.named, to_full)

    def load_optim_state(self, states: dict, to_local=lambda name, t: t) -> None:
        load_optim_state_by_name(self.optimizer, self.named, states, to_local)

    def gather(self) -> None:
        pass                      # the weights are whole here between steps (ZeRO-3 gathers them)

    def release(self) -> None:
        pass


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
