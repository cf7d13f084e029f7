"""The step protocol for DP × TP × PP × EP × CP: chapter 05's Trainer4D, with CP's gradient groups.

What CP changes in chapter 05's verbs, and nothing else:

    forward_backward(x, y)  the same schedule on (rows, S/cp) micro-batches; inside each attention, the
                            ring's (or all-gather's) messages over cp; inside each MoE layer, the
                            per-sequence expert counts summed over cp (common/moe_routing.route)
                            when a stage's gradients are final: dense ones all-reduced over dp × cp
                            (every rank holding those weights saw its own rows or positions), an
                            expert's over edp × cp (the ranks holding that expert)
    clip_grad_norm(max)     unchanged: after the sum, the CP ranks hold the same gradients
"""
from importlib import import_module

trainer_4d = import_module("05_moe_expert_parallel.trainer_4d")      # chapter 05: the 4D verbs


class Trainer5D(trainer_4d.Trainer4D):
    grad_dim = "dp_cp"           # dense gradients: every rank with the same stage and TP shard
    expert_grad_dim = "edp_cp"   # an expert's: every rank holding it


def build_trainer(model, specs, plan, mesh, layout, args, cfg, loss_fn, act_shape, device, timeline,
                  full_optim=None) -> Trainer5D:
    """Chapter 05's trainer, as Trainer5D; the routers learn which group holds the rest of each sequence."""
    trainer = trainer_4d.build_trainer(model, specs, plan, mesh, layout, args, cfg, loss_fn, act_shape, device,
                                       timeline, full_optim, trainer_class=Trainer5D)
    if layout.cp > 1:
        trainer.router.options.sequence_group = mesh.group("cp")
    return trainer
