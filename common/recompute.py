"""Activation recomputation: trade compute in backward for the activations autograd keeps.

A block's backward needs tensors from its forward (the input of every matmul, the input of every
nonlinearity...); autograd keeps them from the forward until the backward uses them. Recomputation
keeps fewer of them and runs the forward again, in backward, to rebuild the rest
(`torch.utils.checkpoint`, non-reentrant: the recomputation is triggered when backward first asks
for a dropped tensor, and it works under `torch.autograd.backward(..., inputs=...)`, as zero bubble's
B needs). Three modes, `--recompute` in every training script, applied by common/model.py's Block:

    none       keep everything (the ledger's full list: common/activation_ledger.py)
    selective  recompute what is cheap and large: the two RMSNorms (their x·rms and rms) and SwiGLU's
               silu(gate); keep every matmul's input and the attention kernel's saved state
    full       keep only each block's input and run the whole block again in backward: about one
               more forward per step

Every layer type of the course is a Block (the TP, SP, pipeline-stage, MoE and EP layers replace
pieces *inside* a block), so the mode reaches them all. `--recompute-layers K` applies the mode to the
first K blocks of each pipeline stage only (the whole model is one stage without a pipeline), the others
keep everything: the lever between all and nothing that Megatron-LM calls `--recompute-num-layers` (its
"block" method). Each block recomputed frees one block's saving per micro-batch in flight and costs one
block's forward. What recomputation repeats:
  - the block's collectives (TP's f and g, EP's all-to-alls), on the groups its modules hold: the
    same groups as in the forward, in the same order on every rank;
  - its random numbers: the RNG state at the forward is restored for the recomputation
    (preserve_rng_state), so a dropout would draw the same mask (the model has none; a test adds one);
  - its side effects: a forward that records something (the MoE router's token counts) checks
    `is_recomputing()` so that it records once.
"""
import contextvars
from contextlib import contextmanager, nullcontext

import torch
from torch.utils.checkpoint import checkpoint

MODES = ("none", "selective", "full")

_cheap_ops = contextvars.ContextVar("recompute_cheap_ops", default=False)     # inside a selective block
_recomputing = contextvars.ContextVar("recomputing", default=False)          # inside a recomputation
# what a recomputation must enter first, as the forward it repeats was entered: a context factory, or None
# (ZeRO-3 sets one: the weights it gathered for the forward are gone by backward, so it gathers them again)
_around = contextvars.ContextVar("recompute_around", default=None)


@contextmanager
def _set(var: contextvars.ContextVar, value: bool):
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def recomputed_of(n_layers: int, per_stage: int | None) -> int:
    """How many of a stage's `n_layers` blocks --recompute-layers `per_stage` recomputes (None: all)."""
    return n_layers if per_stage is None else min(per_stage, n_layers)


def block_modes(mode: str, n_layers: int, per_stage: int | None = None, stages=None) -> list[str]:
    """Each block's mode: `mode` for the first `per_stage` blocks of every stage, "none" for the rest
    (per_stage None: every block). `stages`: each pipeline stage's layer indices (default: one stage)."""
    stages = stages or [range(n_layers)]
    modes = ["none"] * n_layers
    for layers in map(list, stages):
        for i in layers[:recomputed_of(len(layers), per_stage)]:
            modes[i] = mode
    return modes


def recomputed(fn, *args):
    """fn(*args) whose saved tensors are dropped after the forward and rebuilt in backward from
    `args` (which are kept), under the forward's RNG state, inside `around_recomputation`'s context if
    the forward ran under one."""
    around = _around.get()
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=lambda: (nullcontext(), _recomputation(around)))


@contextmanager
def _recomputation(around):
    with _set(_recomputing, True), (around() if around else nullcontext()):
        yield


def around_recomputation(factory):
    """Context of a forward: a recomputation of what it computes enters `factory()` first (the weights a
    forward had and its backward has not: ZeRO-3's, 01_data_parallel/zero_stage3.py; the plain linear
    layers of a whole backward pass: 03_pipeline_parallel/pipeline_executor.py). Nested, the outer
    context is entered first."""
    outer = _around.get()
    return _set(_around, factory if outer is None else lambda: _nested(outer, factory))


@contextmanager
def _nested(outer, inner):
    with outer(), inner():
        yield


def selective(on: bool):
    """Context of a block's forward: inside, `cheap(...)` pieces are recomputed (when `on`)."""
    return _set(_cheap_ops, on)


def cheap(fn, *args):
    """fn(*args): a cheap, large piece (a norm, an elementwise product), recomputed in backward when
    its block runs in selective mode, kept otherwise."""
    if torch.compiler.is_compiling():      # --compile refuses --recompute selective (common/compile.py), and the
        return fn(*args)                   # compiler cannot read a context variable: no graph break
    return recomputed(fn, *args) if _cheap_ops.get() else fn(*args)


def is_recomputing() -> bool:
    """True while backward reruns a forward: its side effects happened already."""
    return _recomputing.get()
