"""A GPU step's time from its operations (block_time.py) on a device file (device_files.py), by part.

    busy       the busiest pipeline rank's m micro-batches (rank_work: the step's critical path is that
               rank's): each block's forward, backward and what recomputation reruns
               (block_time.microbatch_ops), the embedding and the head on the ranks that hold them; split
               into `compute` (the matmuls, attention's products among them) and `memory` (norms,
               residuals, activation, RoPE, the loss: memory-bound)
    comm_tp    chapter 02's collectives of that rank in the step (layout_costs.rank_traffic), on the tier the
               TP group spans, all on the critical path; with --tp-overlap (chapter 02) only what the
               chunk matmuls do not cover, ring by ring (tp_rings.py)
    comm_ep    chapter 05's all-to-all of that rank, on the critical path
    comm_pp    chapter 03's sends and receives of that rank, each a message on the tier the pipeline spans
    bubble     (busy + tp + ep + pp) · b / (1 − b), b chapter 03's theory_bubble of the schedule
    comm_dp    DP's gradient reduction (ZeRO: reduce-scatter and all-gather) starts after a stage's last
               backward and hides behind the other stages' cool-down, the bubble: max(0, dp − bubble);
               chapter 01's per-unit ZeRO-3 prefetches the next unit while one computes
    comm_cp    the ring's K/V hops hide behind attention's own products: max(0, cp − attention); the
               all-gather variant's collectives (--cp-attention allgather) are all exposed
    comm_pp    (a tied LM head, `tied_embeddings`: its gradient all-reduced between the first and the last
               stage after the schedule, on the critical path, as Megatron-LM does before the optimizer)
    optimizer  AdamW over that rank's shard of its parameters, one pass over memory: fp32 weight, gradient,
               two moments read, weight and moments written, the bf16 copy written (30 bytes a parameter);
               before it the clip's norm reads the shard's fp32 gradients (4 bytes a parameter), and the
               gradients the rank holds are zeroed for the next step (4 bytes a parameter)

A collective on a tier takes (bytes sent + received) / 2 ÷ (the tier's one-way rate × its efficiency) +
its latency: the course counts both directions, a link carries them at once, and nccl-tests' busbw is
that rate (a ring all-reduce moves 2(N−1)/N of the tensor each way). The step is the sum of the parts.
"""
from functools import partial
from importlib import import_module
from typing import NamedTuple

from common.recompute import recomputed_of

block_time = import_module("07_choosing_a_layout.block_time")              # this chapter: one block's operations
pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")  # chapter 03: where stages live
pipeline_stages = import_module("03_pipeline_parallel.pipeline_stages")     # chapter 03: each rank's stages
schedule_costs = import_module("07_choosing_a_layout.schedule_costs")      # this chapter: the stages
per_unit_zero = import_module("07_choosing_a_layout.per_unit_zero")        # this chapter: chapter 01's ZeRO-3
tp_rings = import_module("07_choosing_a_layout.tp_rings")                  # this chapter: --tp-overlap's rings

ADAMW_BYTES = 30              # per parameter: read w, g, m, v (fp32), write w, m, v and the bf16 copy


def link_seconds(nbytes: float, messages: int, tier) -> float:
    """Seconds of `messages` collectives moving `nbytes` (sent + received) over a tier."""
    return nbytes / 2 / tier.rate + messages * tier.latency


def tier_of(span: int, gpus_per_node: int, dev):
    """The tier a group whose ranks span `span` consecutive ranks talks over: NVLink inside a node."""
    return dev.tiers[0] if span <= gpus_per_node else dev.tiers[1]


def spans(c) -> dict:
    """How many consecutive ranks each group spans on the Layout's grid (edp, ep, pp, cp, tp), TP fastest."""
    layout = c.layout()
    return {g: layout.group_span(g) for g in ("tp", "cp", "pp", "ep", "dp")}


class RankWork(NamedTuple):
    """The busiest pipeline rank's m micro-batches: the one on the step's critical path."""
    matmul: float               # seconds of its matmuls (attention's products among them)
    memory: float               # seconds of its memory-bound work
    attention: float            # seconds of attention's own products (what the ring's hops hide behind)
    pp_rank: int                # which pipeline rank it is (its collectives are the step's: layout_costs)


def rank_work(run, c, dev) -> RankWork:
    """The busiest pipeline rank's work (RankWork); computed once for the layouts that differ only where it
    does not look (their ZeRO stage, say)."""
    cfg = run.cfg
    shape, mode = rank_shape(run, c), rerun_mode(run, c)
    same_run = (repr(cfg), repr(dev.spec), shape, mode)
    key = same_run + (run.seq_len, c.pp, c.virtual_stages, c.schedule, c.recompute, c.recompute_layers,
                      c.microbatches)
    if key not in _RANK_WORK:
        _RANK_WORK[key] = _rank_work(run, c, dev, shape, mode, same_run)
    return _RANK_WORK[key]


_RANK_WORK: dict = {}


def _rank_work(run, c, dev, shape, mode: str, same_run: tuple) -> RankWork:
    cfg = run.cfg
    specs = schedule_costs.specs_for(cfg, c.pp, c.virtual_stages, run.seq_len, c.schedule)
    best = RankWork(0.0, 0.0, 0.0, 0)
    for r in range(c.pp):
        matmul = memory = attention = 0.0
        for s in pipeline_stages.rank_stages(specs, c.pp, r):
            blocks = len(s.layers)
            again = blocks_rerun(c, blocks)
            mm, mem, att = stage_seconds(cfg, shape, dev.spec, blocks, again, mode, s.first, s.last,
                                         key=same_run + (blocks, again, s.first, s.last))
            matmul, memory, attention = matmul + mm, memory + mem, attention + att
        if matmul + memory > best.matmul + best.memory:
            best = RankWork(matmul, memory, attention, r)
    m = c.microbatches
    return RankWork(m * best.matmul, m * best.memory, m * best.attention, best.pp_rank)


def rerun_mode(run, c) -> str:
    """What recomputation reruns on a GPU (block_time.rerun): the layout's mode; its full recomputation as
    the run's --full-recompute says (the course's early stop, or Megatron-LM's whole block)."""
    return "whole-block" if c.recompute == "full" and run.full_recompute == "whole-block" else c.recompute


def blocks_rerun(c, blocks: int) -> int:
    """How many of a stage's `blocks` rerun their forward under layout `c`'s recomputation."""
    return {"none": 0, "selective": blocks, "full": recomputed_of(blocks, c.recompute_layers)}[c.recompute]


def rank_shape(run, c) -> "block_time.Shape":
    """What one rank computes of one micro-batch of layout `c` (block_time.Shape)."""
    rows = run.global_batch // c.dp // c.microbatches
    return block_time.Shape(rows * run.seq_len // c.cp, run.seq_len, c.tp, c.sequence_parallel, c.ep,
                            c.layout(run.dtype).element_size, run.attention)


_STAGE_SECONDS: dict = {}     # a plan asks the same stage of the same model on the same device many times


def stage_seconds(cfg, shape, spec, blocks: int, again: int, mode: str, first: bool, last: bool, key: tuple):
    """(matmul s, memory s, attention s) of one stage's micro-batch: `blocks` blocks, `again` of them rerun
    (`mode`), the embedding and the head where they live; computed once per `key` (what it depends on)."""
    if key not in _STAGE_SECONDS:
        ops = block_time.microbatch_ops(cfg, shape, blocks, again, mode, first, last)
        _STAGE_SECONDS[key] = (*block_time.seconds(ops, spec, split=True),
                               block_time.attention_seconds(cfg, shape, spec, blocks))
    return _STAGE_SECONDS[key]


def optimizer_seconds(run, c, dev, dense: int, experts: int) -> float:
    """AdamW over what this rank updates (its dense weights over dp × cp and its experts over edp × cp from
    ZeRO-1, all of them without), the clip's norm over the same shard's gradients, and zeroing the gradients
    it holds (all of them: the full buffers until the reduce-scatter; chapter 01's per-unit ZeRO-3 its shard)."""
    layout = c.layout(run.dtype)
    groups = {kind: layout.group_size(group) for kind, group in layout.gradient_groups().items()}
    shard = (dense / groups["dense"] + experts / groups["experts"]) if c.zero_stage else dense + experts
    held = shard if per_unit_zero.runs(run, c) else dense + experts
    return (dev.spec.op_seconds("vector", 10 * shard, ADAMW_BYTES * shard)
            + dev.spec.op_seconds("vector", 2 * shard, 4 * shard)            # the norm: Σ g² of fp32 gradients
            + dev.spec.op_seconds("vector", 0, 4 * held))                     # zeroed for the next step


def tied_seconds(run, c, dev, pp_span: int, gpus_per_node: int) -> float:
    """A tied LM head's gradient (the embedding's, V/tp × D in fp32) all-reduced between the first and the last
    pipeline stage after the schedule: two ranks, each sending and receiving it once (0 without a tie, and where
    one rank holds both ends: no pipeline, or a V schedule's rank 0)."""
    if not block_time.gpt_piece(run.cfg, "tied_embeddings"):
        return 0.0
    ends = pipeline_schedules.stage_ranks(c.schedule, c.pp, c.virtual_stages)
    if ends[0] == ends[-1]:
        return 0.0
    nbytes = 2 * (run.cfg.vocab_size // c.tp) * run.cfg.dim * 4
    return link_seconds(nbytes, 1, tier_of(pp_span, gpus_per_node, dev.spec))


def cp_exposed(c, seconds: float, attention: float) -> float:
    """CP's seconds on the critical path: the ring's hops hide behind attention's own compute (what it does
    not cover shows); the all-gather runs before the attention that needs it, the reduce-scatter after."""
    return max(0.0, seconds - attention) if c.cp_attention == "ring" else seconds


def gpu_time_parts(run, c, dev, gpus_per_node: int, nbytes: dict, msgs: dict, bubble: float,
                   params: tuple[int, int], per_unit: bool, units: int) -> dict:
    """{compute, memory, bubble, comm_<group>, optimizer: seconds} of one step on a GPU; the step is their sum.
    `params`: the busiest rank's (dense, expert) parameters; `per_unit`: chapter 01's ZeRO-3 with `units` units."""
    matmul, memory, attention, _ = rank_work(run, c, dev)
    span = spans(c)
    seconds = {g: link_seconds(nbytes[g], msgs[g], tier_of(span[g], gpus_per_node, dev.spec)) for g in nbytes}
    if c.tp_overlap:            # chapter 02's --tp-overlap: each ring's hops under its chunks' matmuls
        hop = partial(link_seconds, tier=tier_of(span["tp"], gpus_per_node, dev.spec))
        seconds["tp"] = tp_rings.exposed_tp(run, c, dev, rank_shape(run, c), seconds["tp"], hop)
    critical = matmul + memory + seconds["tp"] + seconds["ep"] + seconds["pp"]
    idle = critical * bubble / (1 - bubble)
    exposed = {**seconds, "dp": max(0.0, seconds["dp"] - idle), "cp": cp_exposed(c, seconds["cp"], attention),
               "pp": seconds["pp"] + tied_seconds(run, c, dev, span["pp"], gpus_per_node)}
    if per_unit:                 # chapter 01's prefetch: a unit's gather travels while the one before computes
        exposed["dp"] = per_unit_zero.exposed(seconds["dp"], matmul + memory, units)
    return {"compute": matmul, "memory": memory, "bubble": idle, **{f"comm_{g}": t for g, t in exposed.items()},
            "optimizer": optimizer_seconds(run, c, dev, *params)}
