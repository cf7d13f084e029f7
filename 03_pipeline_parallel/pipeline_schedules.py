"""Pipeline schedules as pure functions: who computes what, in which order.

A schedule answers one question for every pipeline rank: in what order do I run the forward (F)
and backward (B) passes of my micro-batches? (And, for zero-bubble, the weight-gradient passes W.)
Each function here returns `schedule[r]` = rank r's ordered list of `Action`s, nothing else: no
processes, no tensors. So a schedule can be printed and checked on paper (schedule_simulator.py:
`format_schedule`, `simulate` + the unit tests) and drawn (`plot_timeline.py --simulate`) on its own, and ONE
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


from . import v_schedules  # noqa: E402  (the V schedules build on Action, above)
