"""What a pipeline rank can be told to do: the actions of a schedule, each kind named.

A schedule (pipeline_schedules.py, v_schedules.py) is every rank's list of these; the executor, the
paper simulator, chapter 05's paired executor and the comparison with PyTorch's lists read the kind of
an action, never its neighbours in the list. The kinds (PyTorch's `_ComputationType` in brackets):

    F(mb, s)    forward of micro-batch mb through stage s                               [FORWARD]
    B(mb, s)    backward of stage s. In a schedule without W's, the whole backward;      [FULL_BACKWARD]
                in one that splits it (zero bubble), the input gradient only            [BACKWARD_INPUT]
    W(mb, s)    zero bubble: the weight gradients B left out, in a later slot            [BACKWARD_WEIGHT]
    BW(mb, s)   in a split schedule, B and W of one micro-batch as ONE backward pass    [FULL_BACKWARD]
                (where the schedule has no slot to fill between them: ZB-V's steady state, DualPipeV)
    Pair(F, BW) DualPipeV: the forward of one micro-batch and the whole backward of     [OVERLAP_F_B]
                another, on the rank's other stage, issued together so that a runtime can
                overlap the two (chapter 05); run one after the other, they are F, then BW

An F whose backward is a BW says so (`whole`): the executor then runs that forward's linear layers as
plain nn.Linear, since nothing of its backward will be deferred (zero_bubble.py). An F's `whole` is
written by `mark_whole_forwards`, from the BWs of the same list.
"""
from typing import NamedTuple

F, B, W, BW, OVERLAP = "F", "B", "W", "BW", "F+BW"
BACKWARDS = (B, BW)            # the actions that send a stage input's gradient back
GRADS_DONE = (B, W, BW)        # the actions after which a stage's gradients may be final


class Action(NamedTuple):
    kind: str                  # F | B | W | BW
    mb: int                    # micro-batch
    stage: int                 # global (virtual) stage index
    whole: bool = False        # F only: its backward is a BW, one pass


class Pair(NamedTuple):
    """DualPipeV's overlapped pair: `forward` (an F) and `backward` (a BW) of two micro-batches on two stages."""
    forward: Action
    backward: Action
    kind = OVERLAP             # a class attribute, not a field: every action of a list has a kind


def units(actions) -> list[Action]:
    """The actions one at a time: each Pair as its F, then its BW (the order a one-at-a-time runtime runs
    them in, and the order of their messages)."""
    return [u for a in actions for u in ((a.forward, a.backward) if a.kind == OVERLAP else (a,))]


def mark_whole_forwards(actions: list) -> list:
    """The same list, each F whose micro-batch's backward on that stage is a BW marked `whole`."""
    whole = {(a.mb, a.stage) for a in units(actions) if a.kind == BW}

    def marked(a):
        if a.kind == OVERLAP:
            return Pair(marked(a.forward), a.backward)
        return a._replace(whole=True) if a.kind == F and (a.mb, a.stage) in whole else a
    return [marked(a) for a in actions]


def label(a) -> str:
    """F3, BW2, W0: the kind and micro-batch (a Pair: F3+BW2)."""
    if a.kind == OVERLAP:
        return f"{label(a.forward)}+{label(a.backward)}"
    return f"{a.kind}{a.mb}"
