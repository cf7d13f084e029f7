"""A GPU pipeline's bubble from its own schedule: chapter 03's actions run on paper with each action's own time.

Chapter 03's textbook bubbles (pipeline_schedules.theory_bubble) assume every stage equally heavy and a
backward twice a forward (zero bubble: B = W = F). On a GPU neither holds: the stages of a loop or a V
differ by a layer (126 blocks over 112 interleaved chunks: 14 of two blocks, 98 of one), the last holds
the head and the loss, the first the embedding; and a block's input gradient B (each matmul's input
gradient, attention's five products, the memory-bound backward, what recomputation reruns) outweighs its
weight gradient W (each matmul's weight gradient only), which zero-bubble schedules count on being equal.

So each stage's forward F, input gradient B and weight gradient W of one micro-batch are timed from its
operations (block_time.py: a weight gradient is an operation of its own), and chapter 03's schedule
simulator (schedule_simulator.simulate) runs the layout's own schedule with them: each rank in its
action order, each action waiting for its inputs (a schedule that does not split the backward runs B and W
as one). The bubble is the idle share of the busiest rank's step:

    b = idle / makespan,  idle = makespan − the busiest rank's busy time

The whole step is run on paper, each of its m micro-batches: exact, and slow for a plan of thousands of
layouts (a step of m micro-batches on p ranks is 2–3·m·v actions per rank; DeepSeek-V3's run thousands of
micro-batches). So the planner ranks its layouts with the textbook bubble, and `--explain` says what
this run on paper gives for the layout it explains (`words`): how far the textbook's assumption is from
that layout's own stages. With equal stages and the textbook's costs the two agree exactly for the loop
schedules (1F1B, interleaved, ZB-H1); the V schedules run some backwards whole (BW, in PyTorch's order, as
chapter 03's executor does), whose input gradient leaves only after their weight gradient: they idle more
than the textbook's V even then (tests/test_pipeline_time.py).
"""
from dataclasses import replace
from importlib import import_module

block_time = import_module("07_choosing_a_layout.block_time")              # this chapter: one block's operations
schedule_costs = import_module("07_choosing_a_layout.schedule_costs")      # this chapter: the stages
step_time = import_module("07_choosing_a_layout.step_time")                # this chapter: a rank's shape
layout_costs = import_module("07_choosing_a_layout.layout_costs")          # this chapter: a row's layout
planner = import_module("07_choosing_a_layout.planner")                    # this chapter: the ranking's order
pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")   # chapter 03: the actions
schedule_simulator = import_module("03_pipeline_parallel.schedule_simulator")   # chapter 03: run on paper
pipeline_actions = import_module("03_pipeline_parallel.pipeline_actions")  # chapter 03: F, B, W, BW


def words(run, row: dict, dev) -> str:
    """What --explain says of a GPU layout `row` with a pipeline: its bubble on paper against the textbook's, and
    the step with it (the bubble's part replaced; the rest of the step as the planner counts it)."""
    b = bubble(run, layout_costs.Candidate.of_row(row), dev)
    step = step_with(row, b)
    return (f"on paper (chapter 03's schedule run with each stage's own forward, input and weight gradients: "
            f"pipeline_time.py) its busiest rank idles {b:.1%} of the step, where the ranking's textbook bubble "
            f"says {row['bubble']:.1%}: a step of {step:.4g} s (MFU {row['mfu'] * row['step_time_s'] / step:.1%})")


def step_with(row: dict, b: float) -> float:
    """Row `row`'s step with bubble share `b` in place of the textbook's: the critical path (compute, memory,
    TP, EP and PP traffic) idles b of the step; the rest of the step as the planner counts it. Never less than
    the step without its bubble (b = 0): a bound the search for the fastest on paper stops at."""
    parts = row["time_parts_s"]
    critical = sum(parts.get(k, 0.0) for k in ("compute", "memory", "comm_tp", "comm_ep", "comm_pp"))
    return row["step_time_s"] - parts["bubble"] + critical * b / (1 - b)


def fastest_on_paper(rows: list[dict], bubble_of) -> tuple[dict, float] | None:
    """(the row of `rows` whose step is the least with its bubble on paper, that step), None for no rows:
    `bubble_of(row)` its bubble share (`bubbles`). The first of leaders_on_paper."""
    first = leaders_on_paper(rows, bubble_of, 1)
    return first[0] if first else None


def leaders_on_paper(rows: list[dict], bubble_of, n: int) -> list[tuple[dict, float]]:
    """The `n` rows of `rows` whose steps are the least with their bubbles on paper, fastest first, each with
    that step. Exact without running every schedule: rows are tried in the order of their step without a
    bubble, and the search stops at the first whose bubble-free step is no less than the n-th best found on
    paper (it, and every row after it, can only be slower)."""
    best: list[tuple[float, dict]] = []
    for r in sorted(rows, key=lambda r: r["step_time_s"] - r["time_parts_s"]["bubble"]):
        if len(best) == n and step_with(r, 0.0) >= best[-1][0]:
            break               # equal times (to four digits) by memory, as the ranking orders them
        best = sorted(best + [(step_with(r, bubble_of(r)), r)], key=lambda x: planner.time_then_memory(*x))[:n]
    return [(r, step) for step, r in best]


def bubbles(run, dev):
    """bubble_of(row) for leaders_on_paper: a GPU row's bubble on paper (`bubble`), 0 without a pipeline; one
    run of the schedule for the rows that differ only in their ZeRO stage (it moves no pipeline action)."""
    seen = {}

    def bubble_of(r: dict) -> float:
        c = replace(layout_costs.Candidate.of_row(r), zero_stage=0)
        if c.pp > 1 and c not in seen:
            seen[c] = bubble(run, c, dev)
        return seen.get(c, 0.0)
    return bubble_of


def bubble(run, c, dev) -> float:
    """The busiest rank's idle share of a GPU step of layout `c` (the module docstring)."""
    cfg, shape, mode = run.cfg, step_time.rank_shape(run, c), step_time.rerun_mode(run, c)
    specs = schedule_costs.specs_for(cfg, c.pp, c.virtual_stages, run.seq_len, c.schedule)
    costs = tuple(tuple(block_time.seconds(ops, dev.spec) for ops in block_time.microbatch_passes(
        cfg, shape, len(s.layers), step_time.blocks_rerun(c, len(s.layers)), mode, s.first, s.last))
        for s in specs)                                 # each stage's (F, B, W) of one micro-batch
    makespan, busy = on_paper(c.schedule, c.pp, c.microbatches, c.virtual_stages, costs)
    return 1 - busy / makespan


def on_paper(schedule: str, pp: int, m: int, v: int, costs: tuple) -> tuple[float, float]:
    """(makespan, the busiest rank's busy time) of chapter 03's `schedule` of m micro-batches run on paper
    (schedule_simulator.simulate), stage k's (F, B, W) = costs[k]; a schedule that does not split the
    backward runs B and W as one action."""
    plan = schedule_costs.plan_for(schedule, pp, m, v)
    split = pipeline_schedules.SCHEDULES[schedule].split_w
    A = pipeline_actions

    def cost(rank, a):
        f, b, w = costs[a.stage]
        return {A.F: f, A.B: b if split else b + w, A.W: w, A.BW: b + w}[a.kind]

    run = schedule_simulator.simulate(plan, len(costs), cost)
    busy = [0.0] * pp
    for rank, _, start, end in run["events"]:
        busy[rank] += end - start
    return run["makespan"], max(busy)
