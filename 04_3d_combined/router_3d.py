"""Chapter 05's router statistics on the 4D grid: the same numbers as train_moe.py, whatever the layout.

A step's routing statistics (per layer: slots per expert, dropped slots, the aux and z sums) are
what the metrics report and what bias balancing (--router-bias-rate) updates from. In chapter 05 every
rank holds every layer and its own rows, so one all-reduce of the (L, E + 3) table over the world
sums them. On the 4D grid a layer's statistics are spread three ways:

    over PP    each MoE layer lives on one pipeline stage: the other stages hold zeros in its row
    over TP    the TP ranks of a stage route the same tokens (after the attention's all-reduce), so they
               hold the same statistics: only tp rank 0 puts them in the table, or they count tp times
    over DP    each DP rank (EP ranks included) routed its own rows: their statistics add up

So every rank fills the rows of its own layers (tp rank 0 only), zeros elsewhere, and one all-reduce
over the world of the (L, E + 3) float64 table gives every rank the whole step's statistics; the
loads are integer counts, summed exactly. Every rank then updates the biases of the layers it holds
(the same numbers on every replica), and `metrics()` is chapter 05's `router_metrics` of the table.
"""
from importlib import import_module

import torch
import torch.distributed as dist

from common import comm
from common.moe_args import routing_options
from common.moe_routing import RouterStats, update_selection_bias

moe_trainer = import_module("05_moe_expert_parallel.moe_trainer")


class RouterStatistics:
    """The MoE layers of one rank's piece (by global layer index) and the step's summed statistics."""

    def __init__(self, model, args, tp_rank: int, device):
        self.n_layers, self.device, self.counts_here = model.cfg.n_layers, device, tp_rank == 0
        self.n_experts, self.bias_rate = model.cfg.n_experts, args.router_bias_rate
        # model.layers holds this rank's layers under their global index (chapter 03's SparseLayers)
        self.layers = {int(i): block.mlp for i, block in model.layers.items()
                       if isinstance(getattr(block.mlp, "stats", None), RouterStats)}
        # The weights that make each layer's terms α·(mean over the step's sequences), β·(mean over tokens)
        self.options = routing_options(args, args.global_batch, args.seq_len)
        for layer in self.layers.values():
            layer.options = self.options
        self.totals = None                                   # (L, E + 3) of the last step, all ranks summed

    def reset(self) -> None:
        for layer in self.layers.values():
            layer.stats.reset()

    def sum_over_ranks(self) -> None:
        """The step's statistics of every layer, summed over all ranks (a no-op for a dense model)."""
        if not self.n_experts:
            return
        rows = torch.zeros(self.n_layers, self.n_experts + 3, dtype=torch.float64)          # (L, E + 3)
        if self.counts_here:
            for i, layer in self.layers.items():
                rows[i] = layer.stats.as_row()
        rows = rows.to(self.device)
        comm.all_reduce(rows, group=dist.group.WORLD, name="router")
        self.totals = rows.cpu()
        if self.bias_rate > 0:                               # aux-loss-free balancing: from the whole step
            for i, layer in self.layers.items():
                update_selection_bias(layer.selection_bias, self.totals[i, :self.n_experts], self.bias_rate)

    def metrics(self) -> dict:
        if self.totals is None:
            return {}
        return moe_trainer.router_metrics(self.totals, self.options, self.n_experts)
