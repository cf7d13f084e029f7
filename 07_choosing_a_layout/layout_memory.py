"""One layout's memory: what each pipeline rank of a layout (layout_costs.Candidate) holds at the peak of a step,
by component, and the fullest rank, the one that decides whether the layout fits.

    weights, gradients, AdamW   chapter 01's ZeRO formulas per kind of state, over the group the Layout sums
                                its gradients over (zero_accounting.zero_memory_components); DP alone under
                                ZeRO-3: chapter 01's per-unit form (per_unit_zero.py)
    activations                 the peak the schedule keeps in flight (schedule_costs.activation_peaks)
    working set                 what a step holds beyond the ledger (working_set.py)

calibrate_memory.py measures every term against the course's runs; tests/test_layout_memory.py holds them.
"""
from importlib import import_module

zero_accounting = import_module("01_data_parallel.zero_accounting")         # chapter 01: ZeRO memory
pipeline_stages = import_module("03_pipeline_parallel.pipeline_stages")     # chapter 03: stages
per_unit_zero = import_module("07_choosing_a_layout.per_unit_zero")        # this chapter: chapter 01's ZeRO-3
working_set = import_module("07_choosing_a_layout.working_set")            # this chapter: beyond the ledger


def rank_parameters(run, c, stages) -> tuple[int, int]:
    """(dense, expert) parameters one rank holds of `stages`, as the Layout counts each stage."""
    layout = c.layout(run.dtype)
    per_stage = [layout.stage_parameters(run.cfg, s) for s in stages]
    return sum(d for d, _ in per_stage), sum(x for _, x in per_stage)


def state_groups(run, c, dense: int, experts: int) -> tuple[tuple[int, int], ...]:
    """((fp32 bytes M, ranks N), ...) of each kind of state a rank holds, over the group the Layout sums its
    gradients over (and ZeRO shards it over): dense over dp × cp, experts over edp × cp."""
    layout = c.layout(run.dtype)
    groups = layout.gradient_groups()
    return tuple((4 * n, layout.group_size(groups[kind])) for kind, n in (("dense", dense), ("experts", experts)))


def memory_by_component(run, c, peak_activation: int, dense: int, experts: int) -> dict:
    """One rank's bytes by component at the peak of a step, as chapter 04's Trainer3D holds them under ZeRO
    (its `memory_formula` gives the same between steps): the fp32 weights whole and the full gradients
    (ZeRO-3 gathers the weights once per step and keeps them for every micro-batch; from stage 2 the
    gradients accumulate in full buffers until the reduce-scatter after the schedule), and beside those full
    buffers the shards that stay through the step (from stage 2 the gradient shard the optimizer reads, at
    stage 3 the weight shard the gather starts from: measured, calibrate_memory.py's held-out ZeRO runs),
    AdamW's moments sharded from stage 1 (chapter 01's formula per group: dense over dp × cp, experts over
    edp × cp). `held` is what stays between steps: chapter 01's zero_memory_components for each group."""
    out = dict.fromkeys(("params", "grads", "optim_bytes"), 0.0)
    held = dict.fromkeys(("params", "grads", "optim_bytes"), 0.0)
    for M, N in state_groups(run, c, dense, experts):                               # fp32 master weights
        between = zero_accounting.zero_memory_components(c.zero_stage, M, N)
        out["params"] += M + (between["param_bytes"] if c.zero_stage >= 3 else 0)
        out["grads"] += M + (between["grad_bytes"] if c.zero_stage >= 2 else 0)
        out["optim_bytes"] += between["optim_bytes"]
        for k, key in (("params", "param_bytes"), ("grads", "grad_bytes"), ("optim_bytes", "optim_bytes")):
            held[k] += between[key]
    act = peak_activation                    # the ledger in the run's dtype (bf16: its own measured terms)
    if run.dtype == "bf16":
        # one bf16 copy of this rank's weights, as a bf16 run keeps: the course's autocast casts them again for
        # every micro-batch and each one in flight keeps its own (activation_ledger.bf16_weight_copies, measured),
        # a cost of fp32 master weights under autocast that a bf16 training of this size would not pay
        out["params"] += 2 * (dense + experts)
    return {**out, "peak_activation_bytes": act, "total": sum(out.values()) + act,
            "held_between_steps": sum(held.values())}


def rank_memory(run, c, specs, pp_rank: int, peak_activation: int, gloo: bool) -> dict:
    """What pipeline rank `pp_rank` holds, by component, with `peak_activation` bytes of activations and
    its working set (working_set.py; `gloo`: the executor posts every receive of a step at its start)."""
    mine = pipeline_stages.rank_stages(specs, c.pp, pp_rank)
    dense, experts = rank_parameters(run, c, mine)
    if per_unit_zero.runs(run, c):
        memory = per_unit_zero.memory(per_unit_zero.unit_params(run.cfg), c.dp, run.dtype, peak_activation)
    else:
        memory = memory_by_component(run, c, peak_activation, dense, experts)
    working = working_set.of_rank(run, c, mine, pp_rank, gloo)
    copy = 0 if per_unit_zero.runs(run, c) else \
        working_set.gradient_copy(state_groups(run, c, dense, experts), c.zero_stage)
    return {**memory, "working": working, "gradient_copy": copy,
            "total": working_set.peak_total(memory["total"] - memory["peak_activation_bytes"],
                                            memory["peak_activation_bytes"], working, copy)}


def fullest_rank(run, c, specs, peaks, gloo: bool) -> tuple[int, dict]:
    """(pipeline rank, its memory by component) of the fullest rank: each rank its own weights, its own
    activations (the ends hold the embedding and the head, the first ranks keep the most micro-batches in
    flight) and its own working set; the fullest decides whether the layout fits."""
    return max(((r, rank_memory(run, c, specs, r, peak, gloo)) for r, peak in peaks),
               key=lambda rank_mem: rank_mem[1]["total"])
