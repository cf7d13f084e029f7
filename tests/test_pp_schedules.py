"""Chapter 03 schedules, stages and timelines, checked on paper: no processes."""
from collections import Counter
from importlib import import_module

import pytest

from common.errors import ConfigError
from common.model import PRESETS

pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")
schedule_simulator = import_module("03_pipeline_parallel.schedule_simulator")
pipeline_executor = import_module("03_pipeline_parallel.pipeline_executor")
pipeline_stages = import_module("03_pipeline_parallel.pipeline_stages")
units = import_module("03_pipeline_parallel.pipeline_actions").units
SCHEDULES = pipeline_schedules.SCHEDULES
LOOPS = [name for name, s in SCHEDULES.items() if not s.stages]      # stage s on rank s % p


def cases():
    for p in (1, 2, 3, 4):
        for m in (1, 2, 3, 4, 5, 8, 12):
            for name in LOOPS:
                for v in ((1, 2, 3) if SCHEDULES[name].virtual else (1,)):
                    if name == "interleaved" and m % p:
                        continue
                    yield name, p, m, v


def v_cases():
    for p in (1, 2, 3, 4):
        for m in (1, 2, 3, 4, 5, 8, 12):
            yield "zb-v", p, m, 2                      # the V: two stages per rank, any m
            if m >= 2 * p:
                yield "dualpipev", p, m, 2             # needs m ≥ 2p


# the V's cases are tests of their own: an exercise graded on the loop schedules' tests never waits on
# the V's exercise (03.zbv)
CASES, V_CASES = list(cases()), list(v_cases())


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_forward_has_its_backward_once(name, p, m, v):
    every_forward_has_its_backward_once(name, p, m, v)


@pytest.mark.parametrize("name,p,m,v", V_CASES)
def test_v_every_forward_has_its_backward_once(name, p, m, v):
    every_forward_has_its_backward_once(name, p, m, v)


def every_forward_has_its_backward_once(name, p, m, v):
    sched = pipeline_schedules.build_schedule(name, p, m, v)
    split = SCHEDULES[name].split_w
    for r, acts in enumerate(sched):
        one = units(acts)                            # a Pair: its F, then its BW
        assert split or {a.kind for a in acts} <= {"F", "B"}, "BW, W and Pairs belong to split schedules"
        whole = {(a.mb, a.stage) for a in one if a.kind == "BW"}
        assert all(a.whole == ((a.mb, a.stage) in whole) for a in one if a.kind == "F"), "F says if its backward is a BW"
        work = [(k, a.mb, a.stage) for a in one for k in (("B", "W") if a.kind == "BW" else (a.kind,))]
        counts = Counter(work)
        assert all(c == 1 for c in counts.values()), f"rank {r} repeats an action"
        stages = [s for s, rank in enumerate(pipeline_schedules.stage_ranks(name, p, v)) if rank == r]
        assert stages == ([r, 2 * p - 1 - r] if SCHEDULES[name].stages == 2 else list(range(r, p * v, p)))  # V, loop
        kinds = ("F", "B", "W") if split else ("F", "B")
        assert set(counts) == {(k, mb, s) for k in kinds for mb in range(m) for s in stages}
        for k, mb, s in work:                        # B after its F, W after its B, on this rank
            if k != "F":
                assert work.index(("F" if k == "B" else "B", mb, s)) < work.index((k, mb, s))


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_dependencies_and_in_flight_limit(name, p, m, v):
    dependencies_and_in_flight_limit(name, p, m, v)


@pytest.mark.parametrize("name,p,m,v", V_CASES)
def test_v_dependencies_and_in_flight_limit(name, p, m, v):
    dependencies_and_in_flight_limit(name, p, m, v)


def dependencies_and_in_flight_limit(name, p, m, v):
    # raises on deadlock / missing input
    sim = schedule_simulator.simulate(pipeline_schedules.build_schedule(name, p, m, v), p * v)
    # the V's counts are of half-stages (2p stages): 2p of them weigh what p micro-batches of 1F1B's rank 0 do
    promise = {"gpipe": [m] * p, "1f1b": [min(p - r, m) for r in range(p)], "zb-h1": [min(p, m)] * p,
               "interleaved": [min((p - r - 1) * 2 + (v - 1) * p + 1, m * v) for r in range(p)],
               "zb-v": [min(2 * p, 2 * m)] * p, "dualpipev": [2 * p + 1] * p}[name]
    for r, (have, want) in enumerate(zip(sim["in_flight"], promise)):
        assert have <= want, f"{name} p={p} m={m}: rank {r} holds {have} micro-batches at once, the schedule promises at most {want}"


def run_protocol(sched, n: int, blocking_sends: bool) -> None:
    """Play the executor's protocol step by step: irecvs posted in the sender's order (up to this
    action's message and the next one's), wait for this action's message, compute, send.
    blocking_sends=False: a send never blocks (the executor: isend, waited at the end of the step).
    blocking_sends=True: a send completes only once the receiver posted its irecv (rendezvous)."""
    p, rank_of = len(sched), pipeline_schedules.placement(sched)
    orders = [pipeline_executor.incoming_order(sched, r, n) for r in range(p)]
    sched = [units(acts) for acts in sched]                  # chapter 03's executor: a Pair's F, then its BW
    # Round-robin over the ranks; each advances when it can; nobody can -> deadlock.
    queues = [{src: list(keys) for src, keys in o.items()} for o in orders]
    posted, sent = [set() for _ in range(p)], set()
    pc, phase = [0] * p, [0] * p              # phase: 0 post+wait, 1 send
    while any(pc[r] < len(sched[r]) for r in range(p)):
        moved = False
        for r in range(p):
            if pc[r] == len(sched[r]):
                continue
            a = sched[r][pc[r]]
            if phase[r] == 0:
                for b in sched[r][pc[r]:pc[r] + 2]:          # this action's message and the next one's
                    need = pipeline_executor.needed_message(b, n, p, rank_of)
                    if need and need[1] != r:
                        while need[0] not in posted[r]:
                            posted[r].add(queues[r][need[1]].pop(0))
                need = pipeline_executor.needed_message(a, n, p, rank_of)
                if need is None or need[0] in sent:
                    phase[r], moved = 1, True
            else:
                out = pipeline_executor.produced_messages([a], n, p, rank_of)
                if not blocking_sends or all(dst == r or key in posted[dst] for key, dst in out):
                    sent.update(key for key, _ in out)
                    pc[r], phase[r], moved = pc[r] + 1, 0, True
        if not moved:
            raise RuntimeError(f"deadlock at {[sched[r][pc[r]] for r in range(p) if pc[r] < len(sched[r])]}")


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_executor_message_plan_matches_and_never_deadlocks(name, p, m, v):
    executor_message_plan_matches_and_never_deadlocks(name, p, m, v)


@pytest.mark.parametrize("name,p,m,v", V_CASES)
def test_v_executor_message_plan_matches_and_never_deadlocks(name, p, m, v):
    executor_message_plan_matches_and_never_deadlocks(name, p, m, v)


def executor_message_plan_matches_and_never_deadlocks(name, p, m, v):
    sched, n = pipeline_schedules.build_schedule(name, p, m, v), p * v
    rank_of = pipeline_schedules.placement(sched)
    assert rank_of == pipeline_schedules.stage_ranks(name, p, v)     # the lists run where the stages live
    orders = [pipeline_executor.incoming_order(sched, r, n) for r in range(p)]
    for r in range(p):                               # every message sent is consumed exactly once
        needed = Counter(pipeline_executor.needed_message(a, n, p, rank_of) for a in units(sched[r]))
        needed = Counter({k: c for k, c in needed.items() if k is not None and k[1] != r})
        expected = Counter((k, src) for src, keys in orders[r].items() for k in keys)
        assert needed == expected
        for src, keys in orders[r].items():          # a channel's receives match its sends in order (gloo, NCCL):
            sent = [k for k, dst in pipeline_executor.produced_messages(sched[src], n, p, rank_of) if dst == r]
            assert keys == sent, f"rank {r} would post its receives from rank {src} out of its sending order"
    run_protocol(sched, n, blocking_sends=False)     # what the executor does
    if name not in ("interleaved", "zb-v", "dualpipev"):   # these survive even rendezvous sends (the V's
        # ranks, like interleaving's, send activations down while their neighbour sends the other stage's up)
        run_protocol(sched, n, blocking_sends=True)


def test_interleaved_needs_asynchronous_sends():
    """The trap: with sends that block until the peer posts its receive, interleaved 1F1B deadlocks
    (each rank sends a chunk's activation while its peer sends a gradient back). Hence isend."""
    with pytest.raises(RuntimeError, match="deadlock"):
        run_protocol(pipeline_schedules.interleaved_1f1b(2, 4, 2), 4, blocking_sends=True)


def test_v_schedules_have_torch_s_order_rank_by_rank():
    """Our zb_v and dualpipe_v give every rank the very list of actions PyTorch's ScheduleZBVZeroBubble and
    ScheduleDualPipeV compute, in the same order (torch_order.py translates their vocabulary: full backward = BW)."""
    torch_order = import_module("03_pipeline_parallel.torch_order")
    for p in (1, 2, 3, 4):
        for m in range(1, 17):
            for name in ("zb-v", "dualpipev") if m >= 2 * p else ("zb-v",):
                ours, theirs = pipeline_schedules.build_schedule(name, p, m, 2), torch_order.torch_schedule(name, p, m)
                assert torch_order.first_difference(ours, theirs) is None, (name, p, m)


def test_a_v_needs_the_v_placement():
    """The V's turn is local: on a loop placement (stage s on rank s % p) ZB-V's lists would run stage
    p on rank 0, not on rank p-1 where its input is made; the executor's channels follow the placement."""
    sched = pipeline_schedules.build_schedule("zb-v", 4, 8, 2)
    assert pipeline_schedules.placement(sched) == (0, 1, 2, 3, 3, 2, 1, 0)
    turn = [a for a in sched[3] if a.kind == "F" and a.stage == 4][0]           # F of stage 4 on rank 3
    assert pipeline_executor.needed_message(turn, 8, 4, pipeline_schedules.placement(sched))[1] == 3   # local
    assert pipeline_executor.needed_message(turn, 8, 4)[1] == 3 and \
        pipeline_executor.produced_messages([turn], 8, 4)[0][1] == 1               # a loop would send to rank 1


def test_1f1b_warmup_is_min_p_minus_r_minus_1_m():
    for p, m in [(4, 8), (4, 2)]:
        sched = pipeline_schedules.one_f_one_b(p, m)
        for r in range(p):
            first_b = next(i for i, a in enumerate(sched[r]) if a.kind == "B")
            assert first_b == min(p - r - 1, m) + (1 if m > p - r - 1 else 0)


def test_what_check_schedule_accepts_is_built_whole():
    """check_schedule answers without building (chapter 07's planner asks it of every layout): on a grid of
    p, m, v every schedule it accepts builds whole (each action once, in order), and the grid's bad cases
    are refused."""
    accepted = 0
    for name in SCHEDULES:
        for p in (1, 2, 3, 4):
            for m in range(1, 13):
                for v in (1, 2, 3, 4):
                    try:
                        pipeline_schedules.check_schedule(name, p, m, v)
                    except ConfigError:
                        continue
                    every_forward_has_its_backward_once(name, p, m, v)
                    accepted += 1
    # gpipe, 1f1b, zb-h1 at v 1: 3 × 48; interleaved where p divides m (12 + 6 + 4 + 3), any v: 100; zb-v at v 2:
    # 48; dualpipev at v 2 where m ≥ 2p (11 + 9 + 7 + 5): 32
    assert accepted == 144 + 100 + 48 + 32


def test_bad_schedules_say_how_to_fix():
    with pytest.raises(ConfigError, match="multiple of --pp"):
        pipeline_schedules.build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ConfigError, match="only works with --schedule interleaved"):
        pipeline_schedules.build_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ConfigError, match="too few for 16 stages"):
        pipeline_stages.stage_specs(PRESETS["tiny"], 4, 4, 32)
    with pytest.raises(ConfigError, match="needs --microbatches ≥ 2 × --pp"):
        pipeline_schedules.build_schedule("dualpipev", 4, 7, 2)
    with pytest.raises(ConfigError, match="holds 2 stages per rank"):
        pipeline_schedules.build_schedule("zb-v", 4, 8, 1)


def test_partition_is_balanced_and_covers_every_layer():
    cfg = PRESETS["tiny"]
    for n in (1, 2, 3, 4, 8):
        parts = pipeline_stages.partition(cfg, n, 128)
        assert [i for part in parts for i in part] == list(range(cfg.n_layers))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert pipeline_stages.partition(cfg, 3, 128) == [(0, 1, 2), (3, 4, 5), (6, 7)]     # the head weighs on the last stage
    # more stages than layers (at most two more): the ends hold the embedding and the head alone, the head first
    assert pipeline_stages.partition(cfg, 10, 128) == [()] + [(i,) for i in range(8)] + [()]
    assert pipeline_stages.partition(cfg, 9, 128) == [(i,) for i in range(8)] + [()]
    with pytest.raises(ConfigError, match="at most 10 stages"):
        pipeline_stages.partition(cfg, 11, 128)
    table = pipeline_stages.partition_table(cfg, pipeline_stages.stage_specs(cfg, 2, 5, 128), 2, 128)
    assert table[0]["holds"] == "embed" and table[-1]["holds"] == "norm+head+loss"
    specs = pipeline_stages.stage_specs(cfg, 2, 2, 32)
    assert [s.index for s in pipeline_stages.rank_stages(specs, 2, 1)] == [1, 3] and specs[0].first and specs[-1].last
    v = pipeline_stages.stage_specs(cfg, 4, 2, 32, pipeline_schedules.stage_ranks("zb-v", 4, 2))
    assert [[s.index for s in pipeline_stages.rank_stages(v, 4, r)] for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_pruned_stage_keeps_reference_names():
    from common.model import build_model
    cfg = PRESETS["tiny"]
    specs = pipeline_stages.stage_specs(cfg, 4, 1, 32)
    full = dict(build_model(cfg, 7).named_parameters())
    names = set()
    for r in range(4):
        model = pipeline_stages.prune_to_stages(build_model(cfg, 7), pipeline_stages.rank_stages(specs, 4, r))
        for n, p in model.named_parameters():
            assert n in full and (p == full[n]).all()
            names.add(n)
    assert names == set(full)                        # the stages together hold the whole model once


def test_timeline_legend_lists_only_what_is_drawn():
    plot_timeline = import_module("03_pipeline_parallel.plot_timeline")
    one_f_one_b, zb = (plot_timeline.simulated_events(name, 4, 8) for name in ("1f1b", "zb-h1"))
    assert plot_timeline.legend_kinds([one_f_one_b]) == ["F", "B", "idle"]       # 1F1B has no W
    assert plot_timeline.legend_kinds([one_f_one_b, zb]) == ["F", "B", "W", "idle"]

