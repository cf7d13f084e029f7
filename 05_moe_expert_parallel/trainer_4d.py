"""The step protocol for DP × TP × PP × EP: chapter 04's Trainer3D, plus the experts.

What the experts change in chapter 04's verbs, and nothing else:

    forward_backward(x, y)  the same schedule; inside each MoE layer, this chapter's all-to-alls (over
                            ep); its balancing terms join that stage's backward (AddRouterLoss), so
                            their gradient starts on the stage that computed them, inside the same B
                            (or W) as the micro-batch's other gradients
    sync_gradients()        chapter 04's: the optimizer sums the dense gradients over the dense group (dp:
                            every data-parallel rank saw its own rows) and an expert's over the expert
                            group (edp: the dp ranks holding that expert, each of which saw its EP
                            group's rows); then TP's sums
    clip_grad_norm(max)     the squares summed over ep too (its ranks hold different experts); a dense
                            tensor, the same on every ep rank, counted once (parallelize_experts marks it)
    step()                  the router statistics summed over every rank (router_statistics.py: loads,
                            aux and z terms, the bias update), then the optimizer's step

The optimizer is chapter 04's, passed in (trainer_3d.build_optimizer), told which names are experts
(`kind_of`): the groups of each kind come by name from the layout (`Layout4D.gradient_groups()`, the one
place that names them). Replicated AdamW all-reduces each kind over its group as soon as a stage's
gradients are final; with --zero-stage 1-3 two sharded optimizers, the dense state over the dense group
and the experts' over the expert group (DeepSeek-V3's "ZeRO-1 with EP" in miniature), reduced once, after
the schedule. One trainer class for both.
"""
from importlib import import_module

import torch

from common.moe_args import routing_options
from common.step_protocol import counted_here

from . import paired_executor
from .expert_parallel import is_expert_param
from .router_statistics import RouterStatistics

pipeline_trainer = import_module("03_pipeline_parallel.pipeline_trainer")    # chapter 03: the ledger's peaks
trainer_3d = import_module("04_3d_combined.trainer_3d")              # chapter 04: the 3D verbs


class Trainer4D(trainer_3d.Trainer3D):
    """Chapter 04's rank of the grid, whose MoE layers hold E/ep experts, stepped by `optimizer` (chapter
    04's, which sums dense gradients over the dense group and an expert's over the ranks holding the same
    experts). What the experts add: the ep group in the norm, the router's statistics around the step."""

    def __init__(self, executor, schedule, named, optimizer, mesh, microbatches: int, router: RouterStatistics,
                 predicted=None):
        super().__init__(executor, schedule, named, optimizer, mesh, microbatches, predicted)
        self.norm_groups.append(mesh.group("ep"))       # ep ranks hold different experts: their squares add up
        self.router = router                            # this rank's MoE layers' statistics

    def forward_backward(self, x, y, sync: bool = True) -> torch.Tensor:
        self.router.reset()                    # this step's routing only (validation routes too)
        return super().forward_backward(x, y, sync)

    def step(self) -> None:
        self.router.sum_over_ranks()           # the step's expert loads, aux and z terms; router biases
        super().step()                         # the optimizer's

    def router_metrics(self) -> dict:
        """aux_loss, z_loss, dropped_fraction, expert_load, max_over_mean_load ({} if dense)."""
        return self.router.metrics()


def build_trainer(model, specs, plan, mesh, layout, args, cfg, loss_fn, act_shape, device, timeline,
                  full_optim=None, twins=None) -> Trainer4D:
    """Chapter 04's pieces (AdamW on this rank's piece, the executor), plus this rank's router statistics,
    and the groups its gradients are summed over, named by the layout. `twins` (--pair-overlap): the twin
    groups DualPipeV's pairs run their backward on (paired_executor.py)."""
    named = list(model.named_parameters())
    # AdamW, or ZeRO, on each kind of state over its own group, named by the layout (`gradient_groups()`:
    # dense over dp, experts over edp; chapter 04)
    optimizer = trainer_3d.build_optimizer(named, mesh, layout, args, cfg, full_optim,
                                           kind_of=lambda name: "experts" if is_expert_param(name) else "dense")
    paired = {"executor_class": paired_executor.PairedExecutor, "twins": twins} if twins is not None else {}
    executor = trainer_3d.build_executor(model, specs, mesh, args, loss_fn, act_shape, device, timeline, **paired)
    # this rank's MoE layers under their global index (chapter 03's stages keep it): every stage fills the
    # rows of its own layers; the TP ranks of a stage route the same tokens, so tp rank 0 counts them (under
    # sequence parallelism each TP rank routes its own positions of them, and every rank counts)
    layers = {int(i): block.mlp for i, block in model.layers.items() if hasattr(block.mlp, "stats")}
    # the flags' routing options, which every MoE layer of this rank shares from here on; which ranks hold
    # the rest of each sequence is the composition's to say (here None, or tp under SP: experts_over_ep), kept
    # from the layers as it left them
    options = routing_options(args, args.global_batch, args.seq_len)
    composed = next((layer.options for layer in layers.values()), options)
    options.sequence_group, options.sequence_name = composed.sequence_group, composed.sequence_name
    router = RouterStatistics(layers, cfg.n_layers, cfg.n_experts, options, args.router_bias_rate, device,
                              counted=args.sequence_parallel or counted_here({"tp": layout.tp}, mesh.coords))
    # a dense model's activations, predicted by the ledger (None with experts: routed rows); chapter 06's
    # layout splits each sequence over cp ranks
    cp = getattr(layout, "cp", 1)
    predicted = pipeline_trainer.predicted_peaks(cfg, args, plan, specs, act_shape[0], layout.tp, args.sequence_parallel,
                                                 cp, cp > 1 and args.cp_attention == "allgather")
    return Trainer4D(executor, plan, named, optimizer, mesh, layout.microbatches, router, predicted)
