"""The working set: what a rank holds at the peak of a step beyond its weights, gradients, AdamW moments and
saved activations (the ledger's). Measured on this CPU (calibrate_memory.py: every tensor of rank 0, counted
by common/live_memory.py), it is:

  transients    the backward of one micro-batch through a block: gradients of its activations and the
                tensors each operation makes on the way, a few of width D and a few of the MLP's. In copies
                of a micro-batch's [tokens, width] tensor, fitted on the runs (results/cpu_working_set.json):
                    a · t·D  +  b · t·F/tp                       bytes × the run's element size
  the head      on the rank that holds it, the backward of the loss: the softmax and the logits' gradient,
                h fp32 copies of [t, V/tp], fitted on one-process runs of a model whose vocabulary is far wider
                than its blocks (the course's byte vocabulary is narrower than tiny's MLP, so there the blocks'
                moment is the peak); the larger of the two moments counts
  recomputed    under full recomputation, the block whose backward runs holds its activations again, as a
                block not recomputed keeps them (one micro-batch's, the ledger's "none" less its "full":
                measured within 3 % on a held-out run, calibrate_memory.py)
  receives      chapter 03's executor posts its irecvs ahead: with gloo every receive of the step at its
                start (pipeline_executor.py, "When to post"), so a stage that is not the last holds the
                m − 1 gradients it has not consumed yet (one micro-batch's boundary tensor each); with NCCL
                one action ahead, so one. Counted, not fitted.
  the sync      a second moment, after the last backward: under ZeRO-0 the gradients copied into the
                all-reduce's buckets, the activations freed (`gradient_copy`); a rank's peak is the larger
                of the two moments (`peak_total`). Counted, not fitted.
  headroom      on a GPU, the part of its memory a run cannot use: the CUDA context and the caching
                allocator's fragmentation, stated as HEADROOM of the device (a layout fits when its total
                is within the rest); on a CPU none (no allocator cache; the operating system's pages).

t = rows × positions of one micro-batch on the rank (positions: S / cp); D the model width; F the MLP's
(a mixture: the k experts a token visits); V the vocabulary.
"""
import json
import math
from functools import lru_cache
from importlib import import_module
from pathlib import Path

from common import activation_ledger

schedule_costs = import_module("07_choosing_a_layout.schedule_costs")      # this chapter: the ledger's config

COEF_FILE = Path(__file__).resolve().parent / "results" / "cpu_working_set.json"
HEADROOM = 0.05                 # of a GPU's memory: CUDA context and the allocator's fragmentation (stated)


def terms(cfg, rows: int, positions: int, tp: int, e: int) -> tuple[float, float]:
    """(t·D, t·F/tp) in bytes: the two widths the blocks' transients are copies of."""
    t = rows * positions
    ffn = cfg.top_k * cfg.expert_hidden if cfg.n_experts else cfg.ffn_hidden // tp
    return t * cfg.dim * e, t * ffn * e


def logits(cfg, rows: int, positions: int, tp: int) -> int:
    """One fp32 [t, V/tp] tensor in bytes: the width the head's moment is copies of."""
    return rows * positions * (cfg.vocab_size // tp) * 4


def receives(boundary_bytes: int, microbatches: int, last_stage: bool, gloo: bool) -> int:
    """The receive buffers chapter 03's executor has posted and not consumed at a stage's peak."""
    if last_stage:
        return 0
    return (microbatches - 1 if gloo else 1) * boundary_bytes


@lru_cache(maxsize=None)
def load() -> tuple[float, float, float]:
    """(a, b, h): the committed calibration's copies of each width."""
    fit = json.loads(COEF_FILE.read_text())
    return fit["a"], fit["b"], fit["h"]


def of_rank(run, c, stages, pp_rank: int, gloo: bool, coef=None) -> float:
    """Pipeline rank `pp_rank`'s working set in bytes, for layout `c` of `run` (layout_costs' Run and
    Candidate), `stages` the stages it holds (the module docstring)."""
    a, b, h = coef or load()
    layout = c.layout(run.dtype)
    message = layout.message_shape(run.cfg, run.global_batch, run.seq_len, c.sequence_parallel)   # (rows, S/cp[/tp], D)
    rows, positions, e = message[0], layout.positions(run.seq_len), layout.element_size
    td, tf = terms(run.cfg, rows, positions, c.tp, e)
    peak = max(a * td + b * tf, h * logits(run.cfg, rows, positions, c.tp) if any(s.last for s in stages) else 0)
    boundary = math.prod(message) * e                                     # one pipeline message
    last = c.pp == 1 or (pp_rank == c.pp - 1 and c.virtual_stages == 1)
    return peak + recomputed(run, c, rows, positions) + receives(boundary, c.microbatches, last, gloo)


def recomputed(run, c, rows: int, positions: int) -> int:
    """Under --recompute full: one block's activations of one micro-batch, rebuilt for its backward."""
    if c.recompute != "full":
        return 0
    cfg = schedule_costs.ledger_config(run.cfg, c.tp)
    one_block = {mode: activation_ledger.microbatch_bytes(cfg, mode, rows, positions, 1, first=False, last=False,
                                                          tp=c.tp, sequence_parallel=c.sequence_parallel, cp=c.cp,
                                                          dtype=run.dtype, weight_casts=False)
                 for mode in ("none", "full")}
    return one_block["none"] - one_block["full"]


def gradient_copy(groups, zero_stage: int) -> int:
    """The bytes of the flat copy of a rank's gradients that the replicated optimizer sums (ZeRO stage 0),
    `groups` ((fp32 bytes, ranks) of each kind of state: layout_memory.state_groups): chapter 01's
    AsyncGradAllReduce copies each stage's gradients of a kind into one bucket when they are final and keeps
    every bucket until the step waits for them, so after the last backward the rank holds its gradients twice.
    A kind summed over a group of one copies nothing; ZeRO's flat buffers are the gradients themselves."""
    return 0 if zero_stage else sum(M for M, N in groups if N > 1)          # fp32, as the gradients


def peak_total(held: float, activations: float, working: float, copy: float) -> float:
    """A rank's peak: what it holds through the step (weights, gradients, AdamW) plus the larger of its two
    moments: the backward (activations in flight and the working set around them) or the gradient sync after
    it (the activations freed, the gradients' copy in their place)."""
    return held + max(activations + working, copy)


def sync_beyond(memory: dict) -> float:
    """How far a rank's gradient-sync moment rises above its backward's (0 when the backward is the peak):
    what `peak_total` adds for the sync, for the words and the bars that show it."""
    return max(0, memory.get("gradient_copy", 0) - memory["peak_activation_bytes"] - memory["working"])


def gloo(dev) -> bool:
    """Does chapter 03's executor post every receive of a step at its start (gloo: a CPU's ranks)?"""
    return dev.cores is not None


def fits(memory: dict, dev) -> bool:
    """A rank's total within the device's memory less its headroom."""
    return memory["total"] <= dev.memory * (1 - dev.headroom)
