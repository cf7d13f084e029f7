"""The planner: every layout of a cluster that the chapters run, each predicted, and the list ranked.

    candidates     every distinct layout of the world's ranks: the degrees dp × tp × pp × cp (ep among the
                   dp ranks, for a mixture of experts), the ZeRO stage, the recomputation mode, sequence
                   parallelism, the schedule with its virtual stages, the micro-batches; each a
                   layout_costs.Candidate, whose groups and parameters are the course's Layout's
    kept           those the training script that would run it accepts (runnable.py asks its own checks);
                   chapter 02's --tp-overlap is not enumerated (it would double the SP rows): `--explain
                   ...,sp,tpo` adds the overlapped twin of every SP layout the scripts accept
    predicted      layout_costs.predict: what every rank holds, what it sends, the bubble, a step time
    ranked         `ranking`: the fastest of those that fit first

choose_layout.py is its command line: it prints the plan, writes --json and explains.
"""
from dataclasses import replace
from importlib import import_module
from typing import NamedTuple

from common.errors import require
from common.model import PRESETS
from common.recompute import MODES

layout_inputs = import_module("07_choosing_a_layout.layout_inputs")    # this chapter: models and devices
layout_costs = import_module("07_choosing_a_layout.layout_costs")      # this chapter: one layout's numbers
runnable = import_module("07_choosing_a_layout.runnable")              # this chapter: the scripts' own checks
partial_recompute = import_module("07_choosing_a_layout.partial_recompute")  # this chapter: the fewest blocks
published = import_module("07_choosing_a_layout.published")            # this chapter: published runs
pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")   # chapter 03: the schedule registry
pipeline_stages = import_module("03_pipeline_parallel.pipeline_stages")     # chapter 03: the most stages


def schedules(cfg, pp: int) -> list[tuple[str, int]]:
    """(name, virtual stages) of every schedule the chapters run at `pp` (chapter 03's registry): 1F1B,
    interleaved 1F1B (chunks_per_rank), ZB-H1, and the V's two (ZB-V, DualPipeV: two stages per rank). GPipe is
    left out: it has 1F1B's bubble and time and keeps all m micro-batches in flight instead of at most p, so it
    never ranks above 1F1B."""
    if pp == 1:
        return [("1f1b", 1)]
    return [(name, v) for name, s in pipeline_schedules.SCHEDULES.items() if name != "gpipe"
            for v in (chunks_per_rank(cfg.n_layers, pp) if s.virtual else [s.stages or 1])]


def chunks_per_rank(n_layers: int, pp: int) -> list[int]:
    """The interleaved schedule's v, up to one layer per chunk and the embedding and the head a chunk each
    (v = (L+2)/p: chapter 03 refuses more stages): every v from 2 to 4 (Megatron's GPT-3 ran 3), then
    doubling, and the most itself. Between two doublings the bubble (p−1)/(v·m + p−1) moves little while the
    messages grow with v, so the ladder keeps the planner's time in bounds where L/p is large (GPT-3's 96
    layers on 2 ranks: 7 values, not 48)."""
    most = pipeline_stages.most_stages(n_layers) // pp
    ladder = {2, 3, 4, most} | {2 ** k for k in range(3, most.bit_length())}
    return sorted(v for v in ladder if 2 <= v <= most)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def microbatch_counts(rows: int, pp: int, schedule: str) -> list[int]:
    """The course's default (the largest count ≤ 2·pp that splits the rows, common/cli's rule; a
    multiple of pp for the interleaved schedule) and one row per micro-batch: without a pipeline the
    least activation memory (gradient accumulation), with one the smallest bubble (1F1B keeps at most
    about p micro-batches in flight whatever m is). Without a pipeline also one micro-batch of every row
    (no accumulation: the fewest, largest matmuls, as torchtitan runs FSDP)."""
    step = pp if schedule == "interleaved" else 1
    fits = [m for m in range(step, rows + 1, step) if rows % m == 0]
    default = [m for m in fits if m <= 2 * pp]
    if not default:
        return []
    return sorted({max(default)} | ({rows} if rows in fits else set()) | ({1} if pp == 1 else set()))


def candidates(cfg, world: int, global_batch: int, gpus_per_node: int, cp_attention: str = "ring"):
    """Every distinct layout of `world` ranks, before the chapters' checks: TP inside a node; the batch split
    over the data-parallel ranks (the micro-batches are counted from it); a ZeRO stage only where there is
    a group to shard over (where the Layout's dense gradient group, dp × cp, is one rank, every stage is the
    same layout as stage 0). `cp_attention`: chapter 06's attention of the layouts with cp > 1."""
    for tp in (t for t in divisors(world) if t <= gpus_per_node):
        for cp in divisors(world // tp):
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if global_batch % dp:
                    continue
                for ep in divisors(dp) if cfg.n_experts else [1]:
                    for schedule, v in schedules(cfg, pp):
                        for m in microbatch_counts(global_batch // dp, pp, schedule):
                            degrees = layout_costs.Candidate(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, schedule=schedule,
                                                             microbatches=m, virtual_stages=v,
                                                             cp_attention=cp_attention if cp > 1 else "ring")
                            for zero in (0, 1, 2, 3) if degrees.zero_group() > 1 else (0,):
                                for mode in MODES:
                                    for sp in (False, True) if tp > 1 else (False,):
                                        yield replace(degrees, zero_stage=zero, recompute=mode, sequence_parallel=sp)


def runnable_candidates(cfg, model: str, world: int, global_batch: int, seq_len: int, gpus_per_node: int,
                        dtype: str = "fp32", cp_attention: str = "ring",
                        wanted: dict | None = None) -> tuple[list, int]:
    """(the candidates the chapters' scripts accept, how many they refused): runnable.refusal asks each;
    `wanted`: only the candidates with these fields."""
    every = [c for c in candidates(cfg, world, global_batch, gpus_per_node, cp_attention)
             if wanted is None or published.matches(vars(c), wanted)]
    kept = [c for c in every if runnable.refusal(c, model, cfg, global_batch, seq_len, dtype) is None]
    return kept, len(every) - len(kept)


def time_then_memory(seconds: float, r: dict) -> tuple:
    """The order among layouts that fit: the step `seconds` (to four digits), then the memory of row `r`."""
    return float(f"{seconds:.4g}"), r["memory_bytes"]["total"]


def ranking(r: dict) -> tuple:
    """Fastest first among the layouts that fit, equal times (to 4 digits) by memory; then the rest by memory."""
    # >>> exercise 07.ranking
    if r["fits"]:
        return False, float(f"{r['step_time_s']:.4g}"), r["memory_bytes"]["total"]
    return True, r["memory_bytes"]["total"], r["step_time_s"]
    # <<< exercise 07.ranking


class Plan(NamedTuple):
    rows: list[dict]            # every runnable layout's row, in ranking order
    device: object              # layout_inputs.Device
    refused: int                # candidates the chapters' scripts refused


def nodes(args, dev) -> int:
    """Ranks that share a node's fast links: on a CPU every rank of the world (one machine)."""
    return args.world if dev.cores is not None else args.gpus_per_node


def run_of(args) -> "layout_costs.Run":
    """What every layout of choose_layout.py's flags `args` shares: the model, the batch, the dtype, the kernels."""
    return layout_costs.Run(layout_inputs.model_for(args.model), args.global_batch, args.seq_len, args.dtype,
                            args.attention, args.full_recompute, args.pp_sends)


def plan(args, wanted: dict | None = None) -> Plan:
    """Every layout of choose_layout.py's flags `args` that the chapters run, predicted and ranked (`wanted`:
    only those with these fields, a plan of one layout's forms)."""
    cfg = layout_inputs.model_for(args.model)
    require(args.seq_len <= cfg.max_seq_len,
            f"--seq-len {args.seq_len} is longer than --model {args.model}'s {cfg.max_seq_len} positions")
    dev = layout_inputs.device_for(args.device, args.dtype, args.world, args.efficiency)
    gpn = nodes(args, dev)
    run = run_of(args)
    kept, refused = runnable_candidates(cfg, args.model, args.world, args.global_batch, args.seq_len, gpn, args.dtype,
                                        args.cp_attention, wanted)
    # full recomputation also as a lever: the fewest blocks per stage that fit (--recompute-layers), the rest kept
    partial = (replace(c, recompute_layers=k) for c in kept if (k := partial_recompute.least_recompute_layers(run, c, dev)))
    rows, tried = [], kept + list(partial)
    if (getattr(args, "explain", None) or {}).get("tp_overlap"):      # --explain ...,sp,tpo: the overlapped twins
        twins = (replace(c, tp_overlap=True) for c in tried if c.sequence_parallel)
        tried += [c for c in twins if runnable.refusal(c, args.model, cfg, args.global_batch, args.seq_len,
                                                       args.dtype) is None]
    for c in tried:
        row = layout_costs.predict(run, c, dev, gpn)
        # a published shape has no course preset to run at full size: its command is the miniature's (run_it)
        row["command"] = (runnable.command(c, args.model, cfg, args.global_batch, args.seq_len, args.dtype,
                                           runnable.sends(c, args.pp_sends)) if args.model in PRESETS else None)
        rows.append(row)
    require(rows, f"no layout of --world {args.world} that the chapters run splits this model and batch "
                  f"(--global-batch {args.global_batch} over the data-parallel ranks, heads over TP): use a world "
                  f"size that is a product of the model's divisors, e.g. a power of two")
    rows.sort(key=ranking)
    return Plan(rows, dev, refused)


def refusal_of(args, dev, wanted: dict) -> str | None:
    """The chapters' refusal of the first candidate of the plan with the fields `wanted` (None: none refused,
    or no such candidate): a layout --explain asks about that is not among the rows."""
    cfg = layout_inputs.model_for(args.model)
    overlap = wanted.get("tp_overlap", False)              # --tp-overlap: asked of the scripts too
    return next((runnable.refusal(c, args.model, cfg, args.global_batch, args.seq_len, args.dtype)
                 for c in (replace(c, tp_overlap=overlap) for c in candidates(cfg, args.world, args.global_batch,
                                                                              nodes(args, dev), args.cp_attention))
                 if published.matches(vars(c), wanted)), None)
