"""Pipeline schedules as pure functions: who computes what, in which order.

A schedule answers one question for every pipeline rank: in what order do I run the forward (F)
and backward (B) passes of my micro-batches? (And, for zero-bubble, the weight-gradient passes W.)
Each function here returns `schedule[r]` = rank r's ordered list of `Action`s, nothing else: no
processes, no tensors. So a schedule can be printed (`format_schedule`), checked
(`simulate` + the unit tests) and drawn (`plot_timeline.py --simulate`) on its own, and ONE
executor (pipeline_executor.py) runs whichever list it is given.

Vocabulary. p pipeline ranks, m micro-batches per step, v virtual stages (model chunks) per rank.
The model is cut into p·v stages; stage s lives on rank s % p (rank r holds r, r+p, r+2p, ...).
    F(mb, s)  forward of micro-batch mb through stage s: needs F(mb, s-1)'s output
    B(mb, s)  backward of stage s: needs B(mb, s+1)'s input-gradient (and F(mb, s))
    W(mb, s)  (zero-bubble only) the weight-gradient half of B(mb, s), deferred to fill bubbles

The bubble. With equal costs per stage, the first micro-batch reaches the last rank after p-1
forward slots, and the last backward leaves the first rank p-1 backward slots after the last rank
finished: every rank idles p-1 slots of (F+B) per step while doing m of them. Bubble fraction
    (p-1) / (m + p-1)               GPipe and 1F1B (1F1B only lowers memory, not the bubble)
    (p-1) / (v·m + p-1)             interleaved: each slot is 1/v as long
    (p-1) / (6m + p-1)              ZB-V and DualPipeV (v_schedules.py), m ≥ 2p-1, F = B = W of a half-stage
The V schedules place their 2p stages differently (rank r holds r and 2p-1-r): `stage_ranks` says
where each stage lives, and the executor sends each message to the rank that holds its stage.
"""
from functools import lru_cache
from collections import namedtuple

from common.errors import require

Action = namedtuple("Action", "kind mb stage")   # kind "F" | "B" | "W"; stage = global (virtual) stage index

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")      # stage s on rank s % p (a loop)
V_SCHEDULES = ("zb-v", "dualpipev")                         # two stages per rank, in a V (v_schedules.py)


def gpipe(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """GPipe: all forwards, then all backwards. m micro-batches' activations are alive at the peak."""
    out = []
    for r in range(p):
        # === all forward ===
        acts = [Action("F", mb, r) for mb in range(m)]
        # === all backward ===
        acts += [Action("B", mb, r) for mb in range(m)]
        out.append(acts)
    return out


def one_f_one_b(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """1F1B (PipeDream-Flush): start backwards as early as possible; at most p - r micro-batches in flight."""
    out = []
    for r in range(p):
        # >>> exercise 03.one_f_one_b
        warmup = min(p - r - 1, m)                 # forwards before the first backward can arrive
        acts = []
        # === warmup ===  fill the pipe: the last rank (r = p-1) has no warmup at all
        acts += [Action("F", mb, r) for mb in range(warmup)]
        # === steady state ===  one forward, one backward: each B frees the memory of one F
        for i in range(m - warmup):
            acts += [Action("F", warmup + i, r), Action("B", i, r)]
        # === cooldown ===  drain the backwards of the warmup forwards
        acts += [Action("B", mb, r) for mb in range(m - warmup, m)]
        # <<< exercise 03.one_f_one_b
        out.append(acts)
    return out


def interleaved_1f1b(p: int, m: int, v: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B (Megatron-LM): v chunks per rank, micro-batches go round in groups of p.

    Rank r's k-th forward is micro-batch (k // (p·v))·p + k % p on its chunk (k // p) % v: it runs p
    micro-batches through chunk 0, then the same p through chunk 1, ... Backwards run the chunks in
    reverse. Needs m % p == 0 so that every group of p micro-batches is complete.
    """
    _needs_whole_groups(p, m)
    total = m * v

    def virtual(k: int, forward: bool, r: int) -> tuple[int, int]:
        chunk = (k // p) % v
        if not forward:
            chunk = v - 1 - chunk
        return (k // (p * v)) * p + k % p, chunk * p + r        # (micro-batch, global stage)

    out = []
    for r in range(p):
        # How many forwards before the first backward? Rank r's first backward is B(micro-batch 0,
        # last chunk): it can start only once micro-batch 0 has been through every stage and its
        # gradient is back. Count the slots from rank r's first forward, one action per slot, every
        # rank starting one slot after the rank before it:
        #   (v-1)·p   its forwards of micro-batches 0..p-1 through chunks 0..v-2 (the group of p
        #             goes round the p ranks once per chunk, one forward per slot)
        #   1         micro-batch 0 through its last chunk, here
        #   p-1-r     the same forward on ranks r+1 .. p-1 (the last stage, whose B follows at once)
        #   p-1-r     that backward on ranks p-1 .. r+1, back to rank r
        # So rank r can run (v-1)·p + 2(p-1-r) + 1 forwards before B(0, last chunk) arrives: the
        # warm-up, then the steady state's first F. Each hop costs two slots (there and back), which
        # leaves every steady-state message a full F + B of slack before it is needed. (Fewer
        # warm-up forwards also work: the rank idles here instead of in the cool-down, with fewer
        # micro-batches in flight; with F = B = 1 the simulated step is as long.)
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = []
        # === warmup ===  enough forwards that the first backward of the last chunk can arrive
        acts += [Action("F", *virtual(k, True, r)) for k in range(warmup)]
        # === steady state ===  1F1B over virtual micro-batches
        for i in range(total - warmup):
            acts += [Action("F", *virtual(warmup + i, True, r)), Action("B", *virtual(i, False, r))]
        # === cooldown ===
        acts += [Action("B", *virtual(k, False, r)) for k in range(total - warmup, total)]
        out.append(acts)
    return out


def zb_h1(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """ZB-H1 (zero bubble, Qi et al. 2023): 1F1B with each backward split in two.

    B computes only the gradient w.r.t. the stage input: that is all the previous rank waits for.
    W (the weight gradients) is needed by nobody until the optimizer step, so it can wait. Two gains:
    the backward wave that travels from the last rank to the first carries only B's (the W's are not
    on that path), so the ramp-up and drain bubbles are made of (F+B) slots, not (F+B+W); and rank r,
    which finishes r slots before rank 0 does, keeps r W's in reserve and runs them in that tail.
    Same forward order as 1F1B; a micro-batch's activations live until its W, so rank r holds at most
    p of them (1F1B's rank 0 peak). Bubble with F = B = W: (p-1) of 3m + (p-1) slots, vs 3(p-1) for 1F1B.
    """
    out = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        deferred = min(r, m)                        # W's held back: rank r's tail gap is r slots
        acts, pending = [], []
        # === warmup ===
        acts += [Action("F", mb, r) for mb in range(warmup)]
        # === steady state ===  F, B and (once `deferred` W's are waiting) the oldest W
        for i in range(m - warmup):
            acts += [Action("F", warmup + i, r), Action("B", i, r)]
            pending.append(Action("W", i, r))
            if len(pending) > deferred:
                acts.append(pending.pop(0))
        # === cooldown ===  each B followed by one deferred W, where 1F1B would wait
        for mb in range(m - warmup, m):
            acts.append(Action("B", mb, r))
            pending.append(Action("W", mb, r))
            acts.append(pending.pop(0))
        # === flush ===  the remaining weight gradients
        acts += pending
        out.append(acts)
    return out


def stages_per_rank(name: str, v: int = 1) -> int:
    """How many stages each rank holds: 2 for a V schedule (whatever --virtual-stages says), else v."""
    return 2 if name in V_SCHEDULES else v


def stage_ranks(name: str, p: int, v: int = 1) -> tuple[int, ...]:
    """rank_of[stage] for every stage of the pipeline: where the schedule expects each stage to live.
        loop (gpipe, 1f1b, interleaved, zb-h1)   stage s on rank s % p: rank r holds r, r+p, r+2p, ...
        V    (zb-v, dualpipev)                   rank r holds r and 2p-1-r (v_schedules.v_placement)"""
    if name in V_SCHEDULES:
        return v_schedules.v_placement(p)
    return tuple(s % p for s in range(p * v))


def placement(schedule: list[list[Action]]) -> tuple[int, ...]:
    """rank_of[stage], read off a schedule: a stage lives on the rank whose list runs its actions."""
    rank_of = {a.stage: r for r, acts in enumerate(schedule) for a in acts}
    return tuple(rank_of[s] for s in range(len(rank_of)))


def build_schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """The schedule by its command-line name, once check_schedule accepts it."""
    check_schedule(name, p, m, v)
    return [list(actions) for actions in _built(name, p, m, v)]      # a fresh list per rank: the caller's


def check_schedule(name: str, p: int, m: int, v: int = 1) -> None:
    """Everything a schedule needs of (p, m, v), checked without building it: building one for thousands of
    micro-batches takes seconds, and chapter 07's planner asks this of hundreds of thousands of layouts.
    (A test builds every schedule this accepts on a grid of small p, m, v.)"""
    names = SCHEDULES + V_SCHEDULES
    require(name in names, f"unknown schedule {name!r}; choose one of {', '.join(names)}")
    require(m >= 1, "--microbatches must be at least 1")
    if name in V_SCHEDULES:
        require(v == 2, f"the {name} schedule holds two stages per rank (the V): pass v = 2, "
                        f"stages_per_rank({name!r}) (on the command line: leave out --virtual-stages)")
        require(name != "dualpipev" or m >= 2 * p,
                f"dualpipev needs --microbatches ≥ 2 × --pp ({2 * p}), got {m}; use --microbatches {2 * p}")
    else:
        require(v == 1 or name == "interleaved",
                f"--virtual-stages {v} only works with --schedule interleaved (the {name} schedule holds one "
                "stage per rank); use --schedule interleaved or --virtual-stages 1")
    if name == "interleaved":
        _needs_whole_groups(p, m)


def _needs_whole_groups(p: int, m: int) -> None:
    require(m % p == 0, f"the interleaved schedule needs --microbatches to be a multiple of --pp ({p}), "
                        f"got {m}; use --microbatches {max(p, (m // p + 1) * p)}")


@lru_cache(maxsize=None)    # chapter 07's planner asks for the same schedules thousands of times
def _built(name: str, p: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    fn = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zb-h1": zb_h1,
          "zb-v": v_schedules.zb_v, "dualpipev": v_schedules.dualpipe_v}[name]
    return tuple(tuple(actions) for actions in fn(p, m, v))


def theory_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The textbook bubble fraction (equal F, B costs per stage; zero-bubble: B = W = F)."""
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name in V_SCHEDULES:
        # Unit = one F of a half-stage (a V stage holds half the layers of a 1F1B stage), B = W = 1:
        # a rank's work is 2 stages × m × (F + B + W) = 6m units. The only idle time left is the
        # ramp-up: the first micro-batch reaches rank r after r forwards, and every rank waits p-1
        # units in all (the tail is filled with W's). With fewer than 2p-1 micro-batches the V is
        # never full: 2 units more idle per missing micro-batch. Both, per rank: max(p-1, 2(2p-1-m)).
        idle = max(p - 1, 2 * (2 * p - 1 - m))
        return idle / (6 * m + idle)
    if name == "zb-h1":
        # m ≥ p: rank 0 idles (p-1)·(F+B-W) = p-1 slots of a 3m + (p-1) slot step.
        # m < p: the pipe never fills. The last rank alternates F and B, so the backwards reach rank 0
        # one every two slots: its step is the first round trip (2p slots), two per further
        # micro-batch and its last W, 2m + 2p - 1 slots. Both: (p-1) + 2m + max(m, p).
        return 1 - 3 * m / (2 * m + p - 1 + max(m, p))
    return (p - 1) / (m + p - 1)


def inputs(a: Action, n_stages: int) -> list[tuple]:
    """The actions `a` waits for, as (kind, mb, stage): F(mb, s) needs F(mb, s-1); B(mb, s) needs
    F(mb, s) and B(mb, s+1); W(mb, s) needs B(mb, s)."""
    if a.kind == "F":
        return [("F", a.mb, a.stage - 1)] if a.stage > 0 else []
    if a.kind == "B":
        return [("F", a.mb, a.stage)] + ([("B", a.mb, a.stage + 1)] if a.stage < n_stages - 1 else [])
    return [("B", a.mb, a.stage)]


def simulate(schedule: list[list[Action]], n_stages: int, cost=None, handover: float = 0.0,
             gap: float = 0.0) -> dict:
    """Run a schedule on paper: each rank executes its list in order, an action waits for its inputs.

    Sends never block (the executor's sends are asynchronous); an action can start when its rank is
    free and its `inputs` are done.
    cost      what an action takes: {"F": 1, "B": 2, "W": 1} (the default, unit time: F = 1, a whole
              backward 2; split into B = W = 1 by zero bubble), or a function cost(rank, action) ->
              seconds (per stage and kind from a measured run, or each action's own measured time)
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
    split = any(a.kind == "W" for acts in schedule for a in acts)
    if not callable(cost):
        table = cost or {"F": 1.0, "B": 2.0, "W": 1.0}
        if split and table.get("B") == 2.0 and "W" in table:   # default costs: B + W = one whole backward
            table = {**table, "B": 1.0}
        cost = lambda r, a: table[a.kind]                       # noqa: E731
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
            if (a.kind, a.mb, a.stage) in done:
                raise ValueError(f"rank {r} runs {a} twice")
            h = handover(r, a) if callable(handover) else handover
            ready = [end + (h if src != r else 0.0) for end, src in (done[d] for d in deps)]
            if free_at[r] is not None:                          # the rank's first action pays no gap
                ready.append(free_at[r] + (gap(r, a) if callable(gap) else gap))
            start = max(ready + [0.0])
            end = start + cost(r, a)
            done[(a.kind, a.mb, a.stage)] = (end, r)
            free_at[r] = end
            events.append((r, a, start, end))
            if a.kind == "F":
                live[r].add((a.mb, a.stage))
                peak[r] = max(peak[r], len(live[r]))
            elif a.kind == ("W" if split else "B"):
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


from . import v_schedules  # noqa: E402  (the V schedules build on Action, above)
