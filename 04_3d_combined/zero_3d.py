"""ZeRO on the grid: chapter 01's sharded optimizer, once per kind of state, over the ranks that hold it.

Chapter 01 shards AdamW's state (stage 1), the gradients (2) and the parameters (3) over the data-
parallel group: the ranks that hold the *same* tensors and see different tokens. On the grid a rank
holds a piece of the model (its pipeline stage(s), its TP shard), and the one rule of the course says
which ranks hold the same piece: the layout's `gradient_groups()`. ZeRO shards each kind of state over
exactly the group that sums its gradients:

    kind       summed and sharded over        holders of the same tensors
    dense      dp (dp × cp with CP)           every rank with the same stage and TP coordinate
    experts    edp (edp × cp with CP)         every rank holding the same experts (chapter 05)

So a rank with EP holds two sharded optimizers, each its own chapter-01 ZeroOptimizer on its own
group (DeepSeek-V3's layout: ZeRO-1 with the experts' state sharded over the ranks holding each
expert). TP and PP change nothing in it: a TP shard or a stage's subset is just what the rank holds.

Under a pipeline the micro-batches accumulate gradients, so stages 2 and 3 take chapter 01's pipeline
form (`per_microbatch=False`): the full gradients live in flat buffers during the step and are reduce-
scattered once, after the schedule; stage 3 gathers the parameters once per step, before the first
forward, and frees them with the gradients — FSDP × PP, whose gathered weights serve every micro-batch.
During a step a rank therefore holds M of parameters and M of gradients (M: its piece's bytes, padded),
as at stage 1; between steps stage 2 holds M + (1+α)M/N and stage 3 (2+α)M/N.

The gradient norm. Each optimizer sums its shard's squares over its group (zero_sharding.grad_squares);
that sum is then the same on every rank of the group. The norm adds the kinds and sums over the groups
whose ranks hold different pieces (tp, pp, and ep for the experts). A dense sum is the same on every ep
rank (ep lies inside dp): counted there by ep rank 0 only. The general rule, in `clip_grad_norm`: a
kind's sum is counted by one rank of every mesh dimension that its group and the norm's groups share.
"""
from importlib import import_module

import torch
import torch.distributed as dist

from common.optim import clip_to
from common.step_protocol import counted_here, replicas

zero_sharding = import_module("01_data_parallel.zero_sharding")       # chapter 01: ZeRO stages 1 and 2 (and 3)
zero_accounting = import_module("01_data_parallel.zero_accounting")   # chapter 01: its formulas, its checkpoints


class ShardedOptimizers:
    """One ZeroOptimizer per kind of state ({kind: (named parameters, mesh group name)}), with the verbs
    of one optimizer: those of replicated_3d.ReplicatedOptimizer, its sibling, which any grid trainer takes
    in its place. Bytes are counted under `name` (chapter 04 counts every gradient collective as dp)."""

    def __init__(self, by_kind: dict, mesh, stage: int, lr: float, weight_decay: float, name: str = "dp"):
        self.mesh, self.stage, self.kinds, self.group_of = mesh, stage, {}, {}
        for kind, (named, group) in by_kind.items():
            if not named:
                continue                                                    # (a dense model: no experts)
            opt = zero_sharding.ZeroOptimizer(named, mesh.group(group), lr, weight_decay, stage=stage, name=name,
                                              per_microbatch=False)
            inside = mesh.joined.get(group, (group,))
            for _, piece in opt.pieces:
                # a tensor replicated over a dimension of this group (a dense weight on every ep rank) is
                # sharded over it now: each piece is its own, counted by its holder
                piece.replicated_over = {d: c for d, c in replicas(piece).items() if d not in inside}
            self.kinds[kind], self.group_of[kind] = opt, group

    def each(self):
        return self.kinds.values()

    def _every(self, verb: str, *args) -> None:
        """The same verb on every kind's optimizer, in the same order on every rank."""
        for opt in self.each():
            getattr(opt, verb)(*args)

    # --- the step, kind by kind --------------------------------------------------------------------
    def begin_step(self) -> None:
        self._every("begin_step")

    def grads_ready(self, params) -> None:
        pass            # nothing starts during the schedule: the gradients are reduced once, after it

    def sync_gradients(self, partial_sums=None) -> None:
        """`partial_sums()` first (the trainer's sums inside the piece, TP's: on the full gradients, sums
        commute), then each kind's ZeRO collective: all-reduce (stage 1) or reduce-scatter into my shard,
        freeing the full buffers (2, 3), over its group."""
        if partial_sums is not None:
            partial_sums()
        self._every("sync_gradients")

    def clip_grad_norm(self, max_norm: float, norm_groups) -> float:
        """The norm of the whole model's gradient from the shards (the module docstring's rule)."""
        mesh, total = self.mesh, []
        for kind, opt in self.kinds.items():
            sq = opt.grad_squares(mesh.coords)                          # the same on every rank of its group
            shared = {d: mesh.size(d) for d in mesh.joined.get(self.group_of[kind], (self.group_of[kind],))
                      if mesh.size(d) > 1 and any(mesh.group(d) is g for g in norm_groups)}
            total.append(sq if counted_here(shared, mesh.coords) else torch.zeros_like(sq))
        sq = torch.stack(total).sum()
        for group in norm_groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(sq, group=group)
        norm = sq.sqrt().item()
        clip_to(norm, max_norm, [p.grad for opt in self.each() for _, p in opt.pieces])
        return norm

    def step(self) -> None:
        self._every("step")

    def zero_grad(self) -> None:
        self._every("zero_grad")

    def set_lr(self, lr: float) -> None:
        self._every("set_lr", lr)

    # --- stage 3's parameters outside a step (validation, checkpoints) -------------------------------
    def gather(self) -> None:
        self._every("gather")

    def release(self) -> None:
        self._every("release")

    # --- accounting and checkpoints --------------------------------------------------------------------
    def memory(self) -> dict:
        """Bytes by component, summed over the kinds: at rest, and the most held during a step."""
        out = {}
        for opt in self.each():
            for k, v in opt.memory().items():
                out[k] = out.get(k, 0) + v
        return out

    def formula(self) -> dict:
        """What chapter 01's formulas say this rank holds between steps, by component: each kind's M (its
        tensors' bytes here, unpadded) over its group's N (zero_accounting.zero_memory_components)."""
        out = {}
        for opt in self.each():
            M = sum(p.numel() * p.element_size() for params in opt.params for p in params)
            N = dist.get_world_size(opt.group)
            for k, v in zero_accounting.zero_memory_components(self.stage, M, N).items():
                out[k] = out.get(k, 0) + v
        return out

    def optim_state(self) -> dict:
        """The full (TP-local) moments by name: each kind's shards all-gathered over its group."""
        out = {}
        for opt in self.each():
            out.update(zero_accounting.gather_optim_state(opt.units, opt.pieces, opt.optimizer, opt.group, opt.comm_name))
        return out

    def load_optim_state(self, local: dict) -> None:
        """Resume: every kind's pieces take their slices of the saved (TP-local) moments."""
        for opt in self.each():
            zero_accounting.load_optim_pieces(opt.units, opt.pieces, opt.optimizer, local)
