"""A pipeline schedule's part of a layout's numbers: its stages, the activations each rank keeps in flight,
and each rank's messages, read off chapter 03's own schedules (the actions every rank of a run executes).

A long step is read off its steady part: a schedule of thousands of micro-batches (DeepSeek-V3's 15,360 on
one data-parallel rank) holds millions of actions, but what the planner needs of it stops changing once the
warm-up is over (steady_microbatches).
"""
from dataclasses import replace
from functools import lru_cache
from importlib import import_module

from common import activation_ledger

pipeline_stages = import_module("03_pipeline_parallel.pipeline_stages")     # chapter 03: stages
pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")  # chapter 03: actions
pipeline_executor = import_module("03_pipeline_parallel.pipeline_executor")    # chapter 03: messages


def ledger_config(cfg, tp: int):
    """The ledger counts dense blocks: a mixture is read as a dense block whose SwiGLU is the k experts
    a token visits (whole on each TP rank: the width is multiplied back by tp)."""
    return replace(cfg, n_experts=0, ffn_hidden=cfg.top_k * cfg.expert_hidden * tp) if cfg.n_experts else cfg


@lru_cache(maxsize=None)
def specs_for(cfg, pp: int, v: int, seq_len: int, schedule: str = "1f1b") -> list:
    """The p·v stages, each on its rank: a loop (stage k on rank k % p), or a V (zb-v, dualpipev)."""
    return pipeline_stages.stage_specs(cfg, pp, v, seq_len, pipeline_schedules.stage_ranks(schedule, pp, v))


@lru_cache(maxsize=None)
def plan_for(schedule: str, pp: int, m: int, v: int) -> list:
    return pipeline_schedules.build_schedule(schedule, pp, m, v)


def steady_microbatches(pp: int, m: int) -> int:
    """The micro-batches of the schedule the planner builds for a step of m: at most 4·pp. Each of chapter 03's
    schedules has the most micro-batches in flight by the end of its warm-up (within 2·pp micro-batches), and
    4·pp is valid wherever m is (a multiple of pp, at least 2·pp), so a rank's activation peak at m is its peak
    at min(m, 4·pp) and its messages are m times one micro-batch's (tests/test_schedule_costs.py checks
    both against whole schedules). A schedule of DeepSeek-V3's 15,360 micro-batches per data-parallel rank would
    hold millions of actions."""
    return min(m, 4 * pp)


@lru_cache(maxsize=None)
def rank_messages(schedule: str, pp: int, m: int, v: int, rank: int = 0) -> int:
    """Pipeline rank `rank`'s messages in a step of m micro-batches: m times those of one micro-batch (each
    crosses the same stage boundaries), counted on the steady schedule."""
    few = steady_microbatches(pp, m)
    plan = plan_for(schedule, pp, few, v)
    count = pipeline_executor.message_count(plan[rank], pp * v, pp, pipeline_schedules.placement(plan))
    return count * m // few


def fullest_candidates(specs, pp: int) -> list[int]:
    """The pipeline ranks whose activations can peak highest: the first two keep the most micro-batches in
    flight, the last holds the loss's (B, S, V) logits, and a middle rank holding more layers than the
    others may outweigh its fewer micro-batches (the first such rank keeps the most of them)."""
    layers = [sum(len(s.layers) for s in pipeline_stages.rank_stages(specs, pp, r)) for r in range(pp)]
    return sorted({0, min(1, pp - 1), pp - 1, layers.index(max(layers))})


@lru_cache(maxsize=None)
def activation_peaks(cfg, mode: str, schedule: str, pp: int, m: int, v: int, rows: int, seq_len: int,
                     positions: int, tp: int, sp: bool, dtype: str = "fp32",
                     recomputed: int | None = None, cp: int = 1,
                     gathered_kv: bool = False) -> tuple[tuple[int, int], ...]:
    """((pipeline rank, its peak activation bytes), ...) of the ranks that can peak highest, from the
    ledger in the run's dtype and the schedule's actions (common/activation_ledger.pipeline_peaks), read off the
    steady schedule (steady_microbatches). `gathered_kv`: chapter 06's all-gather attention over `cp` ranks
    keeps every rank's K/V for backward."""
    specs, plan = specs_for(cfg, pp, v, seq_len, schedule), plan_for(schedule, pp, steady_microbatches(pp, m), v)
    ranks = fullest_candidates(specs, pp)
    peaks = activation_ledger.pipeline_peaks(ledger_config(cfg, tp), mode, [plan[r] for r in ranks], specs, rows,
                                             positions, tp, sp, cp=cp, gathered_kv=gathered_kv, dtype=dtype,
                                             weight_casts=False, recomputed=recomputed)
    return tuple(zip(ranks, peaks))
