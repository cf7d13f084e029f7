"""One layout, predicted: what a rank holds, what it sends, how long it waits, how long a step takes.

Every number comes from a formula a chapter proved on real runs, imported from that chapter:

    parameters, gradients, AdamW    chapter 01's ZeRO formulas per kind of state (layout_memory.py; DP alone
                                    under ZeRO-3: chapter 01's per-unit form, per_unit_zero.py)
    activations                     common/activation_ledger.pipeline_peaks: the ledger's bytes per micro-batch
                                    on each stage, times what the schedule keeps in flight (chapter 03's actions,
                                    schedule_costs.py)
    bubble                          chapter 03's pipeline_schedules.theory_bubble
    bytes per step, by group        dp: chapter 01's all-reduce of each stage's gradients (ZeRO: zero_sent_share)
                                    tp: chapter 02's tensor_parallel.tp_collectives, each at common.comm's volume
                                    pp: chapter 03's pipeline_executor.message_count × one activation
                                        (schedule_costs.py); --pp-sends scatter-gather: chapter 04's,
                                        1/tp of an activation SP does not split, all-gathered over TP
                                    ep: chapter 05's expert_parallel.expected_ep_bytes (balanced routing)
                                    cp: this chapter's attention_bookkeeping.cp_bytes, per layer and micro-batch

Under --recompute full each block's forward runs again in backward, its tp, ep and cp exchanges with it,
as far as backward needs them (each chapter's formula takes the mode; --full-recompute whole-block: the
whole forward, Megatron-LM's). The bytes of a row are global rank
0's, the rank a run's metrics report (its comm_bytes_*; rank_traffic counts any pipeline rank's); a GPU's
step time takes the busiest pipeline rank's, whose work and collectives are the step's critical path
(step_time.rank_work; under a V schedule rank 0 holds both ends of the model and the fewest blocks). The
memory is the fullest pipeline rank's, the one that decides whether a layout fits. The step time is a
model, stated:

    compute   model FLOPs of the step (common/mfu.flops_per_token; plus, under full recomputation, each
              block's forward again up to what backward needs: common/mfu.recompute_flops_per_token)
              ÷ (ranks × peak × efficiency); on a CPU the ranks share its cores, so the divisor has at
              most as many ranks as cores (on a GPU every operation at its own rate instead: step_time.py)
    bubble    compute × b / (1 − b): the slots every rank idles (none on a CPU with more ranks than cores:
              an idle rank lends its core to a busy one)
    links     per group, bytes ÷ the link's rate + messages × its latency; the link is NVLink when the
              group's ranks share a node (grid (edp, ep, pp, cp, tp), TP fastest), the network otherwise
    hidden    the DP all-reduce of a stage starts after its last backward and hides behind the others'
              cool-down (the bubble); chapter 01's per-unit ZeRO-3 gathers the next unit while one
              computes; the ring's hops hide behind attention's own compute; TP, PP and EP sit on the
              critical path
"""
import math
from collections import Counter
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from importlib import import_module

from common.comm import collective_bytes
from common.mfu import attention_flops_per_token, flops_per_token, recompute_flops_per_token
from common.recompute import recomputed_of

zero_accounting = import_module("01_data_parallel.zero_accounting")         # chapter 01: ZeRO memory and bytes
zero_sharding = import_module("01_data_parallel.zero_sharding")             # chapter 01: ZeRO's units
tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")       # chapter 02: TP collectives
pipeline_stages = import_module("03_pipeline_parallel.pipeline_stages")     # chapter 03: stages
pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")  # chapter 03: the bubble
scatter_gather = import_module("04_3d_combined.scatter_gather")             # chapter 04: what --pp-sends splits
expert_parallel = import_module("05_moe_expert_parallel.expert_parallel")   # chapter 05: all-to-all bytes
attention_bookkeeping = import_module("06_context_parallel.attention_bookkeeping")  # chapter 06: the ring's bytes
parallel_5d = import_module("06_context_parallel.parallel_5d")             # chapters 04-06: the Layout
per_unit_zero = import_module("07_choosing_a_layout.per_unit_zero")        # this chapter: chapter 01's ZeRO-3
working_set = import_module("07_choosing_a_layout.working_set")            # this chapter: beyond the ledger
layout_memory = import_module("07_choosing_a_layout.layout_memory")        # this chapter: what a rank holds
schedule_costs = import_module("07_choosing_a_layout.schedule_costs")      # this chapter: in flight, messages
step_time = import_module("07_choosing_a_layout.step_time")                # this chapter: a GPU's step, by operation



def recomputed_blocks(stages, per_stage: int | None) -> int:
    """How many blocks of `stages` recompute under --recompute-layers `per_stage` (the first ones of each)."""
    return sum(recomputed_of(len(s.layers), per_stage) for s in stages)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One layout of the plan: the degrees of the course's Layout (dp counts every data-parallel rank, ep
    among them) and the levers a script's flags add. What follows from the degrees (the world, each
    group's size and span, the gradient group of each kind of state, a stage's parameters, the element
    size) is the Layout's to say: `layout()` builds it, the one chapters 04-06's scripts decide."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero_stage: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    recompute_layers: int | None = None     # --recompute-layers: the first blocks of each stage (None: all)
    tp_overlap: bool = False                # --tp-overlap: chapter 02's SP rings under the chunk matmuls
    cp_attention: str = "ring"              # --cp-attention (cp > 1): chapter 06's ring, or allgather (Llama 3's)

    def layout(self, dtype: str = "fp32"):
        """The course's Layout of these degrees (chapter 06's Layout5D: at cp 1 and ep 1 its groups are
        chapter 04's), for a run in `dtype`; no process group is made."""
        return parallel_5d.Layout5D(self.dp, self.tp, self.pp, self.microbatches, dtype=dtype, ep=self.ep,
                                    cp=self.cp)

    def zero_group(self) -> int:
        """Ranks ZeRO shards the dense state over: the Layout's dense gradient group (dp × cp)."""
        layout = self.layout()
        return layout.group_size(layout.gradient_groups()["dense"])

    @classmethod
    def of_row(cls, row: dict) -> "Candidate":
        """The candidate a planner row (predict's, or a --json row) describes (a row written before
        tp_overlap and cp_attention were fields: without them)."""
        later = {"tp_overlap": False, "cp_attention": "ring"}
        return cls(**{f.name: row.get(f.name, later[f.name]) if f.name in later else row[f.name]
                      for f in fields(cls)})


@dataclass(frozen=True)
class Run:
    """What every layout shares: the model, the step's batch, the dtype."""
    cfg: object
    global_batch: int
    seq_len: int
    dtype: str
    attention: str = "flash"    # a GPU's attention kernel (block_time.py): "flash" (fused) or "unfused"
    full_recompute: str = "early-stop"   # what --recompute full reruns on a GPU (block_time.rerun)
    pp_sends: str = "whole"     # "whole" or "scatter-gather" (chapter 04's --pp-sends, Megatron-LM's default)


def rank_traffic(run: Run, c: Candidate, specs, pp_rank: int = 0) -> tuple[dict, dict]:
    """({group: bytes}, {group: messages}) the first rank of pipeline rank `pp_rank` (global rank 0 at
    pp_rank 0) sends + receives in one step."""
    cfg, m, v, layout = run.cfg, c.microbatches, c.virtual_stages, c.layout(run.dtype)
    message = layout.message_shape(cfg, run.global_batch, run.seq_len, c.sequence_parallel)   # (rows, S/cp[/tp], D)
    rows, positions, e = message[0], layout.positions(run.seq_len), layout.element_size
    mine = pipeline_stages.rank_stages(specs, c.pp, pp_rank)
    layers = sum(len(s.layers) for s in mine)
    # full recomputation reruns the forward's exchanges in the blocks it recomputes: (blocks, forward runs)
    rerun = recomputed_blocks(mine, c.recompute_layers) if c.recompute == "full" else 0
    runs = ((rerun, 2), (layers - rerun, 1))
    nbytes, msgs = dict.fromkeys(("dp", "tp", "pp", "ep", "cp"), 0), dict.fromkeys(("dp", "tp", "pp", "ep", "cp"), 0)
    unit_by_unit = per_unit_zero.runs(run, c)
    if unit_by_unit and c.dp > 1:                    # chapter 01's ZeRO-3: every unit, every micro-batch
        nbytes["dp"], msgs["dp"] = per_unit_zero.traffic(per_unit_zero.unit_params(cfg), c.dp, m)
    for s in mine:
        for M, N in layout_memory.state_groups(run, c, *layout_memory.rank_parameters(run, c, [s])):
            if N > 1 and M and not unit_by_unit:
                nbytes["dp"] += (collective_bytes("all_reduce", M, N) if c.zero_stage == 0 else
                                 int(2 * zero_accounting.zero_sent_share(c.zero_stage, N, per_microbatch=False) * M))
                msgs["dp"] += 1 if c.zero_stage == 0 else 0
        if c.tp > 1:
            micro, n_micro, grads, n_grads = stage_tp_traffic(cfg, rows, positions, c.tp, c.sequence_parallel,
                                                              len(s.layers), s.first, s.last, e, c.cp == 1,
                                                              step_time.rerun_mode(run, c), c.ep,
                                                              c.recompute_layers)
            nbytes["tp"] += m * micro + grads
            msgs["tp"] += m * n_micro + n_grads
    if c.zero_stage and not unit_by_unit:
        # chapter 04's ZeRO: one optimizer per kind of state over all the rank's stages, its units of
        # ~UNIT_MB (zero_sharding), two collectives each a step (1: all-reduce, all-gather; 2: reduce-scatter,
        # all-gather; 3: all-gather, reduce-scatter)
        state = layout_memory.state_groups(run, c, *layout_memory.rank_parameters(run, c, mine))
        msgs["dp"] += sum(2 * math.ceil(M / (zero_sharding.UNIT_MB * 2**20)) for M, N in state if N > 1 and M)
    if c.pp > 1:
        msgs["pp"] = schedule_costs.rank_messages(c.schedule, c.pp, m, v, pp_rank)
        nbytes["pp"] = msgs["pp"] * math.prod(message) * e
        if run.pp_sends == "scatter-gather" and scatter_gather.splits(c.tp, c.pp, c.sequence_parallel):
            # chapter 04's scatter-gather (Megatron-LM's): each TP rank sends its 1/tp of the (whole) activation, the
            # receiving stage all-gathers it over TP; half the messages are receives (each send has one)
            received = msgs["pp"] // 2
            nbytes["pp"] //= c.tp
            nbytes["tp"] += received * collective_bytes("all_gather", math.prod(message) * e, c.tp)
            msgs["tp"] += received
    if c.ep > 1 and cfg.n_experts:
        nbytes["ep"] = sum(int(expert_parallel.expected_ep_bytes(n, rows * m * positions, cfg.top_k, cfg.dim,
                                                                 cfg.n_experts, c.ep, e, r)) for n, r in runs if n)
        msgs["ep"] = sum(n * m * (3 * r + 2) for n, r in runs)  # each forward: counts, dispatch, combine; backward:
    if c.cp > 1:                                                # dispatch, combine
        kv = cfg.kv_heads_per_rank(c.tp)
        nbytes["cp"] = sum(n * m * attention_bookkeeping.cp_bytes(c.cp_attention, rows, run.seq_len, c.cp, kv,
                                                                  cfg.head_dim, e, forward_runs=r) for n, r in runs)
        # ring, per hop: each forward's K/V; the backward's K/V and the partial sums of their gradients;
        # allgather: each forward's all-gather of K/V, the backward's reduce-scatter of their gradients
        msgs["cp"] = sum(n * m * ((r + 2) * (c.cp - 1) if c.cp_attention == "ring" else r + 1) for n, r in runs)
        if cfg.n_experts:       # each forward's routers sum their (rows, E) int64 counts over cp (× tp under SP)
            joined = {**layout.joined, **parallel_5d.SEQUENCE_JOINED}   # chapter 06's rule: cp × tp under SP
            group = replace(layout, joined=joined).group_size("cp_tp" if c.sequence_parallel else "cp")
            nbytes["cp"] += sum(n * m * r for n, r in runs) * collective_bytes("all_reduce", rows * cfg.n_experts * 8,
                                                                               group)
            msgs["cp"] += sum(n * m * r for n, r in runs)
    return nbytes, msgs


@lru_cache(maxsize=None)
def stage_tp_traffic(cfg, rows: int, positions: int, tp: int, sp: bool, n_layers: int, first: bool, last: bool,
                     e: int, route_counts: bool, recompute: str, ep: int,
                     recomputed: int | None = None) -> tuple[int, int, int, int]:
    """One stage's TP traffic on one rank, chapter 02's collectives at common.comm's volume: (bytes of one
    micro-batch, its collectives, bytes of the gradient sums after the schedule, their collectives).
    `recompute` "whole-block" (Megatron-LM's full recomputation, step_time.rerun_mode): each recomputed block's
    whole forward again, its collectives with it, where the course's checkpoint stops early."""
    whole = recompute == "whole-block"
    micro = tensor_parallel.tp_collectives(cfg, rows, positions, tp, sp, n_layers, first, last, e,
                                           route_counts=route_counts, recompute="none" if whole else recompute,
                                           recomputed=recomputed)
    if whole:
        micro += recomputed_of(n_layers, recomputed) * tensor_parallel.block_forward_collectives(
            cfg, rows, positions, sp, e, route_counts)
    grads = tensor_parallel.tp_gradient_collectives(cfg, tp, sp, n_layers, last, ep)
    return bytes_of(micro, tp), len(micro), bytes_of(grads, tp), len(grads)


def bytes_of(collectives: list, n: int) -> int:
    """The bytes of (kind, elements) collectives over n ranks, each distinct one priced once (a stage of many
    layers repeats the same few)."""
    return sum(times * collective_bytes(kind, elements, n) for (kind, elements), times in Counter(collectives).items())


def link_of(group: str, c: Candidate, dev, gpus_per_node: int) -> tuple[float, float]:
    """(rate, latency) of the link a group's ranks talk over: inside a node when the group's span on the
    Layout's grid (edp, ep, pp, cp, tp) fits in one."""
    inside = dev.cores is not None or c.layout().group_span(group) <= gpus_per_node
    return (dev.intra, dev.latency_intra) if inside else (dev.inter, dev.latency_inter)


def time_parts(run: Run, c: Candidate, dev, gpus_per_node: int, nbytes: dict, msgs: dict, bubble: float,
               pp_rank: int = 0) -> dict:
    """{compute, bubble, comm_<group>: seconds} of one step (a GPU's also memory and optimizer: step_time.py);
    the step is their sum (the module docstring). `nbytes`, `msgs`: pipeline rank `pp_rank`'s (rank_traffic)."""
    cfg, world = run.cfg, c.layout().world
    if dev.spec is not None:        # a GPU: every operation at its own rate on the device file (step_time.py)
        mine = pipeline_stages.rank_stages(schedule_costs.specs_for(cfg, c.pp, c.virtual_stages, run.seq_len,
                                                                    c.schedule), c.pp, pp_rank)
        params = list(layout_memory.rank_parameters(run, c, mine))
        return step_time.gpu_time_parts(run, c, dev, gpus_per_node, nbytes, msgs, bubble, params,
                                        per_unit_zero.runs(run, c), len(per_unit_zero.unit_params(cfg)))
    blocks = recomputed_blocks(schedule_costs.specs_for(cfg, c.pp, c.virtual_stages, run.seq_len, c.schedule), c.recompute_layers)
    flops = (flops_per_token(cfg, run.seq_len) + recompute_flops_per_token(cfg, run.seq_len, c.recompute, blocks)) \
        * run.global_batch * run.seq_len
    if dev.call_s is not None:
        # a CPU calibrated on the course's runs here (calibrate_cpu.py): one rank's work, stretched by the W/C
        # ranks each core carries; a rank waiting in a collective holds no core, so nothing hides
        stretch = world / dev.cores
        comm = {g: stretch * (msgs[g] * dev.call_s + nbytes[g] * dev.byte_s) for g in nbytes}
        idle = 0.0 if world > dev.cores else flops / world / (dev.peak * dev.efficiency) * bubble / (1 - bubble)
        return {"compute": stretch * flops / world / (dev.peak * dev.efficiency), "bubble": idle,
                **{f"comm_{g}": t for g, t in comm.items()}}
    # a CPU without its own calibration: every FLOP at one stated efficiency of the probed peak
    rate = min(world, dev.cores) * dev.peak * dev.efficiency
    compute = flops / rate
    attention = attention_flops_per_token(cfg, run.seq_len) * run.global_batch * run.seq_len / rate
    idle = compute * bubble / (1 - bubble) if dev.cores is None or world <= dev.cores else 0.0
    seconds = {}
    for g in nbytes:
        link_rate, latency = link_of(g, c, dev, gpus_per_node)
        seconds[g] = nbytes[g] / link_rate + msgs[g] * latency
    exposed = {**seconds, "dp": max(0.0, seconds["dp"] - idle),
               "cp": step_time.cp_exposed(c, seconds["cp"], attention)}
    if per_unit_zero.runs(run, c):          # chapter 01's prefetch: a unit's gather travels while the one before computes
        exposed["dp"] = per_unit_zero.exposed(seconds["dp"], compute, len(per_unit_zero.unit_params(cfg)))
    return {"compute": compute, "bubble": idle, **{f"comm_{g}": t for g, t in exposed.items()}}


def predict(run: Run, c: Candidate, dev, gpus_per_node: int) -> dict:
    """The planner's row for one layout: the JSON schema of choose_layout.py, plus the time's parts."""
    cfg, world = run.cfg, c.layout().world
    specs = schedule_costs.specs_for(cfg, c.pp, c.virtual_stages, run.seq_len, c.schedule)
    rows = run.global_batch // c.dp // c.microbatches
    peaks = schedule_costs.activation_peaks(cfg, c.recompute, c.schedule, c.pp, c.microbatches, c.virtual_stages, rows,
                             run.seq_len, run.seq_len // c.cp, c.tp, c.sequence_parallel, run.dtype, c.recompute_layers,
                             c.cp, c.cp_attention == "allgather")
    fullest, memory = layout_memory.fullest_rank(run, c, specs, peaks, working_set.gloo(dev))
    nbytes, msgs = rank_traffic(run, c, specs)                                  # global rank 0's: the metrics'
    busiest = step_time.rank_work(run, c, dev).pp_rank if dev.spec is not None else 0   # the critical path's rank
    critical = (nbytes, msgs) if busiest == 0 else rank_traffic(run, c, specs, busiest)
    bubble = pipeline_schedules.theory_bubble(c.schedule, c.pp, c.microbatches, c.virtual_stages) if c.pp > 1 else 0.0
    parts = time_parts(run, c, dev, gpus_per_node, *critical, bubble, busiest)
    step, tokens = sum(parts.values()), run.global_batch * run.seq_len
    workers = world if dev.cores is None else min(world, dev.cores)
    return {"dp": c.dp, "tp": c.tp, "pp": c.pp, "cp": c.cp, "ep": c.ep, "zero_stage": c.zero_stage,
            "recompute": c.recompute, "recompute_layers": c.recompute_layers,
            "sequence_parallel": c.sequence_parallel, "tp_overlap": c.tp_overlap, "cp_attention": c.cp_attention,
            "schedule": c.schedule,
            "microbatches": c.microbatches, "memory_bytes": {k: int(v) for k, v in memory.items()},
            "comm_bytes": nbytes, "bubble": bubble, "step_time_s": step,
            # model FLOPs over the peak of every rank (common/mfu's definition; recomputation not counted)
            "mfu": flops_per_token(cfg, run.seq_len) * tokens / (workers * dev.peak) / step,
            "fits": working_set.fits(memory, dev), "time_parts_s": parts,
            "virtual_stages": c.virtual_stages, "fullest_pp_rank": fullest, "busiest_pp_rank": busiest}
