"""PyTorch's action lists for the V schedules, next to ours: the same order, rank by rank?

torch.distributed.pipelining computes every rank's list of compute actions when a schedule object is
built (`pipeline_order`, a dict rank -> list of `_Action`, with None for an idle slot) and its
runtime executes them in that order. Building the object needs live PipelineStages (processes), but
the list itself is a pure function of p and m, computed by the class's per-rank method: we call that
method with only the three numbers it reads, and translate its vocabulary into ours:

    torch                      ours (pipeline_schedules.Action)
    F    forward               F
    I    input gradient        B    (zero bubble's B)
    W    weight gradient       W
    B    full backward         B, W (one backward pass: our executor runs its two halves back to back)
    OVERLAP_F_B (F, B)         F, B, W (DualPipeV's pair; torch's runtime runs the two one after the other)
    None (an idle slot)        nothing: our lists hold actions only, the waits come from the messages

    python 03_pipeline_parallel/torch_order.py --pp 4 --microbatches 8     # prints both, and where they differ
"""
import argparse
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root, when run as a script

from torch.distributed.pipelining import schedules as torch_schedules   # noqa: E402

pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")
Action = pipeline_schedules.Action

TORCH_CLASSES = {"zb-v": torch_schedules.ScheduleZBVZeroBubble, "dualpipev": torch_schedules.ScheduleDualPipeV}


class _Numbers:
    """What the classes' per-rank method reads of `self`: the pipeline size, the stages, the micro-batches."""

    def __init__(self, p: int, m: int):
        self.pp_group_size, self.num_stages, self._num_stages, self._n_microbatches = p, 2 * p, 2 * p, m


def _ours(action) -> list:
    """One torch compute action in our vocabulary (see the table above)."""
    kind = action.computation_type.value
    if kind == "OVERLAP_F_B":
        return [b for sub in action.sub_actions for b in _ours(sub)]
    stage, mb = action.stage_index, action.microbatch_index
    return {"F": [Action("F", mb, stage)], "I": [Action("B", mb, stage)], "W": [Action("W", mb, stage)],
            "B": [Action("B", mb, stage), Action("W", mb, stage)]}[kind]


def torch_schedule(name: str, p: int, m: int) -> list[list[Action]]:
    """Every rank's actions as PyTorch's class for `name` orders them, in our Actions."""
    cls, numbers = TORCH_CLASSES[name], _Numbers(p, m)
    return [[b for a in cls._calculate_single_rank_operations(numbers, r) if a is not None for b in _ours(a)]
            for r in range(p)]


def first_difference(ours: list, theirs: list):
    """(rank, position, our action, torch's) where the two lists first differ, or None."""
    for r, (a, b) in enumerate(zip(ours, theirs)):
        for i in range(max(len(a), len(b))):
            x, y = a[i] if i < len(a) else None, b[i] if i < len(b) else None
            if x != y:
                return r, i, x, y
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args(argv)
    p, m = args.pp, args.microbatches
    for name in TORCH_CLASSES:
        ours, theirs = pipeline_schedules.build_schedule(name, p, m, 2), torch_schedule(name, p, m)
        diff = first_difference(ours, theirs)
        print(f"{name} p={p} m={m}: " + ("the same on every rank" if diff is None else
                                         "rank {} differs at action {}: ours {}, torch's {}".format(*diff)))
        for r, acts in enumerate(ours):
            print(f"  rank {r}: " + " ".join(f"{a.kind}{a.mb}.{a.stage}" for a in acts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
