"""One training step of tensor parallelism (with data parallelism around it), behind the step verbs.

`train_tp.py` drives a trainer through the verbs of common/step_protocol.py, in one straight loop:
`TPTrainer` (this chapter's layers) or `dtensor_tp.DTensorTrainer` (PyTorch's DTensor, the same
verbs), chosen once before the loop.

Where the communication happens:
- inside `forward_backward`: the f and g of every block (tp_layers.py), the vocab-parallel loss;
- in `sync_gradients`: what TP leaves to do after backward (SP norm gains, replicated KV heads),
  then chapter 01's all-reduce over the data-parallel group;
- in `clip_grad_norm`: one all-reduce of a scalar over the TP group (the squared norms of the slices).
"""
from importlib import import_module

import torch
import torch.distributed as dist

from common.optim import build_adamw, clip_by_global_norm
from common.step_protocol import OptimizerVerbs, counted_here, replicas
from common.training import load_optim_state_by_name, optim_state_by_name

from . import tensor_parallel

data_parallel = import_module("01_data_parallel.data_parallel")


class TPTrainer(OptimizerVerbs):
    """TP over `tp_group`, DP over `dp_group` (a group of one when there is no DP).

    `model` is the FULL single-device model (built from the seed, or loaded from a checkpoint), the
    same on every rank: the trainer replaces its layers by their TP shards, in place, and builds
    AdamW on the slices. The loss is summed over tokens and divided by `tokens_per_step`, the
    global token count, so gradients add up across DP ranks and micro-batches.
    """

    def __init__(self, model, tp_group, dp_group, *, sequence_parallel: bool, lr: float,
                 weight_decay: float, tokens_per_step: int, device: torch.device, bf16: bool = False):
        self.tp_group, self.dp_group, self.device, self.bf16 = tp_group, dp_group, device, bf16
        self.tp_rank, self.tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
        self.coords = {"tp": self.tp_rank}                 # where this rank sits, for counted_here
        self.n_kv_heads, self.tokens_per_step = model.cfg.n_kv_heads, tokens_per_step
        self.model = self.parallelize(model, sequence_parallel)
        self.named = list(self.model.named_parameters())
        self.params = dict(self.named)
        self.optimizer = build_adamw(self.named, lr, weight_decay)

    def parallelize(self, model, sequence_parallel: bool):
        return tensor_parallel.parallelize_model(model, self.tp_group, sequence_parallel)

    def loss_sum(self, local_logits, targets):
        return tensor_parallel.tp_loss_sum(local_logits, targets, self.tp_group)   # (B, S, V/tp) never gathered

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
            loss = self.loss_sum(logits, y) / self.tokens_per_step
            loss.backward()
        return self.local(loss).detach()                          # the same on every TP rank

    def sync_gradients(self) -> None:
        # TP: the gradients that are partial sums over the TP group after backward: norm gains with
        # sequence parallelism (each rank saw S/tp tokens) and KV heads replicated over tp/K ranks.
        tensor_parallel.sync_tp_gradients(self.model, self.tp_group)
        # DP (chapter 01): every rank of the DP group holds the same slices, each rank's gradient
        # from its rows of the batch: sum them, one all-reduce per gradient tensor.
        data_parallel.allreduce_gradients(self.model, self.dp_group)

    def clip_grad_norm(self, max_norm: float) -> float:
        # Each gradient element counted once within the TP group; DP replicas agree already.
        params = list(self.model.parameters())
        counted = [self.local(p.grad) for p in params if p.grad is not None and counted_here(replicas(p), self.coords)]
        every = [self.local(p.grad) for p in params]
        return clip_by_global_norm(counted, max_norm, groups=[self.tp_group], all_grads=every)

    def memory(self) -> dict:
        """Bytes held by this rank: its slices of the weights, their gradients, AdamW's two moments."""
        def nbytes(tensors):
            return sum(self.local(t).numel() * t.element_size() for t in tensors if t is not None)
        moments = [t for st in self.optimizer.state.values() for k, t in st.items() if k != "step"]
        return {"param_bytes": nbytes(self.params.values()),
                "grad_bytes": nbytes(p.grad for p in self.params.values()), "optim_bytes": nbytes(moments)}

    # --- checkpoints: the consolidated single-device state, in any layout ------------------------

    @staticmethod
    def local(t):
        """This rank's part of a tensor (ours are plain tensors already; DTensor's are not)."""
        return t

    def to_full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return tensor_parallel.tp_to_full(name, t, self.tp_group, self.n_kv_heads)

    def to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return tensor_parallel.tp_to_local(name, full, self.tp_rank, self.tp_size, self.n_kv_heads)

    def full_state(self) -> tuple[dict, dict]:
        """(weights, AdamW state) as the single-device model names them. A collective in each TP group."""
        model = {name: self.to_full(name, p.detach()) for name, p in self.named}
        return model, optim_state_by_name(self.optimizer, self.named, self.to_full)

    def load_optim_state(self, states: dict) -> None:
        load_optim_state_by_name(self.optimizer, self.named, states, self.to_local)
