"""A step's router statistics, summed over every rank: the same numbers in every layout.

Per MoE layer, a step's routing leaves one row of E + 3 numbers (`RoutingTally.as_row`): the slots
each expert received, the dropped slots, and the sums behind the aux and z losses. The metrics report
them, and bias balancing (--router-bias-rate) updates each layer's selection bias from them. Each rank
routed only its own rows, so the step's numbers are a sum over ranks: one all-reduce of the (L, E + 3)
float64 table over the world (the loads are integer counts, summed exactly). Then every rank updates
the biases of the layers it holds, from the same numbers, so the replicas stay equal.

    this chapter   every rank holds every layer: each fills every row with its own rows' statistics
    the 4D run     a layer's statistics are spread over the grid, and the same all-reduce still works:
                   over PP  each layer lives on one stage: the other stages hold zeros in its row
                   over TP  the TP ranks of a stage route the same tokens (after attention's all-reduce):
                            only tp rank 0 fills its rows (`counted`: common.step_protocol.counted_here
                            of statistics replicated over TP), or they would count tp times; under
                            sequence parallelism each TP rank routes its own positions: all count
                   over DP  as here: each DP rank (EP ranks included) routed its own rows
"""
import torch
import torch.distributed as dist

from common import comm
from common.moe_routing import update_selection_bias


class RouterStatistics:
    """`layers`: {global layer index: MoE layer} of the layers this rank holds, out of `n_layers`."""

    def __init__(self, layers: dict, n_layers: int, n_experts: int, options, bias_rate: float, device,
                 counted: bool = True):
        self.layers, self.n_layers, self.n_experts = layers, n_layers, n_experts
        self.options, self.bias_rate, self.device, self.counted = options, bias_rate, device, counted
        for layer in layers.values():
            layer.options = options        # the weights that make each layer's aux and z terms (moe_args)
        self.totals = None                 # (L, E + 3) of the last step, summed over all ranks

    def reset(self) -> None:
        """Forget the routing recorded so far: the next step counts only its own."""
        for layer in self.layers.values():
            layer.stats.reset()

    def sum_over_ranks(self) -> None:
        """The step's statistics of every layer, summed over all ranks; then the selection biases."""
        if not self.n_experts:                                     # a dense model: nothing to sum
            return
        rows = torch.zeros(self.n_layers, self.n_experts + 3, dtype=torch.float64)          # (L, E + 3)
        if self.counted:
            for i, layer in self.layers.items():
                rows[i] = layer.stats.as_row()
        rows = rows.to(self.device)
        comm.all_reduce(rows, group=dist.group.WORLD, name="router")
        self.totals = rows.cpu()
        if self.bias_rate > 0:                                     # aux-loss-free balancing, from the whole step
            for i, layer in self.layers.items():
                update_selection_bias(layer.selection_bias, self.totals[i, :self.n_experts], self.bias_rate)

    def metrics(self) -> dict:
        """aux_loss, z_loss, dropped_fraction, expert_load, max_over_mean_load of the last step ({} before
        the first step, or for a dense model)."""
        if self.totals is None:
            return {}
        E = self.n_experts
        load, dropped, aux, z = self.totals[:, :E], self.totals[:, E], self.totals[:, E + 1], self.totals[:, E + 2]
        per_layer_max_over_mean = load.max(dim=1).values / load.mean(dim=1)                 # (L,)
        return {"aux_loss": self.options.aux_weight * aux.sum().item(),
                "z_loss": self.options.z_weight * z.sum().item(),
                "dropped_fraction": (dropped.sum() / load.sum()).item(),
                "expert_load": load.long().tolist(),
                "max_over_mean_load": per_layer_max_over_mean.mean().item()}
