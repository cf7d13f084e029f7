"""Partial recomputation as a lever of the plan: the fewest blocks per stage that make a layout fit.

`--recompute-layers K` (common/recompute.py) recomputes the first K blocks of each pipeline stage and keeps
the rest; each block recomputed frees one block's activations per micro-batch in flight and costs one
block's forward. For a layout that fits only with full recomputation, the planner adds one more row: the
least K that fits (planner.plan), so that a layout is not charged a whole extra forward where part of
one is enough.
"""
from importlib import import_module

layout_memory = import_module("07_choosing_a_layout.layout_memory")    # this chapter: what a rank holds
schedule_costs = import_module("07_choosing_a_layout.schedule_costs")  # this chapter: in flight, messages
working_set = import_module("07_choosing_a_layout.working_set")        # this chapter: the fits test


def least_recompute_layers(run, c, dev) -> int | None:
    """Under --recompute full, the fewest blocks per stage (--recompute-layers) that still fit `dev`: the
    others keep their activations and rerun nothing. None where a stage has one block, where recomputing
    none fits (--recompute none is then as small a step and a candidate of its own), where recomputing
    every block does not fit either, or where every block must recompute. Memory falls as more blocks
    recompute, so a bisection finds it."""
    specs = schedule_costs.specs_for(run.cfg, c.pp, c.virtual_stages, run.seq_len, c.schedule)
    rows = run.global_batch // c.dp // c.microbatches

    def fits(k):
        peaks = schedule_costs.activation_peaks(run.cfg, "full", c.schedule, c.pp, c.microbatches, c.virtual_stages, rows,
                                                 run.seq_len, run.seq_len // c.cp, c.tp, c.sequence_parallel, run.dtype, k)
        return working_set.fits(layout_memory.fullest_rank(run, c, specs, peaks, working_set.gloo(dev))[1], dev)

    most = max(len(s.layers) for s in specs)
    if c.recompute != "full" or most < 2 or not fits(most) or fits(0):
        return None
    lo, hi = 0, most                    # fits(hi), not fits(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi if hi < most else None
