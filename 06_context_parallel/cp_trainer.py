"""One training step of context parallelism (with DP, and TP if asked, around it), behind the step verbs.

Chapter 02's TPTrainer already does everything a CP step needs but one thing: its gradient all-reduce
runs over whatever group it is given, and here that group is dp × cp (every rank holding the same
weights, each of which saw its own rows or its own positions). This trainer adds:

    the CP attention core in every block (context_parallel.attention_over_cp), put in after TP
    the activation bytes autograd saves for backward, per micro-batch (chapter 03's ActivationLedger):
    `peak_activation_bytes`, the number that context parallelism divides by cp

The loss is summed over this rank's S/cp positions and divided by the global token count (TPTrainer's
`tokens_per_step`), so the dp × cp sum of the gradients is the single-device gradient.
"""
from importlib import import_module

import torch

from .context_parallel import attention_over_cp

tp_trainer = import_module("02_tensor_parallel.tp_trainer")                  # chapter 02: TP (+ DP) verbs
measured_executor = import_module("03_pipeline_parallel.measured_executor")  # chapter 03: activation bytes


class CPTrainer(tp_trainer.TPTrainer):
    """TP over `tp_group`, CP over `cp_group`, the gradient sum over `dp_cp_group`; AdamW."""

    def __init__(self, model, tp_group, cp_group, dp_cp_group, split, variant: str, **kwargs):
        super().__init__(model, tp_group, dp_cp_group, sequence_parallel=False, **kwargs)   # my TP slices
        if split.cp > 1:
            attention_over_cp(self.model, cp_group, split, variant)
        self.ledger = measured_executor.ActivationLedger({p.untyped_storage().data_ptr() for p in self.model.parameters()})
        self.peak_activation_bytes, self.running_peak = None, 0

    def forward_backward(self, x, y, sync: bool = True) -> torch.Tensor:
        """One micro-batch (B, S/cp) of my rows and positions. What autograd saved in its forward is held
        until its backward: the step's peak is the largest of its micro-batches' (they run one by one)."""
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = super().forward_backward(x, y, sync)
        self.running_peak = max(self.running_peak, self.ledger.storage_bytes(saved))
        if sync:                      # the step's last micro-batch
            self.peak_activation_bytes, self.running_peak = self.running_peak, 0
        return loss

    def memory(self) -> dict:
        return {**super().memory(), "peak_activation_bytes": self.peak_activation_bytes}
