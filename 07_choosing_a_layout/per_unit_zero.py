"""Data parallelism alone under ZeRO-3, as chapter 01 runs it and the planner predicts it.

Chapter 04's grid gathers the whole model once per step and keeps it for every micro-batch. Chapter 01's
`ZeroStage3` (01_data_parallel/zero_stage3.py) works one unit at a time (the embedding, each block, the
final norm with the head), as FSDP does, and runs the layouts that have nothing but data parallelism
(runnable.py). Per rank, for units of u₀, u₁, … bytes (fp32) over N ranks and m micro-batches:

    weights     the 1/N shard + two neighbouring units gathered at once (one computing, the next
                prefetched: the run's peak_param_bytes) + under bf16 each matmul's cast, saved for backward
    gradients   the 1/N shard + two units in full (one being reduce-scattered, the next being flattened:
                at most one reduce-scatter is in flight)
    AdamW       the 1/N shard of the moments
    bytes       per micro-batch, each unit gathered for forward, again for backward (not the embedding:
                its backward needs no weights), its gradients reduce-scattered
    time        a unit's gather travels while the unit before it computes

tests/test_zero.py checks the bytes, the weights at the peak and what is held between steps against
chapter 01's runs.
"""
import math
from functools import lru_cache
from importlib import import_module

from common.model import parameter_shapes

zero_accounting = import_module("01_data_parallel.zero_accounting")         # chapter 01: ZeRO memory
runnable = import_module("07_choosing_a_layout.runnable")                  # this chapter: which script runs it


def runs(run, c) -> bool:
    """Does chapter 01's ZeRO-3 run layout `c` of `run` (runnable.py): one unit's weights gathered at a time."""
    return runnable.script_of(run.cfg, c) == "zero"


@lru_cache(maxsize=None)
def unit_params(cfg) -> tuple[int, ...]:
    """The parameters of each unit (zero_sharding.model_units): the embedding, each block, the final norm
    with the head, as common/model.parameter_shapes counts each piece."""
    size = {piece: sum(math.prod(shape) for shape in shapes.values()) for piece, shapes in parameter_shapes(cfg).items()}
    return (size["embedding"], *[size["block"]] * cfg.n_layers, size["head"])


def memory(units: tuple[int, ...], N: int, dtype: str, peak_activation: int) -> dict:
    """One rank's bytes by component at the peak of a step, and what it holds between steps."""
    unit_bytes, M = [4 * n for n in units], 4 * sum(units)
    between = zero_accounting.zero_memory_components(3, M, N)
    out = {"params": between["param_bytes"] + max(a + b for a, b in zip(unit_bytes, unit_bytes[1:])),
           "grads": between["grad_bytes"] + 2 * max(unit_bytes), "optim_bytes": between["optim_bytes"]}
    if dtype == "bf16":
        out["params"] += 2 * sum(units)        # each matmul's bf16 cast of its weight, saved for backward
    return {**out, "peak_activation_bytes": peak_activation, "total": sum(out.values()) + peak_activation,
            "held_between_steps": sum(between.values())}


def traffic(units: tuple[int, ...], N: int, m: int) -> tuple[int, int]:
    """(bytes sent + received, collectives) of one step on one rank."""
    unit_bytes = [4 * n for n in units]
    return int(2 * m * (N - 1) / N * (3 * sum(unit_bytes) - unit_bytes[0])), m * (3 * len(units) - 1)


def exposed(seconds: float, compute: float, n_units: int) -> float:
    """The seconds of the gathers and reduce-scatters the compute does not cover: the first unit's, and
    whatever the compute is too short for."""
    return max(seconds / n_units, seconds - compute)
