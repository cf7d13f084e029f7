"""Cutting the model into pipeline stages, balanced by cost.

A pipeline stage is a contiguous run of decoder layers; the first stage also owns the token
embedding, the last one the final norm, the LM head and the loss (with a stage or two more than layers,
the ends hold those alone: Llama 3's balanced pipeline). With v virtual stages per rank
the model is cut into p·v chunks and rank r holds chunks r, r+p, r+2p, ... (interleaving), or, for
the V schedules, the 2p chunks r and 2p-1-r (v_schedules.py): the schedule says where
(pipeline_schedules.stage_ranks), each StageSpec records it.

Balancing. The step time of a pipeline is set by its slowest stage, so stages should cost the same.
Cost here = forward FLOPs per token (2 per weight of a matmul, plus the attention scores
2·S·D per layer): every decoder layer costs the same, the embedding is a table lookup (~0 FLOPs
but its V·D parameters live on stage 0), the head is a D×V matmul plus the softmax. `partition`
chooses the contiguous split that minimises the most expensive stage (a small dynamic program).

A stage keeps the reference parameter NAMES ("layers.5.attn.wq.weight"): the model is built whole
from the seed (name-seeded init, so every layout gets the same weights), then pruned to the layers
this rank holds. Weight decay by name, checkpoints by name and resuming into another --pp all work.
"""
from dataclasses import dataclass
from functools import lru_cache

import torch.nn as nn

from common.errors import require
from common.model import ModelConfig


@dataclass(frozen=True)
class StageSpec:
    """One (virtual) stage: which layers it runs and whether it holds the embedding / the head."""
    index: int                 # global stage index in 0 .. p·v-1
    layers: tuple[int, ...]
    first: bool                # runs model.embed(tokens)
    last: bool                 # runs model.head(h) and the loss
    rank: int                  # the pipeline rank that holds it: index % p (a loop) or the V's


def layer_costs(cfg: ModelConfig, seq_len: int) -> dict:
    """Forward FLOPs per token of each piece (the cost model used for balancing)."""
    D, F, V, kv = cfg.dim, cfg.ffn_hidden, cfg.vocab_size, cfg.n_kv_heads * cfg.head_dim
    layer = 2 * (D * D + 2 * D * kv + D * D + 3 * D * F) + 2 * seq_len * D   # matmuls + causal attention
    return {"embed": 0.0, "layer": float(layer), "head": float(2 * D * V + 5 * V)}  # head: matmul + softmax/CE


def partition(cfg: ModelConfig, n_stages: int, seq_len: int) -> list[tuple[int, ...]]:
    """Contiguous split of the layers into n_stages runs (≥ 1 layer each) minimising the max stage cost. With
    one or two stages more than layers, the first stage may hold the embedding alone and the last the head
    alone (no layer): Llama 3's balanced pipeline (126 layers, 16 ranks × 8 chunks: every chunk one layer,
    the embedding and the head one chunk each)."""
    return list(_partition(cfg, n_stages, seq_len))


def most_stages(n_layers: int) -> int:
    """The most stages a model of `n_layers` layers is cut into: a layer each, and the embedding and the head
    one each (chapter 07's planner asks it too)."""
    return n_layers + 2


@lru_cache(maxsize=None)    # the same split is asked again and again by chapter 07's planner (126 layers, 16 stages)
def _partition(cfg: ModelConfig, n_stages: int, seq_len: int) -> tuple[tuple[int, ...], ...]:
    L = cfg.n_layers
    require(n_stages <= most_stages(L), f"the model has {L} layers, too few for {n_stages} stages (pp × virtual "
                                        f"stages); use fewer --pp / --virtual-stages (at most {most_stages(L)} "
                                        f"stages: a layer each, the embedding and the head one each) or a deeper "
                                        f"--model")
    c = layer_costs(cfg, seq_len)
    # the fewest layers stage k holds: one, but an end may hold none when there are more stages than layers
    least = [0 if n_stages > L and k in (0, n_stages - 1) else 1 for k in range(n_stages)]

    def cost(k: int, i: int, j: int) -> float:        # stage k holds layers i..j-1
        return (j - i) * c["layer"] + (c["embed"] if k == 0 else 0) + (c["head"] if k == n_stages - 1 else 0)

    @lru_cache(maxsize=None)
    def best(k: int, i: int) -> tuple[float, tuple[int, ...]]:
        """(max cost, cut points) for stages k.. covering layers i..L-1."""
        if k == n_stages - 1:
            return (cost(k, i, L), (L,)) if L - i >= least[k] else (float("inf"), (L,))
        options = []
        for j in range(i + least[k], L - sum(least[k + 1:]) + 1):     # leave each later stage its fewest
            rest, cuts = best(k + 1, j)
            # prefer the later cut on ties: the head makes the last stage heavier, give it fewer layers
            options.append((max(cost(k, i, j), rest), -j, (j,) + cuts))
        m, _, cuts = min(options)
        return m, cuts

    _, cuts = best(0, 0)
    bounds = (0,) + cuts
    return tuple(tuple(range(bounds[k], bounds[k + 1])) for k in range(n_stages))


def stage_specs(cfg: ModelConfig, pp: int, v: int, seq_len: int, rank_of=None) -> list[StageSpec]:
    """All p·v stages of the pipeline (every rank computes the same list). rank_of[stage]: where each
    lives (pipeline_schedules.stage_ranks; default the loop, stage k on rank k % pp)."""
    n = pp * v
    rank_of = rank_of or [k % pp for k in range(n)]
    return [StageSpec(k, layers, k == 0, k == n - 1, rank_of[k]) for k, layers in enumerate(partition(cfg, n, seq_len))]


def rank_stages(specs: list[StageSpec], pp: int, pp_rank: int) -> list[StageSpec]:
    """The stages a rank holds, by index: r, r+p, r+2p, ... (a loop), or r and 2p-1-r (a V)."""
    return [s for s in specs if s.rank == pp_rank]


def partition_table(cfg: ModelConfig, specs: list[StageSpec], pp: int, seq_len: int) -> list[dict]:
    """Rows for the console table: stage, rank, layers, parameters, cost share."""
    c = layer_costs(cfg, seq_len)
    D, F, V, kv = cfg.dim, cfg.ffn_hidden, cfg.vocab_size, cfg.n_kv_heads * cfg.head_dim
    layer_params = D * D + 2 * D * kv + D * D + 3 * D * F + 2 * D
    costs = [len(s.layers) * c["layer"] + (c["head"] if s.last else 0) for s in specs]
    rows = []
    for s, cost in zip(specs, costs):
        params = len(s.layers) * layer_params + (V * D if s.first else 0) + (V * D + D if s.last else 0)
        parts = (["embed"] if s.first else []) + ([f"layers {s.layers[0]}-{s.layers[-1]}"] if s.layers else []) + (
            ["norm+head+loss"] if s.last else [])
        rows.append({"stage": s.index, "rank": s.rank, "holds": " + ".join(parts), "params": params,
                     "cost": cost / sum(costs)})
    return rows


class SparseLayers(nn.ModuleDict):
    """The layers a stage keeps, still indexed (and named) by their position in the full model:
    `layers[5]` is layer 5 and its weights are "layers.5.…", as in the single-device model."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__({str(i): layer for i, layer in layers.items()})

    def __getitem__(self, i):
        return super().__getitem__(str(i))


def prune_to_stages(model: nn.Module, specs: list[StageSpec]) -> nn.Module:
    """Keep only what the stages `specs` need of a full model (in place); reference parameter names survive.

    Works on any model with the Transformer's attribute layout (tok_emb, layers, norm, lm_head),
    including one whose layers were already made tensor-parallel.
    """
    keep = sorted(i for s in specs for i in s.layers)
    model.layers = SparseLayers({i: model.layers[i] for i in keep})
    if not any(s.first for s in specs):
        model.tok_emb = None
    if not any(s.last for s in specs):
        model.norm = None
        model.lm_head = None
    return model


def stage_forward(model: nn.Module, spec: StageSpec, x):
    """One stage's forward: tokens (mb, S) or hidden (mb, S, D) in; hidden (mb, S, D) or logits out.

    Only `model.embed`, `model.layers[i]` and `model.head` are used, so a model whose layers were
    made tensor-parallel (chapter 04) runs here unchanged (its head may return vocab-local logits).
    """
    h = model.embed(x) if spec.first else x                           # (mb, S, D)
    for i in spec.layers:
        h = model.layers[i](h, model.rope_cos, model.rope_sin)        # (mb, S, D)
    return model.head(h) if spec.last else h                          # (mb, S, V) on the last stage
