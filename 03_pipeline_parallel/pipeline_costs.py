"""What a pipeline step's actions cost, read off a measured timeline: the inputs of `simulate`.

The theory's bubble assumes equal stages and free messages. A real step (one trace written with
`--timeline`) gives, for every rank, its F, B, W (and BW) spans in order on one clock. Between two spans of a
rank there are two kinds of time, and each action's start tells which one it paid:

    start = max(previous end on this rank + gap,  end of the input made on another rank + handover)

  gap       the executor's own time between two actions when nothing is awaited: posting the next
            irecv and the send, Python (the message, if any, was there before the rank was free)
  handover  from the end of the action on another rank that made this action's input to this
            action's start, when the rank was already waiting: the sender posting its isend, the
            transfer, the receiver waking up

So an action whose cross-rank input ended after the rank became free is a sample of the hand-over;
every other action (the first of each rank excepted) is a sample of the gap. `fit_costs` returns
each rank's mean of both, the mean F, B, W time per stage (8 numbers at p = 2, 10 with W) and each
action's own time, which is what schedule_simulator.simulate takes: feed them in and the simulated
bubble can be set beside the measured one, term by term (bubble_pp.py).
"""
from collections import defaultdict
from statistics import fmean

from common.timeline import COMPUTE

from .pipeline_actions import Action
from .schedule_simulator import inputs, outputs


def step_spans(events: list[dict], step: int) -> dict[tuple, tuple[int, float, float]]:
    """(kind, mb, stage) -> (rank, start, end) of every F, B, W, BW span of one step."""
    return {(e["kind"], e["mb"], e["stage"]): (e["rank"], e["start"], e["end"])
            for e in events if e["step"] == step and e["kind"] in COMPUTE}


def fit_costs(events: list[dict], step: int, n_stages: int) -> dict:
    """One step's costs, in seconds: {"cost": {(kind, stage): mean time}, "gap" and "handover":
    {rank: mean} (`rank_means`), "durations": {(kind, mb, stage): each action's own time}}."""
    spans = step_spans(events, step)
    made = {o: span for key, span in spans.items() for o in outputs(Action(*key))}   # a BW made a B and a W
    per_rank = defaultdict(list)
    for key, (rank, start, end) in spans.items():
        per_rank[rank].append((start, end, key))
    gaps, handovers = {}, {}                             # (kind, mb, stage) -> seconds before it
    for rank, acts in per_rank.items():
        prev_end = None
        for start, end, key in sorted(acts):
            made_elsewhere = [made[d][2] for d in inputs(Action(*key), n_stages) if made[d][0] != rank]
            ready = max(made_elsewhere, default=None)
            if ready is not None and (prev_end is None or ready > prev_end):
                handovers[key] = start - ready           # the rank was free first: it waited for the message
            elif prev_end is not None:
                gaps[key] = start - prev_end             # nothing awaited: the executor's own time
            prev_end = end
    by_kind = defaultdict(list)
    for (kind, _, stage), (_, start, end) in spans.items():
        by_kind[(kind, stage)].append(end - start)
    return {"cost": {k: fmean(v) for k, v in by_kind.items()},
            "gap": rank_means(gaps, spans), "handover": rank_means(handovers, spans),
            "durations": {k: end - start for k, (_, start, end) in spans.items()}}


def rank_means(samples: dict, spans: dict) -> dict[int, float]:
    """Each rank's mean of its samples; a rank without any gets the mean of all (0.0 if none at all).
    Per rank, because the ranks differ: the last stage sends no activation, ZB-H1's stage 0 sends
    no gradient, and a rank that shares its core with busier ranks waits longer to be scheduled."""
    by_rank = defaultdict(list)
    for key, seconds in samples.items():
        by_rank[spans[key][0]].append(seconds)
    overall = fmean(samples.values()) if samples else 0.0
    return {r: fmean(by_rank[r]) if by_rank[r] else overall for r in {rank for rank, _, _ in spans.values()}}


def stage_costs(fit: dict) -> dict:
    """simulate's keyword arguments for the compute alone: each action takes its stage's mean time
    for its kind; gaps and hand-overs are free."""
    return {"cost": lambda rank, a: fit["cost"][(a.kind, a.stage)]}


def mean_costs(fit: dict, handovers: bool = True) -> dict:
    """simulate's keyword arguments for the model: stage costs, plus each rank's mean gap and mean
    hand-over (of the messages it waited for; free with handovers=False)."""
    return {**stage_costs(fit), "gap": lambda rank, a: fit["gap"][rank],
            "handover": (lambda rank, a: fit["handover"][rank]) if handovers else 0.0}


def own_times(fit: dict) -> dict:
    """simulate's keyword arguments for the model with each action's own measured time instead of
    its stage's mean (the same mean gaps and hand-overs): what the spread of the action times adds."""
    return {**mean_costs(fit), "cost": lambda rank, a: fit["durations"][(a.kind, a.mb, a.stage)]}
