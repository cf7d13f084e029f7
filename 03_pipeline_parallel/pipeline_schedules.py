"""Pipeline schedules as pure functions: who computes what, in which order.

A schedule answers one question for every pipeline rank: in what order do I run the forward (F)
and backward (B) passes of my micro-batches? (And, for zero-bubble, the weight-gradient passes W.)
Each function here returns `schedule[r]` = rank r's ordered list of actions (pipeline_actions.py),
nothing else: no processes, no tensors. So a schedule can be printed and checked on paper
(schedule_simulator.py: `format_schedule`, `simulate` + the unit tests) and drawn (`plot_timeline.py
--simulate`) on its own, and ONE executor (pipeline_executor.py) runs whichever list it is given.

Vocabulary. p pipeline ranks, m micro-batches per step, v virtual stages (model chunks) per rank.
The model is cut into p·v stages; stage s lives on rank s % p (rank r holds r, r+p, r+2p, ...).
    F(mb, s)  forward of micro-batch mb through stage s: needs F(mb, s-1)'s output
    B(mb, s)  backward of stage s: needs B(mb, s+1)'s input-gradient (and F(mb, s))
    W(mb, s)  (zero-bubble only) the weight-gradient half of B(mb, s), deferred to fill bubbles
(and, in the V schedules, BW: B and W as one pass, and DualPipeV's Pair: pipeline_actions.py).

The bubble. With equal costs per stage, the first micro-batch reaches the last rank after p-1
forward slots, and the last backward leaves the first rank p-1 backward slots after the last rank
finished: every rank idles p-1 slots of (F+B) per step while doing m of them. Bubble fraction
    (p-1) / (m + p-1)               GPipe and 1F1B (1F1B only lowers memory, not the bubble)
    (p-1) / (v·m + p-1)             interleaved: each slot is 1/v as long
    (p-1) / (6m + p-1)              ZB-V and DualPipeV (v_schedules.py), m ≥ 2p-1, F = B = W of a half-stage
The V schedules place their 2p stages differently (rank r holds r and 2p-1-r): `stage_ranks` says
where each stage lives, and the executor sends each message to the rank that holds its stage.

The registry. `SCHEDULES` (at the end) maps each command-line name to its entry: the builder, where its
stages live, its textbook bubble, whether it splits W. Every script, the planner (chapter 07) and the
tests read it: a new schedule is one builder and one entry.
"""
from functools import lru_cache
from typing import Callable, NamedTuple

from common.errors import ConfigError, require

from . import v_schedules
from .pipeline_actions import Action, units


def gpipe(p: int, m: int) -> list[list[Action]]:
    """GPipe: all forwards, then all backwards. m micro-batches' activations are alive at the peak."""
    out = []
    for r in range(p):
        # === all forward ===
        acts = [Action("F", mb, r) for mb in range(m)]
        # === all backward ===
        acts += [Action("B", mb, r) for mb in range(m)]
        out.append(acts)
    return out


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
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


def zb_h1(p: int, m: int) -> list[list[Action]]:
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


# --- the bubble in theory, per schedule (equal F, B costs per stage; zero-bubble: B = W = F) --------------

def loop_bubble(p: int, m: int) -> float:
    """GPipe and 1F1B: p-1 idle slots of m + p-1."""
    return (p - 1) / (m + p - 1)


def interleaved_bubble(p: int, m: int, v: int) -> float:
    """Interleaved 1F1B: each slot is 1/v as long."""
    return (p - 1) / (v * m + p - 1)


def zb_h1_bubble(p: int, m: int) -> float:
    """m ≥ p: rank 0 idles (p-1)·(F+B-W) = p-1 slots of a 3m + (p-1) slot step.
    m < p: the pipe never fills. The last rank alternates F and B, so the backwards reach rank 0
    one every two slots: its step is the first round trip (2p slots), two per further
    micro-batch and its last W, 2m + 2p - 1 slots. Both: (p-1) + 2m + max(m, p)."""
    return 1 - 3 * m / (2 * m + p - 1 + max(m, p))


def v_bubble(p: int, m: int) -> float:
    """ZB-V and DualPipeV. Unit = one F of a half-stage (a V stage holds half the layers of a 1F1B stage),
    B = W = 1: a rank's work is 2 stages × m × (F + B + W) = 6m units. The only idle time left is the
    ramp-up: the first micro-batch reaches rank r after r forwards, and every rank waits p-1
    units in all (the tail is filled with W's). With fewer than 2p-1 micro-batches the V is
    never full: 2 units more idle per missing micro-batch. Both, per rank: max(p-1, 2(2p-1-m))."""
    idle = max(p - 1, 2 * (2 * p - 1 - m))
    return idle / (6 * m + idle)


# --- where the stages live, and what a schedule needs of (p, m) ----------------------------------------------

def loop_placement(p: int, v: int) -> tuple[int, ...]:
    """Stage s on rank s % p: rank r holds r, r+p, r+2p, ..."""
    return tuple(s % p for s in range(p * v))


def accepts(name: str, p: int, m: int, v: int = 1) -> bool:
    """Whether check_schedule accepts (p, m, v): a sweep over micro-batch counts skips the others."""
    try:
        check_schedule(name, p, m, v)
    except ConfigError:
        return False
    return True


def _needs_whole_groups(p: int, m: int) -> None:
    require(m % p == 0, f"the interleaved schedule needs --microbatches to be a multiple of --pp ({p}), "
                        f"got {m}; use --microbatches {max(p, (m // p + 1) * p)}")


def _needs_two_per_rank(p: int, m: int) -> None:
    require(m >= 2 * p,
            f"dualpipev needs --microbatches ≥ 2 × --pp ({2 * p}), got {m}; use --microbatches {2 * p}")


# --- the registry ------------------------------------------------------------------------------------------

class Schedule(NamedTuple):
    """One schedule, everything the course asks of it by name."""
    build: Callable            # (p, m) -> every rank's actions; (p, m, v) where `virtual`
    stage_ranks: Callable      # (p, v) -> rank_of[stage]: where the schedule expects each stage to live; (p)
                               # where it holds a fixed number of `stages` per rank
    theory_bubble: Callable    # (p, m) -> the textbook bubble fraction; (p, m, v) where `virtual`
    split_w: bool              # the backward split into B and W (zero bubble)
    stages: int | None = None  # stages per rank it always holds (the V's 2); None: --virtual-stages says
    virtual: bool = False      # takes --virtual-stages v > 1 (the interleaved schedule)
    needs: Callable | None = None    # (p, m) -> None: refuses a micro-batch count it cannot run


SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule(gpipe, loop_placement, loop_bubble, split_w=False),
    "1f1b": Schedule(one_f_one_b, loop_placement, loop_bubble, split_w=False),
    "interleaved": Schedule(interleaved_1f1b, loop_placement, interleaved_bubble, split_w=False, virtual=True,
                            needs=_needs_whole_groups),
    "zb-h1": Schedule(zb_h1, loop_placement, zb_h1_bubble, split_w=True),
    "zb-v": Schedule(v_schedules.zb_v, v_schedules.v_placement, v_bubble, split_w=True, stages=2),
    "dualpipev": Schedule(v_schedules.dualpipe_v, v_schedules.v_placement, v_bubble, split_w=True, stages=2,
                          needs=_needs_two_per_rank),
}


def stages_per_rank(name: str, v: int = 1) -> int:
    """How many stages each rank holds: the schedule's own number (the V's 2, whatever --virtual-stages
    says), else v (check_schedule refuses v > 1 for a schedule that is not `virtual`)."""
    return SCHEDULES[name].stages or v


def stages_from_flag(name: str, virtual_stages: int) -> int:
    """stages_per_rank for the command line's --virtual-stages: a V schedule holds its own number, so any
    other value the user passes is refused in one line rather than ignored."""
    stages = SCHEDULES[name].stages
    require(not stages or virtual_stages in (1, stages),
            f"the {name} schedule holds {stages} stages per rank; drop --virtual-stages")
    return stages_per_rank(name, virtual_stages)


def stage_ranks(name: str, p: int, v: int = 1) -> tuple[int, ...]:
    """rank_of[stage] for every stage of the pipeline: where the schedule expects each stage to live.
        loop (gpipe, 1f1b, interleaved, zb-h1)   stage s on rank s % p: rank r holds r, r+p, r+2p, ...
        V    (zb-v, dualpipev)                   rank r holds r and 2p-1-r (v_schedules.v_placement)"""
    entry = SCHEDULES[name]
    return entry.stage_ranks(p) if entry.stages else entry.stage_ranks(p, v)


def placement(schedule: list[list[Action]]) -> tuple[int, ...]:
    """rank_of[stage], read off a schedule: a stage lives on the rank whose list runs its actions."""
    rank_of = {a.stage: r for r, acts in enumerate(schedule) for a in units(acts)}
    return tuple(rank_of[s] for s in range(len(rank_of)))


def build_schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """The schedule by its command-line name, once check_schedule accepts it."""
    check_schedule(name, p, m, v)
    return [list(actions) for actions in _built(name, p, m, v)]      # a fresh list per rank: the caller's


def check_schedule(name: str, p: int, m: int, v: int = 1) -> None:
    """Everything a schedule needs of (p, m, v), checked without building it: building one for thousands of
    micro-batches takes seconds, and chapter 07's planner asks this of hundreds of thousands of layouts.
    (A test builds every schedule this accepts on a grid of small p, m, v.)"""
    require(name in SCHEDULES, f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    require(m >= 1, "--microbatches must be at least 1")
    entry = SCHEDULES[name]
    if entry.stages:
        require(v == entry.stages, f"the {name} schedule holds {entry.stages} stages per rank: pass v = "
                                   f"{entry.stages}, stages_per_rank({name!r}) (on the command line: leave out "
                                   "--virtual-stages)")
    elif not entry.virtual:
        virtual = ", ".join(n for n, e in SCHEDULES.items() if e.virtual)
        require(v == 1, f"--virtual-stages {v} only works with --schedule {virtual} (the {name} schedule holds one "
                        f"stage per rank); use --schedule {virtual} or --virtual-stages 1")
    if entry.needs:
        entry.needs(p, m)


@lru_cache(maxsize=None)    # chapter 07's planner asks for the same schedules thousands of times
def _built(name: str, p: int, m: int, v: int) -> tuple[tuple, ...]:
    entry = SCHEDULES[name]
    built = entry.build(p, m, v) if entry.virtual else entry.build(p, m)
    return tuple(tuple(actions) for actions in built)


def theory_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The textbook bubble fraction (equal F, B costs per stage; zero-bubble: B = W = F)."""
    entry = SCHEDULES[name]
    return entry.theory_bubble(p, m, v) if entry.virtual else entry.theory_bubble(p, m)
