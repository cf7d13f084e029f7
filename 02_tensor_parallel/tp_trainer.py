"""One training step of tensor parallelism (with data parallelism around it), behind the step verbs.

`train_tp.py` drives a trainer through the verbs of common/step_protocol.py, in one straight loop:
`TPTrainer` (this chapter's layers) or `dtensor_tp.DTensorTrainer` (PyTorch's DTensor), chosen once
before the loop. The two are siblings: each implements the verbs in its own file, and what both need
(the norm with each replicated gradient counted once, the bytes a rank holds, the consolidated
checkpoint) is a function at the end of this file that both call.

Where the communication happens:
- inside `forward_backward`: the f and g of every block (tp_layers.py), the vocab-parallel loss;
- in `sync_gradients`: what TP leaves to do after backward (SP norm gains, replicated KV heads),
  then chapter 01's all-reduce over the data-parallel group;
- in `clip_grad_norm`: one all-reduce of a scalar over the TP group (the squared norms of the slices).
"""
from importlib import import_module

import torch
import torch.distributed as dist

from common import comm
from common.optim import clip_by_global_norm
from common.step_protocol import OptimizerVerbs, counted_here, replicas
from common.training import optim_state_by_name

from . import tensor_parallel

data_parallel = import_module("01_data_parallel.data_parallel")
replicated_adamw = import_module("01_data_parallel.replicated_adamw")


class TPTrainer(OptimizerVerbs):
    """TP over `tp_group`, DP over `dp_group` (a group of one when there is no DP).

    `model` is already cut: its layers are this rank's TP shards (`tensor_parallel.parallelize_model`,
    called by the script first), and `optimizer` is the optimizer object built on those slices
    (chapter 01's ReplicatedAdamW: `replicated_adamw_on`), handed in as torchtitan does. The DP
    all-reduce stays this trainer's (`sync_gradients`, after TP's sums). The loss is summed over
    tokens and divided by `tokens_per_step`, the global token count, so gradients add up across DP
    ranks and micro-batches.
    """

    def __init__(self, model, optimizer, tp_group, dp_group, *, tokens_per_step: int, device: torch.device,
                 bf16: bool = False):
        self.tp_group, self.dp_group, self.device, self.bf16 = tp_group, dp_group, device, bf16
        self.tp_rank, self.tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
        self.coords = {"tp": self.tp_rank}                 # where this rank sits, for counted_here
        self.n_kv_heads, self.tokens_per_step = model.cfg.n_kv_heads, tokens_per_step
        self.model, self.optimizer = model, optimizer
        self.named = list(self.model.named_parameters())

    # --- the step protocol ----------------------------------------------------------------------

    def forward_backward(self, x, y, sync: bool = True) -> torch.Tensor:
        """Forward and backward of one micro-batch (B, S); returns its share of the step's loss.
        `sync` changes nothing here: TP's collectives are part of forward and backward, and the DP
        all-reduce waits for `sync_gradients` anyway."""
        model = self.model
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.bf16):
            h = model.embed(x)                                    # (B, S, D), or (B, S/tp, D) with SP
            for layer in model.layers:
                h = layer(h, model.rope_cos, model.rope_sin)      # f ... g twice per block
            logits = model.head(h)                                # (B, S, V/tp): never gathered
            loss = tensor_parallel.tp_loss_sum(logits, y, self.tp_group) / self.tokens_per_step
            loss.backward()
        return loss.detach()                                      # the same on every TP rank

    def sync_gradients(self) -> None:
        # TP: the gradients that are partial sums over the TP group after backward: norm gains with
        # sequence parallelism (each rank saw S/tp tokens) and KV heads replicated over tp/K ranks.
        tensor_parallel.sync_tp_gradients(self.model, self.tp_group)
        # DP (chapter 01): every rank of the DP group holds the same slices, each rank's gradient
        # from its rows of the batch: sum them, one all-reduce per gradient tensor.
        data_parallel.allreduce_gradients(self.model, self.dp_group)

    def clip_grad_norm(self, max_norm: float) -> float:
        params = list(self.model.parameters())
        return clip_counted_once(params, [p.grad for p in params], max_norm, self.tp_group, self.coords)

    def memory(self) -> dict:
        """Bytes held by this rank: its slices of the weights, their gradients, AdamW's two moments."""
        params = [p for _, p in self.named]
        return held_bytes(params, [p.grad for p in params], adamw_moments(self.optimizer.optimizer))

    def comm_bytes(self) -> dict:
        return counted_bytes()

    # --- checkpoints: the consolidated single-device state, in any layout ------------------------

    def to_full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return tensor_parallel.tp_to_full(name, t, self.tp_group, self.n_kv_heads)

    def to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return tensor_parallel.tp_to_local(name, full, self.tp_rank, self.tp_size, self.n_kv_heads)

    def full_state(self) -> tuple[dict, dict]:
        """(weights, AdamW state) as the single-device model names them. A collective in each TP group."""
        return consolidated_state(self.named, self.optimizer.optimizer, self.to_full)

    def load_optim_state(self, states: dict) -> None:
        self.optimizer.load_optim_state(states, self.to_local)


# --- what both trainers call (this file's and dtensor_tp.DTensorTrainer), on the tensors this rank holds ---

def replicated_adamw_on(model, lr: float, weight_decay: float):
    """The optimizer object handed to either trainer: chapter 01's AdamW, replicated, on the tensors
    this rank holds once the model is cut (build it after `parallelize_model`, before the trainer)."""
    return replicated_adamw.ReplicatedAdamW(list(model.named_parameters()), lr, weight_decay)


def clip_counted_once(params, grads, max_norm: float, tp_group, coords: dict) -> float:
    """The global gradient norm, clipped to `max_norm`: `grads[i]` is this rank's part of
    `params[i]`'s gradient (None: none). Each element is counted once within the TP group
    (counted_here: a replicated gradient by its first holder); DP replicas agree already."""
    counted = [g for p, g in zip(params, grads) if g is not None and counted_here(replicas(p), coords)]
    return clip_by_global_norm(counted, max_norm, groups=[tp_group], all_grads=grads)


def held_bytes(params, grads, moments) -> dict:
    """The step protocol's `memory()` from this rank's local tensors (None: not allocated)."""
    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return {"param_bytes": nbytes(params), "grad_bytes": nbytes(grads), "optim_bytes": nbytes(moments)}


def adamw_moments(optimizer) -> list:
    """AdamW's state tensors (two moments per parameter; the step counters left out)."""
    return [t for st in optimizer.state.values() for k, t in st.items() if k != "step"]


def counted_bytes() -> dict:
    """This step's bytes on the wire as common/comm.py counted them (sent + received): all, TP, DP."""
    by_group = comm.COUNTER.by_group()
    return {"comm_bytes": comm.COUNTER.total(), "comm_bytes_tp": by_group.get("tp", 0),
            "comm_bytes_dp": by_group.get("dp", 0)}


def consolidated_state(named, optimizer, to_full) -> tuple[dict, dict]:
    """(weights, AdamW state) by single-device name; `to_full(name, t)` turns a local part into the
    full tensor (a collective in the TP group)."""
    model = {name: to_full(name, p.detach()) for name, p in named}
    return model, optim_state_by_name(optimizer, named, to_full)
