"""The step protocol's verbs (common/step_protocol.py) for a mixture of experts, EP inside DP (dp = edp × ep).

    trainer = ExpertParallelTrainer(model, mesh, args, cfg, device)   # model already parallelized
    trainer.forward_backward(x, y, sync)   the all-to-alls run inside every MoE layer, forward and backward
    trainer.sync_gradients()               dense gradients over all ranks (dp), expert gradients over edp
    trainer.clip_grad_norm(max_norm)       each gradient counted once (see counted_here)
    trainer.step()                         the step's router statistics summed over all ranks, the router
                                           biases updated from them, then AdamW
    trainer.zero_grad(), set_lr(lr), memory(), router_metrics()
"""
from importlib import import_module

import torch

from common.model import loss_sum, moe_layers
from common.moe_args import routing_options
from common.optim import build_adamw, clip_by_global_norm, optim_bytes, set_lr, zero_grads
from common.step_protocol import counted_here, replicas
from common.training import consolidate_on_rank0, load_optim_state_by_name

from .expert_parallel import is_expert_param
from .router_statistics import RouterStatistics

data_parallel = import_module("01_data_parallel.data_parallel")


class ExpertParallelTrainer:
    def __init__(self, model, mesh, args, cfg, device):
        self.model, self.mesh, self.cfg, self.device = model, mesh, cfg, device
        self.bf16 = args.dtype == "bf16"
        self.tokens_per_step = args.global_batch * args.seq_len
        self.named = list(model.named_parameters())
        self.dense = [p for n, p in self.named if not is_expert_param(n)]
        self.expert = [p for n, p in self.named if is_expert_param(n)]
        # The norm sums squares over the EP group, whose ranks hold different experts; a dense tensor is
        # the same on every EP rank (marked by parallelize_experts): ep rank 0 counts it. The EDP ranks
        # hold the same tensors after the sync, so the norm is never summed over them.
        self.owned = [p for _, p in self.named if counted_here(replicas(p), mesh.coords)]
        # Every gradient exists from the start, so the flat buffers below always have the same layout on
        # every rank (an expert that received no rows in a step still gets its zero gradient).
        for _, p in self.named:
            p.grad = torch.zeros_like(p)
        self.optimizer = build_adamw(self.named, args.lr, args.weight_decay)
        # Chapter 01's flat-buffer all-reduce, once per group: dense over every data-parallel rank (dp),
        # experts over the ranks holding the same experts (edp).
        self.dense_sync = data_parallel.AsyncGradAllReduce(mesh.group("dp"))
        self.expert_sync = data_parallel.AsyncGradAllReduce(mesh.group("edp"))
        # Every MoE layer of the model (each rank holds all of them, with its own experts)
        layers = dict(enumerate(moe_layers(model)))
        self.router = RouterStatistics(layers, len(layers), cfg.n_experts,
                                       routing_options(args, args.global_batch, args.seq_len),
                                       args.router_bias_rate, device)

    # --- the verbs -------------------------------------------------------------------------------
    def forward_backward(self, x, y, sync: bool = True) -> torch.Tensor:
        """x, y: (b, S) this rank's rows. Gradients are only summed in sync_gradients, so `sync` needs
        no special case: micro-batches accumulate into .grad either way."""
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.bf16):
            logits = self.model(x)                        # (b, S, V); every MoE layer: 4 all-to-alls in all
            loss = loss_sum(logits, y) / self.tokens_per_step
        loss.backward()                                   # + the balancing terms, through AddRouterLoss
        return loss.detach()

    def sync_gradients(self) -> None:
        self.dense_sync.launch(self.dense)                # all-reduce over all ranks: each saw its own rows
        if self.expert:                                   # (a dense model has none)
            self.expert_sync.launch(self.expert)          # all-reduce over the ranks holding the same experts
        self.dense_sync.wait()
        self.expert_sync.wait()

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_by_global_norm([p.grad for p in self.owned], max_norm, groups=[self.mesh.group("ep")],
                                   all_grads=[p.grad for _, p in self.named])

    def step(self) -> None:
        # One all-reduce of every layer's (load, dropped, aux, z): the whole step's statistics, the same
        # numbers in every layout; the router biases are updated from them (router_statistics.py).
        self.router.sum_over_ranks()
        self.optimizer.step()

    def zero_grad(self) -> None:
        zero_grads(self.optimizer)
        self.router.reset()

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def memory(self) -> dict:
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
        return {"param_bytes": nbytes(self.dense + self.expert), "expert_param_bytes": nbytes(self.expert),
                "grad_bytes": nbytes(p.grad for p in self.dense + self.expert),
                "optim_bytes": optim_bytes(self.optimizer)}

    # --- what the run reports and saves ----------------------------------------------------------
    def router_metrics(self) -> dict:
        """The last step's balancing numbers, from the statistics summed over all ranks in step()."""
        return self.router.metrics()

    def full_state(self):
        """(model, optim) consolidated single-device state on global rank 0, (None, None) elsewhere.
        The ranks of edp coordinate 0 hold every expert once between them; rank 0 merges their dicts
        (the router biases and the dense weights come with each, identical)."""
        return consolidate_on_rank0(self.model, self.optimizer, self.named, is_writer=self.mesh.coord("edp") == 0)

    def load_optim_state(self, states: dict) -> None:
        load_optim_state_by_name(self.optimizer, self.named, states)

