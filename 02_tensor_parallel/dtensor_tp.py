"""The same tensor parallelism with PyTorch's own tools, to compare side by side (`--impl torch`).

torch.distributed.tensor.parallel.parallelize_module takes a *plan*: for each submodule, a style
that says how its weight is sharded and how its inputs and outputs are laid out over a DeviceMesh.

    ColwiseParallel   weight Shard(0): our ColumnParallelLinear, f included
    RowwiseParallel   weight Shard(1): our RowParallelLinear, g (or a reduce-scatter) included
    SequenceParallel  a norm on sequence shards, Shard(1): what our --sequence-parallel does
    PrepareModuleInput   redistributes a module's input once (one all-gather for q, k and v together)
    loss_parallel()   cross-entropy on vocabulary-sharded logits: our vocab-parallel loss

DTensor decides the collectives from the placements, so the code says *what* is sharded and the
library derives *where* f and g go: the opposite of this chapter's hand-written layers. Its
collectives bypass common.comm, so this path reports no comm_bytes. Replicated KV heads (K < tp)
have no ready-made style; this path needs the KV heads to split evenly.

`DTensorTrainer` wraps it all in the verbs of tp_trainer.TPTrainer, so train_tp.py's loop runs it
unchanged.
"""
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

from common import comm
from common.errors import require
from common.model import loss_sum
from common.step_protocol import mark_replicated

from .tp_trainer import TPTrainer


class DTensorTrainer(TPTrainer):
    """TPTrainer's verbs with PyTorch's DTensor in place of this chapter's layers. Only what DTensor
    does differently is written here: the sharding plan, the loss, the gradients' layouts."""

    def parallelize(self, model, sequence_parallel: bool):
        mesh = DeviceMesh.from_group(self.tp_group, device_type=self.device.type)   # DP stays on our groups
        return parallelize_with_dtensor(model, mesh, sequence_parallel)

    def forward_backward(self, x, y, sync: bool = True):
        with loss_parallel():            # the cross-entropy on vocabulary-sharded logits, backward included
            return super().forward_backward(x, y, sync)

    def loss_sum(self, logits, targets):
        return loss_sum(logits, targets)       # (B, S, V) DTensor, Shard(-1): never gathered

    def sync_gradients(self) -> None:
        settle_grads(self.model)                       # DTensor's gradient layouts (SP norms: all-reduce)
        allreduce_dp(self.model, self.dp_group)        # data parallelism over our own group


    @staticmethod
    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def to_full(self, name, t):
        return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()

    def to_local(self, name, full):
        """A full tensor laid out like the parameter `name` (for AdamW moments on resume)."""
        p = self.params[name]
        if not isinstance(p, DTensor):
            return full
        return distribute_tensor(full.to(p.device_mesh.device_type), p.device_mesh, p.placements)


def parallelize_with_dtensor(model, mesh: DeviceMesh, sequence_parallel: bool = False):
    tp = mesh.size()
    require(model.cfg.n_kv_heads % tp == 0, f"--impl torch needs the {model.cfg.n_kv_heads} KV heads to split "
                                            f"over --tp {tp} (no replicated-KV style); use --impl ours")
    between = Shard(1) if sequence_parallel else Replicate()     # the residual stream's layout
    for block in model.layers:
        plan = {
            "attn": PrepareModuleInput(input_layouts=(between, None, None),
                                       desired_input_layouts=(Replicate(), None, None)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=between),
            "mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            "mlp.w_gate": ColwiseParallel(), "mlp.w_up": ColwiseParallel(),
            "mlp.w_down": RowwiseParallel(output_layouts=between),
        }
        if sequence_parallel:
            plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
        parallelize_module(block, mesh, plan)
        # The attention reshapes by its head counts: the local counts now (DTensor gives local outputs).
        block.attn.n_heads //= tp
        block.attn.n_kv_heads //= tp
    top = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
           "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)}
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for p in model.parameters():       # what every TP rank holds whole: counted once (common.step_protocol)
        if not (isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)):
            mark_replicated(p, "tp", tp)
    return model


def settle_grads(model) -> None:
    """Give each gradient its parameter's layout. DTensor leaves some as they came out of backward:
    the embedding's as Replicate (the whole V×D table on every rank), SP norms' as Partial (each
    rank's share of a sum). The optimizer would fix that lazily; the gradient norm needs it now.
    Replicate -> Shard is a local slice; Partial -> Replicate is an all-reduce (our SP grad sync)."""
    for p in model.parameters():
        if isinstance(p, DTensor) and p.grad is not None and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def allreduce_dp(model, dp_group) -> None:
    """Data parallelism over our own group: all-reduce each local gradient shard (chapter 01's naive
    all-reduce, on the DTensors' local tensors)."""
    if dist.get_world_size(dp_group) > 1:
        for p in model.parameters():
            if p.grad is not None:
                comm.all_reduce(DTensorTrainer.local(p.grad), group=dp_group, name="dp")
