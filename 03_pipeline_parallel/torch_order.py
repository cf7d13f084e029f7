"""PyTorch's action lists for the V schedules, next to ours: the same order, rank by rank?

torch.distributed.pipelining computes every rank's list of compute actions when a schedule object is
built (`pipeline_order`, a dict rank -> list of `_Action`, with None for an idle slot) and its
runtime executes them in that order. Building the object needs live PipelineStages (processes), but
the list itself is a pure function of p and m, computed by the class's per-rank method: we call that
method with only the three numbers it reads, and translate its vocabulary into ours, kind for kind:

    torch                      ours (pipeline_actions.py)
    F    forward               F
    I    input gradient        B    (zero bubble's B)
    W    weight gradient       W
    B    full backward         BW   (B and W in one backward pass)
    OVERLAP_F_B (F, B)         Pair(F, BW) (DualPipeV's pair; torch's runtime runs the two one after the other)
    None (an idle slot)        nothing: our lists hold actions only, the waits come from the messages

`first_difference` compares the ORDER, one piece of work at a time (`in_order`: a Pair as its F, then its
BW; a BW as its B, then its W): torch leaves the very first pair of DualPipeV's last rank unpaired, and its
ZB-V writes I then W where ours runs the two as one pass, a BW, in the same place.

    python 03_pipeline_parallel/torch_order.py --pp 4 --microbatches 8     # prints both, and where they differ
"""
import argparse
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root, when run as a script

from torch.distributed.pipelining import schedules as torch_schedules   # noqa: E402

pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")
pipeline_actions = import_module("03_pipeline_parallel.pipeline_actions")
Action, Pair = pipeline_actions.Action, pipeline_actions.Pair

TORCH_CLASSES = {"zb-v": torch_schedules.ScheduleZBVZeroBubble, "dualpipev": torch_schedules.ScheduleDualPipeV}


class _Numbers:
    """What the classes' per-rank method reads of `self`: the pipeline size, the stages, the micro-batches."""

    def __init__(self, p: int, m: int):
        self.pp_group_size, self.num_stages, self._num_stages, self._n_microbatches = p, 2 * p, 2 * p, m


def _ours(action):
    """One torch compute action in our vocabulary (see the table above)."""
    kind = action.computation_type.value
    if kind == "OVERLAP_F_B":
        return Pair(*map(_ours, action.sub_actions))
    return Action({"F": "F", "I": "B", "W": "W", "B": "BW"}[kind], action.microbatch_index, action.stage_index)


def torch_schedule(name: str, p: int, m: int) -> list[list]:
    """Every rank's actions as PyTorch's class for `name` orders them, in our actions."""
    cls, numbers = TORCH_CLASSES[name], _Numbers(p, m)
    return [[_ours(a) for a in cls._calculate_single_rank_operations(numbers, r) if a is not None] for r in range(p)]


def in_order(actions: list) -> list[Action]:
    """The work of a rank's list one piece at a time, in order: a Pair as its F, then its BW; a BW as its
    B, then its W (an F without its `whole` mark)."""
    return [Action(k, a.mb, a.stage) for a in pipeline_actions.units(actions)
            for k in (("B", "W") if a.kind == "BW" else (a.kind,))]


def first_difference(ours: list, theirs: list):
    """(rank, position, our action, torch's) where the two lists' `in_order` work first differs, or None."""
    ours, theirs = [in_order(a) for a in ours], [in_order(b) for b in theirs]
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
            print(f"  rank {r}: " + " ".join(pipeline_actions.label(a) for a in acts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
