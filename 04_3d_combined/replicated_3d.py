"""Replicated AdamW on the grid: chapter 01's optimizer, each kind of gradient summed over its own group.

A rank of the grid holds a piece of the model (its pipeline stage(s), its TP shard) and steps AdamW on
all of it. The one rule of the course says which ranks hold the same piece, and so which ranks' gradients
are summed: the layout's `gradient_groups()`, one group per kind of state,

    kind       summed over                    holders of the same tensors
    dense      dp (dp × cp with CP)           every rank with the same stage and TP coordinate
    experts    edp (edp × cp with CP)         every rank holding the same experts (chapter 05)

Each stage's gradients are summed as soon as they are final (`grads_ready`, called from inside the
schedule), kind by kind, each an async all-reduce over its group (chapter 01's AsyncGradAllReduce); the
step waits for them in `sync_gradients`. zero_3d.ShardedOptimizers is its sibling with the same verbs:
ZeRO over the same groups, nothing started during the schedule.

The gradient norm: the grid's ranks hold different parts of the model over TP and PP (and EP), and a
tensor replicated over TP (a norm gain, a KV head shared by several ranks) must be counted once; the DP
replicas hold the same sum and are never added.
"""
from importlib import import_module

from common.optim import clip_by_global_norm
from common.step_protocol import counted_here, replicas

data_parallel = import_module("01_data_parallel.data_parallel")         # chapter 01: the async all-reduce
replicated_adamw = import_module("01_data_parallel.replicated_adamw")   # chapter 01: the replicated optimizer


class ReplicatedOptimizer(replicated_adamw.ReplicatedAdamW):
    """AdamW over `named`, this rank's piece, with the gradients of each kind ({kind: (named parameters,
    mesh group name)}) summed over that kind's group."""

    def __init__(self, named, by_kind: dict, mesh, lr: float, weight_decay: float, optimizer=None):
        super().__init__(named, lr, weight_decay, optimizer=optimizer)
        self.mesh = mesh
        self.kinds = {kind: ({id(p) for _, p in params}, data_parallel.AsyncGradAllReduce(mesh.group(group)))
                      for kind, (params, group) in by_kind.items() if params}    # (a dense model: no experts)

    def grads_ready(self, params) -> None:
        """A stage's gradients are final: each kind's all-reduce starts over its group (dense over dp: each
        replica saw its own rows; an expert's over edp: the ranks holding it, each saw its EP group's)."""
        for ids, replicas_of_kind in self.kinds.values():
            mine = [p for p in params if id(p) in ids]
            if mine:
                replicas_of_kind.launch(mine)

    def sync_gradients(self, partial_sums=None) -> None:
        """Wait for each kind's all-reduces started in the schedule; then `partial_sums()`, the trainer's
        sums inside the piece (TP's), once no all-reduce is in flight (each copies its sums back on wait)."""
        for _, replicas_of_kind in self.kinds.values():
            replicas_of_kind.wait()
        if partial_sums is not None:
            partial_sums()

    def clip_grad_norm(self, max_norm: float, groups=()) -> float:
        # Each tensor counted once: a tensor replicated over TP (a norm gain, a shared KV head) by its
        # first holder (common.step_protocol.counted_here); DP replicas are never summed.
        # >>> exercise 04.clip_norm
        grads = [p.grad for _, p in self.named]
        counted = [p.grad for _, p in self.named if counted_here(replicas(p), self.mesh.coords)]
        return clip_by_global_norm(counted, max_norm, groups=groups, all_grads=grads)
        # <<< exercise 04.clip_norm
