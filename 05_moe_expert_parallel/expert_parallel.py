"""Expert parallelism: the experts of every MoE layer split over the ranks of an EP group.

API (train_moe.py, and the 4D run's parallel_4d.py after chapter 04's TP):

    parallelize_experts(model, ep_group) -> model, in place: each MoEFeedForward becomes an
        ExpertParallelMoE that keeps only this rank's E/ep experts (under their reference names, e.g.
        layers.3.mlp.experts.5.w_up.weight) and routes this rank's own rows to every rank's experts.
    is_expert_param(name) -> is this parameter an expert's (sharded over ep, replicated over edp)?
    local_experts(n_experts, ep_rank, ep) -> the expert ids rank ep_rank holds
    expected_ep_bytes(n_layers, tokens, top_k, dim, n_experts, ep) -> the all-to-all bytes per step
        under routing that ignores where a token lives (bench_moe.py measures against it)

EP inside DP, on `common.mesh.Mesh(rank, world, edp=world//ep, ep=ep, joined={"dp": ("edp", "ep")})`:
the grid is arange(world).view(edp, ep), EP innermost (consecutive ranks: the all-to-all runs in every
layer, on the fastest links), and dp = (edp, ep) is every data-parallel rank (here: the world).
- Every dp rank takes its own rows of the global batch: EP ranks routing different tokens to each
  other's experts is the point; an EP group with one copy of the rows would send every token to every
  rank for nothing.
- Dense parameters (attention, norms, embeddings, the router) are replicated on every rank and see
  only that rank's rows: their gradients are summed over dp.
- Expert e lives on the ranks with ep coordinate e·ep/E, one per edp coordinate; each saw the rows of
  its own EP group: expert gradients are summed over edp ("the ranks holding the same experts", a
  column of the grid).
"""
import torch
import torch.nn as nn
import torch.distributed as dist

from common.compile import eager
from common.model import MoEFeedForward
from common.step_protocol import mark_replicated
from common.moe_routing import AddRouterLoss, combine_experts, group_by_expert, route, router_loss

from .moe_dispatch import all_to_all, exchange_counts, expert_major


def expected_ep_bytes(n_layers: int, tokens: int, top_k: int, dim: int, n_experts: int, ep: int,
                      element_size: int = 4, forward_runs: int = 1) -> float:
    """Bytes one rank sends + receives under "ep" per step when routing ignores where a token lives
    (each of a token's k slots leaves the rank with probability (ep−1)/ep): per MoE layer four
    exchanges (dispatch and combine, forward and backward), each moving (ep−1)/ep·T·k rows of D
    values out and as many in, plus the counts (E/ep int64 to and from each other rank, forward
    only). T = tokens this rank routes per step. The measured bytes follow the router: equal to this
    on average over balanced routing, not step by step. `forward_runs` 2: --recompute full reruns each
    block's forward in backward, its dispatch, combine and counts with it."""
    rows = (ep - 1) / ep * tokens * top_k * dim * element_size
    return n_layers * ((4 + 4 * forward_runs) * rows + forward_runs * counts_bytes(n_experts, ep))


def counts_bytes(n_experts: int, ep: int) -> int:
    """Bytes of one layer's count exchange, sent + received: E/ep int64 to and from each other rank."""
    return 16 * (ep - 1) * n_experts // ep


def local_experts(n_experts: int, ep_rank: int, ep: int) -> range:
    n_local = n_experts // ep
    return range(ep_rank * n_local, (ep_rank + 1) * n_local)


def is_expert_param(name: str) -> bool:
    return ".experts." in name


class ExpertParallelMoE(nn.Module):
    """An MoE feed-forward whose experts are spread over `ep_group`; built from the single-device layer,
    whose router, bias, options and statistics it keeps (the router is replicated: every rank routes
    its own tokens), and of whose experts it keeps this rank's."""

    def __init__(self, moe: MoEFeedForward, ep_group):
        super().__init__()
        self.group, self.ep, ep_rank = ep_group, dist.get_world_size(ep_group), dist.get_rank(ep_group)
        self.n_experts, self.top_k = moe.n_experts, moe.top_k
        self.mine = local_experts(moe.n_experts, ep_rank, self.ep)
        self.router = moe.router
        # A dict keyed by the global expert id keeps the reference parameter names (experts.5.w_up.weight)
        self.experts = nn.ModuleDict({str(e): moe.experts[e] for e in self.mine})
        self.register_buffer("selection_bias", moe.selection_bias)
        self.options, self.stats = moe.options, moe.stats

    @eager                                # --compile: eager, like the single-device MoE (common/model.py)
    def forward(self, x):                                     # (B, S, D): this rank's rows (S/tp positions under SP)
        B, S, D = x.shape
        routing = route(x, self.router, self.selection_bias, self.top_k, self.options.capacity_factor,
                        self.options.sequence_group, self.options.sequence_name)
        self.stats.add(routing)

        # 1. permute: this rank's kept slots grouped by expert, hence by destination rank
        order, counts = group_by_expert(routing, self.n_experts)                 # (N,), (E,)
        xs = x.reshape(B * S, D)[order // self.top_k]                            # (N, D)
        # 2. all-to-all of the counts: recv_counts[s, e] = rows rank s sends for my e-th expert
        recv_counts = exchange_counts(counts, self.ep, self.group)               # (ep, E/ep)
        send_splits = counts.view(self.ep, -1).sum(dim=1).tolist()               # rows to each rank
        recv_splits = recv_counts.sum(dim=1).tolist()                            # rows from each rank
        # 3. all-to-all of the rows (dispatch)
        received = all_to_all(xs, recv_splits, send_splits, self.group)          # (M, D): by source, then expert
        # 4. the local experts, each on its rows from every source
        index, per_expert = expert_major(recv_counts)                            # (M,), E/ep sizes
        chunks = received[index].split(per_expert)
        outs = torch.cat([self.experts[str(e)](rows) for e, rows in zip(self.mine, chunks)])   # (M, D)
        outs = torch.zeros_like(outs).index_copy(0, index, outs)                 # row p back to index[p]
        # 5. the reverse all-to-all (combine): every output goes back to the rank its token lives on
        ys = all_to_all(outs, send_splits, recv_splits, self.group)              # (N, D) in `order`
        # 6. unpermute and the gate-weighted sum over each token's k experts
        y = combine_experts(ys, order, routing, B, S)                            # (B, S, D)
        return AddRouterLoss.apply(y, router_loss(routing, self.options))


def parallelize_experts(model: nn.Module, ep_group) -> nn.Module:
    """Replace every MoEFeedForward of `model` by its expert-parallel shard, in place; `model` may be a
    whole Transformer or a pipeline stage's part of one (the 4D run). The other parameters, the same on
    every rank of the EP group, are marked replicated over ep (common.step_protocol.mark_replicated).

    Every rank must hold the same full weights first (build_model from the seed, or a loaded
    checkpoint): each keeps its experts, so the shards are exactly the single-device experts."""
    ep = dist.get_world_size(ep_group)
    if ep == 1:          # every expert is here and no row travels: the single-device layer is the answer
        return model
    for block in list(model.modules()):
        if isinstance(getattr(block, "mlp", None), MoEFeedForward):
            block.mlp = ExpertParallelMoE(block.mlp, ep_group)
    for name, p in model.named_parameters():     # the rest is the same on every EP rank: counted once
        if not is_expert_param(name):
            mark_replicated(p, "ep", ep)
    return model
