"""The router of a mixture-of-experts layer, and everything around it that is not an expert.

Single-device and nothing parallel, like common/model.py (whose `MoEFeedForward` calls these): chapter
05 runs the same functions on every rank and puts its all-to-all between `group_by_expert` and
`combine_experts`. One MoE feed-forward, for x of shape (B, S, D) and T = B·S tokens:

    routing = route(x, router, bias, k, capacity_factor)   which k experts per token, with what gates
    order, counts = group_by_expert(routing, E)            the kept (token, choice) slots sorted by expert
    xs = x.view(T, D)[order // k]                          (N, D): each expert's rows, one block per expert
    ys = [expert e on its block of counts[e] rows]         (N, D)
    y = combine_experts(ys, order, routing, B, S)          (B, S, D): gate-weighted sum over the k choices

Balancing statistics are taken *per sequence* (the "routing group" of GShard; DeepSeek-V3's
sequence-wise balance loss): fᵢ, Pᵢ and the capacity of each expert are computed over the S tokens of
one sequence. Every layout of the course splits the global batch by whole sequences (data-parallel
rows, micro-batches, expert-parallel ranks routing their own rows), so each statistic is computed on
one rank from the same numbers whatever the layout, and nothing needs communicating to get it, with
two exceptions that split each sequence's positions: chapter 06's context parallelism, and chapter 02's
sequence parallelism when chapter 05's run uses it; `route` then sums the per-sequence counts over the
ranks holding the sequence's other positions (`sequence_group`: cp, tp, or both).
"""
import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import comm
from common.recompute import is_recomputing


@dataclass
class Routing:
    """The router's decisions for T = B·S tokens, each sent to k experts (k "slots" per token)."""
    experts: torch.Tensor    # (T, k) long: the chosen experts, best first
    gates: torch.Tensor      # (T, k) float: combine weights, the chosen probabilities renormalised
    keep: torch.Tensor       # (T, k) bool: False where the expert was full (capacity) and dropped the slot
    aux_sum: torch.Tensor    # scalar: Σ over sequences of E·Σᵢ fᵢ·Pᵢ (differentiable through Pᵢ)
    z_sum: torch.Tensor      # scalar: Σ over tokens of logsumexp(logits)² (differentiable)
    load: torch.Tensor       # (E,) long: slots routed to each expert, before dropping
    dropped: torch.Tensor    # scalar long: slots dropped by the capacity limit


@dataclass
class RoutingOptions:
    """What the training run sets on every MoE layer (common/moe_args.py has the flags)."""
    capacity_factor: float | None = None   # None: dropless; else capacity ⌈CF·S·k/E⌉ per expert per sequence
    aux_weight: float = 0.0   # × aux_sum: α / (sequences in the step), so the layer adds α·(mean over sequences)
    z_weight: float = 0.0     # × z_sum:   β / (tokens in the step)
    sequence_group: object = None   # the ranks holding the other positions of my sequences (chapter 06's
                                    # cp group; chapter 05's tp group under sequence parallelism)
    sequence_name: str = "cp"       # the name its all-reduce's bytes are counted under (common/comm.py)


def route(x, router: torch.nn.Linear, selection_bias, top_k: int, capacity_factor=None, sequence_group=None,
          sequence_name: str = "cp") -> Routing:
    """Softmax router with top-k selection, on x: (B, S, D). Rows are whole sequences, or, with
    `sequence_group` (chapter 06's context parallelism, chapter 02's sequence parallelism in chapter 05's
    run), this rank's S positions of each sequence, the group's ranks holding the rest: the balance
    statistics are then made whole across it (see below), its bytes counted under `sequence_name`."""
    B, S, _ = x.shape
    E = router.out_features
    logits = router(x).float()                                   # (B, S, E), fp32 even under autocast
    probs = logits.softmax(dim=-1)                               # (B, S, E)
    # Selection: the k best of probs + bias. The bias (aux-loss-free balancing, DeepSeek-V3) only picks;
    # it is zero unless --router-bias-rate is set, and it never enters the gates or any gradient.
    chosen = (probs.detach() + selection_bias).topk(top_k, dim=-1).indices       # (B, S, k)
    picked = probs.gather(-1, chosen)                                            # (B, S, k)
    # The k gates are renormalised to sum to 1 (as Mixtral does): the output is a weighted *average*
    # of the chosen experts, so its scale does not shrink with E (raw top-2 of 8 softmax probabilities
    # start near 2/8), and the router still learns from the LM loss through the ratio of the gates
    # (with k = 1 that ratio is always 1: the router would then learn only from the balancing losses).
    gates = picked / picked.sum(dim=-1, keepdim=True)                            # (B, S, k)

    # Switch/GShard balance loss per sequence: fᵢ = share of its S·k slots that chose expert i (a count,
    # no gradient), Pᵢ = mean probability of expert i over its S tokens (differentiable). Uniform routing
    # gives fᵢ = Pᵢ = 1/E and E·Σᵢ fᵢPᵢ = 1, so α times it is exactly α.
    per_sequence = F.one_hot(chosen, E).sum(dim=(1, 2))                          # (B, E) slots per expert
    # Under context (or sequence) parallelism each of the group's `parts` ranks holds S of the sequence's
    # parts·S tokens. fᵢ (a count, no gradient) is summed over the group; Pᵢ's mean over the sequence is the
    # sum of each rank's mean over its S tokens divided by parts. E·Σᵢ fᵢPᵢ is linear in P: the ranks' terms
    # add up to the sequence's, and so do their gradients (summed over dp × cp like every other, and over
    # tp under sequence parallelism).
    whole, parts = per_sequence, 1
    if sequence_group is not None and dist.get_world_size(sequence_group) > 1:
        whole, parts = per_sequence.clone(), dist.get_world_size(sequence_group)
        comm.all_reduce(whole, sequence_group, name=sequence_name)               # (B, E) the whole sequence's
    f = whole.float() / (S * parts * top_k)                                      # (B, E)
    P = probs.mean(dim=1) / parts                                                # (B, E) my tokens' share
    aux_sum = (E * (f * P).sum(dim=-1)).sum()
    # Router z-loss (ST-MoE): keeps the logits small, so the softmax stays out of fp32/bf16 trouble.
    z_sum = torch.logsumexp(logits, dim=-1).pow(2).sum()
    keep = capacity_mask(chosen, E, capacity_factor)                             # (B, S, k)
    return Routing(chosen.reshape(B * S, top_k), gates.reshape(B * S, top_k), keep.reshape(B * S, top_k),
                   aux_sum, z_sum, per_sequence.sum(dim=0), (~keep).sum())


def capacity_mask(chosen, n_experts: int, capacity_factor=None):
    """Which slots fit: each expert takes at most ⌈CF·S·k/E⌉ slots of each sequence. chosen: (B, S, k).

    Priority by position, as in the Switch Transformer: an expert serves the sequence's tokens in order
    until it is full. (GShard serves every token's first choice before any second choice. Then the order
    of a token's own top-2 decides drops, and when its two best scores are equal to within round-off,
    two layouts of the same run can order them differently; by position, only which experts a token
    chose matters.) A dropped slot adds nothing to its token's output: the token keeps its other
    choice(s), and if every one is dropped it passes through the block's residual connection alone.
    """
    if capacity_factor is None:                                  # dropless: every slot is kept
        return torch.ones_like(chosen, dtype=torch.bool)
    B, S, k = chosen.shape
    capacity = expert_capacity(capacity_factor, S, k, n_experts)
    one_hot = F.one_hot(chosen.reshape(B, S * k), n_experts)     # (B, S·k, E), slots in token order
    place = (one_hot.cumsum(dim=1) * one_hot).sum(dim=-1) - 1    # (B, S·k): 0-based place in its expert's queue
    return (place < capacity).view(B, S, k)                      # (B, S, k)


def expert_capacity(capacity_factor: float, S: int, k: int, n_experts: int) -> int:
    """⌈CF·S·k/E⌉, the slots one expert takes of one sequence, in exact arithmetic.

    In floats the product can land just above a whole number that it equals exactly: 1.1·50·2/10 is
    11.000000000000002 in float64, so math.ceil gives 12 (and the float 1.1 itself is a little above
    1.1). CF is read as the decimal the float prints as (str(1.1) == '1.1', the shortest decimal that
    gives back the same float), which is what a user types on the command line, and the rest is
    fractions. A CF computed in code rather than typed keeps its own float error in that decimal
    (0.1 + 0.2 prints as 0.30000000000000004, just above 0.3), so pass CF as the decimal you mean.
    """
    return math.ceil(Fraction(str(float(capacity_factor))) * S * k / n_experts)


def group_by_expert(routing: Routing, n_experts: int):
    """The kept slots sorted by expert. Slot s is choice s % k of token s // k (slots are (T·k,) flat).

    Returns order (N,): slot ids, expert 0's first, and within an expert in token order (a stable
    sort), and counts (E,): how many of the N rows go to each expert.
    """
    flat = routing.experts.flatten()                             # (T·k,)
    kept = routing.keep.flatten().nonzero().squeeze(1)           # (N,) kept slot ids, ascending
    order = kept[torch.argsort(flat[kept], stable=True)]         # (N,)
    counts = torch.bincount(flat[kept], minlength=n_experts)     # (E,)
    return order, counts


def combine_experts(ys, order, routing: Routing, B: int, S: int):
    """Put each expert output back in its slot and sum a token's k slots, weighted by the gates.

    ys: (N, D) outputs in `order`. Dropped slots stay zero. Returns (B, S, D).
    """
    T, k = routing.experts.shape
    slots = ys.new_zeros(T * k, ys.shape[-1]).index_copy(0, order, ys)          # (T·k, D)
    y = (slots.view(T, k, -1) * routing.gates.unsqueeze(-1)).sum(dim=1)         # (T, D)
    return y.view(B, S, -1).to(ys.dtype)


def router_loss(routing: Routing, options: RoutingOptions):
    """This layer's share of the balancing terms of the step's objective (a scalar)."""
    return options.aux_weight * routing.aux_sum + options.z_weight * routing.z_sum


class AddRouterLoss(torch.autograd.Function):
    """Return y unchanged; in backward also send gradient 1 into `loss` (Megatron-LM's MoEAuxLossAutoScaler).

    Calling backward on the language-model loss then trains the router as if `loss` had been added to
    the objective. Adding it here instead of at the end means nothing else has to collect the layers'
    terms: gradient accumulation, and pipeline stages that run several micro-batches' forwards before
    their backwards, need no change. The metrics report the terms from each layer's RoutingTally.
    """

    @staticmethod
    def forward(ctx, y, loss):
        ctx.loss_shape = loss.shape
        return y

    @staticmethod
    def backward(ctx, grad_y):
        return grad_y, torch.ones(ctx.loss_shape, device=grad_y.device)


class RoutingTally:
    """One layer's running counts of this step's routing on this rank (every micro-batch since the last
    reset): slots per expert, dropped slots, and the sums behind the aux and z losses. For the metrics
    and the bias update; the trainer sums every layer's tally over all ranks once per step."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts
        self.reset()

    def reset(self):
        self.load = torch.zeros(self.n_experts, dtype=torch.float64)        # slots per expert
        self.dropped = torch.zeros((), dtype=torch.float64)                 # slots dropped
        self.aux_sum = torch.zeros((), dtype=torch.float64)
        self.z_sum = torch.zeros((), dtype=torch.float64)

    def add(self, routing: Routing):
        if is_recomputing():         # backward reruns the forward (--recompute): these tokens are counted
            return
        self.load += routing.load.detach().cpu().double()
        self.dropped += routing.dropped.detach().cpu().double()
        self.aux_sum += routing.aux_sum.detach().cpu().double()
        self.z_sum += routing.z_sum.detach().cpu().double()

    def as_row(self) -> torch.Tensor:
        """(E + 3,) float64: load, dropped, aux_sum, z_sum (one all-reduce sums every layer's rows)."""
        return torch.cat([self.load, self.dropped.view(1), self.aux_sum.view(1), self.z_sum.view(1)])


def update_selection_bias(selection_bias, load, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): b += γ·sign(mean load − load), from the whole step's load.

    An overloaded expert's bias falls, so it is chosen less next step; an idle one's rises. Only the
    selection sees the bias, so the gates and the gradients stay those of the plain softmax router.
    """
    load = load.to(selection_bias.device, torch.float32)
    selection_bias += rate * torch.sign(load.mean() - load)
