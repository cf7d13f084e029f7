"""The step protocol's verbs (common/step_protocol.py) for a mixture of experts, EP inside DP (dp = edp × ep).

    optimizer = replicated_over_groups(model, mesh, lr, weight_decay)  # on the model already parallelized
    trainer = ExpertParallelTrainer(model, optimizer, mesh, args, cfg, device)
    trainer.forward_backward(x, y, sync)   the all-to-alls run inside every MoE layer, forward and backward
    trainer.sync_gradients()               the optimizer's: dense gradients over all ranks (dp), expert
                                           gradients over edp
    trainer.clip_grad_norm(max_norm)       each gradient counted once (see counted_here)
    trainer.step()                         the step's router statistics summed over all ranks, the router
                                           biases updated from them, then the optimizer's step (AdamW)
    trainer.zero_grad(), set_lr(lr), memory(), router_metrics()

The optimizer is an object handed in, with the step verbs: chapter 04's ReplicatedOptimizer, each kind of
gradient summed over its own group (`replicated_over_groups`), the same one the 4D grid trainer takes.
"""
from importlib import import_module

import torch

from common.model import loss_sum, moe_layers
from common.moe_args import routing_options
from common.training import consolidate_on_rank0

from .expert_parallel import is_expert_param
from .router_statistics import RouterStatistics

replicated_3d = import_module("04_3d_combined.replicated_3d")   # chapter 04: replicated AdamW, kinds over groups


def replicated_over_groups(model, mesh, lr: float, weight_decay: float):
    """AdamW on every tensor this rank holds (after parallelize_experts: its experts, every dense tensor),
    each kind's gradients summed over the ranks holding the same tensors, with chapter 01's flat-buffer
    all-reduce: dense over every data-parallel rank (dp), experts over the ranks holding the same experts
    (edp)."""
    named = list(model.named_parameters())
    dense = [(n, p) for n, p in named if not is_expert_param(n)]
    experts = [(n, p) for n, p in named if is_expert_param(n)]     # (a dense model has none)
    by_kind = {"dense": (dense, "dp"),           # each data-parallel rank saw its own rows
               "experts": (experts, "edp")}      # each holder of an expert saw its EP group's rows
    return replicated_3d.ReplicatedOptimizer(named, by_kind, mesh, lr, weight_decay)


class ExpertParallelTrainer:
    """`model`: this rank's experts kept (parallelize_experts); `optimizer`: the object stepping them, with
    the step verbs (`replicated_over_groups`)."""

    def __init__(self, model, optimizer, mesh, args, cfg, device):
        self.model, self.optimizer, self.mesh, self.cfg, self.device = model, optimizer, mesh, cfg, device
        self.bf16 = args.dtype == "bf16"
        self.tokens_per_step = args.global_batch * args.seq_len
        self.named = list(model.named_parameters())
        self.expert = [p for n, p in self.named if is_expert_param(n)]
        # Every gradient exists from the start, so the optimizer's flat buffers always have the same layout
        # on every rank (an expert that received no rows in a step still gets its zero gradient).
        for _, p in self.named:
            p.grad = torch.zeros_like(p)
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
        self.optimizer.grads_ready([p for _, p in self.named])   # every gradient final: each kind's all-reduce
        self.optimizer.sync_gradients()                         # waits for them

    def clip_grad_norm(self, max_norm: float) -> float:
        # The norm sums squares over the EP group, whose ranks hold different experts; a dense tensor is
        # the same on every EP rank (marked by parallelize_experts): ep rank 0 counts it. The EDP ranks
        # hold the same tensors after the sync, so the norm is never summed over them.
        return self.optimizer.clip_grad_norm(max_norm, groups=[self.mesh.group("ep")])

    def step(self) -> None:
        # One all-reduce of every layer's (load, dropped, aux, z): the whole step's statistics, the same
        # numbers in every layout; the router biases are updated from them (router_statistics.py).
        self.router.sum_over_ranks()
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        self.router.reset()

    def set_lr(self, lr: float) -> None:
        self.optimizer.set_lr(lr)

    def memory(self) -> dict:
        return {**self.optimizer.memory(), "expert_param_bytes": sum(p.numel() * p.element_size() for p in self.expert)}

    # --- what the run reports and saves ----------------------------------------------------------
    def router_metrics(self) -> dict:
        """The last step's balancing numbers, from the statistics summed over all ranks in step()."""
        return self.router.metrics()

    def full_state(self):
        """(model, optim) consolidated single-device state on global rank 0, (None, None) elsewhere.
        The ranks of edp coordinate 0 hold every expert once between them; rank 0 merges their dicts
        (the router biases and the dense weights come with each, identical)."""
        return consolidate_on_rank0(self.model, self.optimizer.optimizer, self.named,
                                    is_writer=self.mesh.coord("edp") == 0)

    def load_optim_state(self, states: dict) -> None:
        self.optimizer.load_optim_state(states)

