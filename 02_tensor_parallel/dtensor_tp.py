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
collectives bypass common.comm, so `comm_bytes` and `comm_bytes_tp` are null here (not measured;
`comm_bytes_dp`, our own all-reduce, is). Replicated KV heads (K < tp) have no ready-made style;
this path needs the KV heads to split evenly.

`DTensorTrainer` wraps it all in the verbs of common/step_protocol.py, side by side with
tp_trainer.TPTrainer (what both need is a function of tp_trainer.py that both call), so train_tp.py's
loop runs it unchanged.
"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

from common import comm
from common.errors import require
from common.model import loss_sum
from common.step_protocol import OptimizerVerbs, mark_replicated

from . import tp_trainer


class DTensorTrainer(OptimizerVerbs):
    """The step verbs with PyTorch's DTensor in place of this chapter's layers: the same arguments as
    TPTrainer: `model` already cut by `parallelize_with_dtensor` (a sharding plan instead of our
    layers), `optimizer` built on its DTensors; DTensor's loss, its gradients' layouts."""

    def __init__(self, model, optimizer, tp_group, dp_group, *, tokens_per_step: int, device: torch.device,
                 bf16: bool = False):
        self.tp_group, self.dp_group, self.device, self.bf16 = tp_group, dp_group, device, bf16
        self.coords = {"tp": dist.get_rank(tp_group)}       # where this rank sits, for counted_here
        self.tokens_per_step = tokens_per_step
        self.model, self.optimizer = model, optimizer
        self.named = list(self.model.named_parameters())
        self.params = dict(self.named)

    def forward_backward(self, x, y, sync: bool = True) -> torch.Tensor:
        """Forward and backward of one micro-batch (B, S); `sync` changes nothing, as in TPTrainer."""
        # loss_parallel: the cross-entropy on vocabulary-sharded logits, backward included
        with loss_parallel(), torch.autocast(self.device.type, torch.bfloat16, enabled=self.bf16):
            logits = self.model(x)                        # (B, S, V) DTensor, Shard(-1): never gathered
            loss = loss_sum(logits, y) / self.tokens_per_step
            loss.backward()
        return local(loss).detach()                       # the same on every TP rank

    def sync_gradients(self) -> None:
        settle_grads(self.model)                       # DTensor's gradient layouts (SP norms: all-reduce)
        allreduce_dp(self.model, self.dp_group)        # data parallelism over our own group

    def clip_grad_norm(self, max_norm: float) -> float:
        params = list(self.model.parameters())
        return tp_trainer.clip_counted_once(params, [local(p.grad) for p in params], max_norm,
                                            self.tp_group, self.coords)

    def memory(self) -> dict:
        params = [p for _, p in self.named]
        return tp_trainer.held_bytes([local(p) for p in params], [local(p.grad) for p in params],
                                     [local(t) for t in tp_trainer.adamw_moments(self.optimizer.optimizer)])

    def comm_bytes(self) -> dict:
        """DTensor's collectives bypass common.comm: TP's bytes (and so the total) are not measured."""
        return {**tp_trainer.counted_bytes(), "comm_bytes": None, "comm_bytes_tp": None}

    # --- checkpoints: the same consolidated single-device state as TPTrainer's -------------------

    def to_full(self, name, t):
        return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()

    def to_local(self, name, full):
        """A full tensor laid out like the parameter `name` (for AdamW moments on resume)."""
        p = self.params[name]
        if not isinstance(p, DTensor):
            return full
        return distribute_tensor(full.to(p.device_mesh.device_type), p.device_mesh, p.placements)

    def full_state(self) -> tuple[dict, dict]:
        return tp_trainer.consolidated_state(self.named, self.optimizer.optimizer, self.to_full)

    def load_optim_state(self, states: dict) -> None:
        self.optimizer.load_optim_state(states, self.to_local)


def local(t):
    """This rank's part of a tensor (a DTensor's local shard; a plain tensor, or None, as it is)."""
    return t.to_local() if isinstance(t, DTensor) else t


def parallelize_with_dtensor(model, tp_group, device: torch.device, sequence_parallel: bool = False):
    """Cut `model` in place over `tp_group` with DTensor's plan (DP stays on our own groups)."""
    mesh = DeviceMesh.from_group(tp_group, device_type=device.type)
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
                comm.all_reduce(local(p.grad), group=dp_group, name="dp")
