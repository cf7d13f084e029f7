"""A schedule run on paper: every rank executes its action list in order, each action waits for its
inputs, and the clock says when each one starts and ends (no processes, no tensors).

`simulate` checks a schedule (no deadlock, each action once, the micro-batches in flight) and times it with
unit costs or measured ones (pipeline_costs.py); `format_schedule` prints it as a table, one row per rank,
where the gaps are the bubble. A Pair runs as its F, then its BW, as chapter 03's executor runs it.
"""
from .pipeline_actions import BACKWARDS, BW, B, F, W, Action, units

UNIT_COSTS = {F: 1.0, B: 2.0, W: 1.0}              # a forward 1, a whole backward 2
SPLIT_UNIT_COSTS = {**UNIT_COSTS, B: 1.0}          # zero bubble's B, the input gradient: half a backward


def inputs(a: Action, n_stages: int) -> list[tuple]:
    """The work `a` waits for, as (kind, mb, stage): F(mb, s) needs F(mb, s-1); a backward (B or BW) of
    (mb, s) needs F(mb, s) and B(mb, s+1) (a BW there does B's work too: `outputs`); W(mb, s) needs B(mb, s)."""
    if a.kind == F:
        return [(F, a.mb, a.stage - 1)] if a.stage > 0 else []
    if a.kind in BACKWARDS:
        return [(F, a.mb, a.stage)] + ([(B, a.mb, a.stage + 1)] if a.stage < n_stages - 1 else [])
    return [(B, a.mb, a.stage)]


def outputs(a: Action) -> list[tuple]:
    """The work `a` has done, as `inputs` names it: a BW is the B and the W of its micro-batch."""
    return [(B, a.mb, a.stage), (W, a.mb, a.stage)] if a.kind == BW else [(a.kind, a.mb, a.stage)]


def simulate(schedule: list[list[Action]], n_stages: int, cost=None, handover: float = 0.0,
             gap: float = 0.0) -> dict:
    """Run a schedule on paper: each rank executes its list in order, an action waits for its inputs.

    Sends never block (the executor's sends are asynchronous); an action can start when its rank is
    free and its `inputs` are done.
    cost      what an action takes: a dict by kind (the kinds it leaves out: unit time, UNIT_COSTS: F = 1,
              a whole backward B 2; SPLIT_UNIT_COSTS where the schedule splits it: B = W = 1), in which a BW
              is the theory's B then W, back to back (its input gradient leaves after the B); or a function
              cost(rank, action) -> seconds (per stage and kind from a measured run, or each action's own
              measured time), in which a BW is one pass whose input gradient leaves at its end, as in the
              executor
    handover  the time between an action on one rank ending and the action on ANOTHER rank that
              waits for its message starting (posting the send, the transfer, waking the receiver)
    gap       the executor's time between two actions of one rank when nothing is awaited (posting
              the next receive, the send, Python): rank r starts its next action at
              max(its last end + gap, each input's end (+ handover if it comes from another rank))
              Both are seconds, or functions (rank, action) -> seconds (each action's own, measured).
    Returns {"events": [(rank, action, start, end)], "makespan", "bubble" (1 − Σ busy / (p ×
    makespan): the measured bubble's definition, common/timeline.py), "in_flight": per-rank peak of
    micro-batches forwarded but not yet fully backwarded}.
    Raises ValueError on a deadlock (nobody can move) or a missing/duplicated action.
    """
    schedule = [units(acts) for acts in schedule]              # a Pair: its F, then its BW
    split = any(a.kind in (W, BW) for acts in schedule for a in acts)
    halves = None                                              # a BW's (B, W) costs, on paper
    if not callable(cost):
        table = {**(SPLIT_UNIT_COSTS if split else UNIT_COSTS), **(cost or {})}
        halves = (table[B], table[W]) if split else None
        cost = lambda r, a: sum(halves) if a.kind == BW else table[a.kind]     # noqa: E731
    p = len(schedule)
    done, pos, free_at = {}, [0] * p, [None] * p               # done: (kind, mb, stage) -> (end, rank)
    events, live, peak = [], [set() for _ in range(p)], [0] * p
    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for r in range(p):
            if pos[r] == len(schedule[r]):
                continue
            a = schedule[r][pos[r]]
            deps = inputs(a, n_stages)
            if any(d not in done for d in deps):
                continue
            if any(o in done for o in outputs(a)):
                raise ValueError(f"rank {r} runs {a} twice")
            h = handover(r, a) if callable(handover) else handover
            ready = [end + (h if src != r else 0.0) for end, src in (done[d] for d in deps)]
            if free_at[r] is not None:                          # the rank's first action pays no gap
                ready.append(free_at[r] + (gap(r, a) if callable(gap) else gap))
            start = max(ready + [0.0])
            end = start + cost(r, a)
            done.update((o, (end, r)) for o in outputs(a))
            if a.kind == BW and halves:                         # on paper: the input gradient after the B half
                done[(B, a.mb, a.stage)] = (start + halves[0], r)
            free_at[r] = end
            events.append((r, a, start, end))
            if a.kind == "F":
                live[r].add((a.mb, a.stage))
                peak[r] = max(peak[r], len(live[r]))
            elif a.kind in (W, BW) or not split:                # its last backward action
                live[r].discard((a.mb, a.stage))
            pos[r] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            stuck = {r: schedule[r][pos[r]] for r in range(p) if pos[r] < len(schedule[r])}
            raise ValueError(f"deadlock: every rank waits: {stuck}")
    makespan = max(e for e in free_at if e is not None)
    busy = sum(e - s for _, _, s, e in events)
    return {"events": events, "makespan": makespan, "bubble": 1 - busy / (p * makespan), "in_flight": peak}


def format_schedule(schedule: list[list[Action]], n_stages: int, cost=None, width: int = 4) -> str:
    """The schedule as a text table: one row per rank, one column per unit of (simulated) time.

    Each cell shows the action and micro-batch (F3, B3, W3; with virtual stages F3.1 = chunk 1),
    '.' is idle. Times come from `simulate` with unit costs, so the gaps are the bubble.
    """
    sim = simulate(schedule, n_stages, cost)
    p = len(schedule)
    unit = min(e - s for _, _, s, e in sim["events"])
    cols = int(round(sim["makespan"] / unit))
    grid = [["." * 1] * cols for _ in range(p)]
    v = n_stages // p
    for r, a, s, e in sim["events"]:
        label = f"{a.kind}{a.mb}" + (f".{a.stage // p}" if v > 1 else "")
        for c in range(int(round(s / unit)), int(round(e / unit))):
            grid[r][c] = label
    w = max(width, max(len(c) for row in grid for c in row) + 1)
    lines = [f"rank {r} | " + "".join(c.ljust(w) for c in row) for r, row in enumerate(grid)]
    lines.append(f"simulated bubble {sim['bubble']:.3f}   peak micro-batches in flight per rank {sim['in_flight']}")
    return "\n".join(lines)
