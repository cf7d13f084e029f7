"""One training step of context parallelism (with DP, and TP if asked, around it), behind the step verbs.

Chapter 02's TPTrainer already does everything a CP step needs: its gradient all-reduce runs over
whatever group it is given, and here that group is dp × cp (every rank holding the same weights, each
of which saw its own rows or its own positions). The loss is summed over this rank's S/cp positions
and divided by the global token count (TPTrainer's `tokens_per_step`), so the dp × cp sum of the
gradients is the single-device gradient. What this chapter adds is one step after TP: the CP core in
every attention (context_parallel.attention_over_cp), and the name of the all-reduce's bytes in the
metrics: `comm_bytes_dp_cp`, for the group it runs over. train_cp.py measures the activation bytes
around it (common/activation_meter.MeasuredActivations), the number context parallelism divides by cp.
"""
from importlib import import_module

from .context_parallel import attention_over_cp
from .ring_attention import untimed

tp_trainer = import_module("02_tensor_parallel.tp_trainer")                  # chapter 02: TP (+ DP) verbs


class CPTrainer(tp_trainer.TPTrainer):
    """TP over `tp_group`, CP over `cp_group`, the gradient sum over `dp_cp_group`; the optimizer handed in.

    `model` is already cut to this rank's TP slices and `optimizer` built on them (train_cp.py does
    both first, as train_tp.py does); the trainer puts the CP core into every attention (no parameter)."""

    def __init__(self, model, optimizer, tp_group, cp_group, dp_cp_group, split, variant: str, span=untimed,
                 **kwargs):
        super().__init__(model, optimizer, tp_group, dp_cp_group, **kwargs)
        if split.cp > 1:                # span: the ring's timer (train_cp.py --timeline), or none
            attention_over_cp(self.model, cp_group, split, variant, span)

    def comm_bytes(self) -> dict:
        """Chapter 02's bytes by group, the gradient all-reduce's named for the group it runs over: chapter
        01's collective counts it as "dp", but here its ranks are dp × cp (`comm_bytes_dp_cp`)."""
        counted = super().comm_bytes()
        return {"comm_bytes": counted["comm_bytes"], "comm_bytes_tp": counted["comm_bytes_tp"],
                "comm_bytes_dp_cp": counted["comm_bytes_dp"]}
