"""Chapter 03's bubble on paper (schedule_simulator.py): the simulated bubble against the closed forms, with
unit costs and with per-stage costs, gaps and hand-overs; pipeline_costs.fit_costs recovering the costs of a
synthetic trace; a simulated step through a trace file and back; the printed table. No processes, no timing."""
from importlib import import_module

import pytest

from common import timeline
from common.timeline import bubble_fraction

pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")
schedule_simulator = import_module("03_pipeline_parallel.schedule_simulator")
pipeline_costs = import_module("03_pipeline_parallel.pipeline_costs")
build, simulate = pipeline_schedules.build_schedule, schedule_simulator.simulate


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_bubble_matches_theory(p, m):
    for name in ("gpipe", "1f1b"):
        sim = schedule_simulator.simulate(pipeline_schedules.build_schedule(name, p, m), p)
        assert sim["bubble"] == pytest.approx(pipeline_schedules.theory_bubble(name, p, m))
    if m % p == 0:
        sim = schedule_simulator.simulate(pipeline_schedules.build_schedule("interleaved", p, m, 2), 2 * p)
        assert sim["bubble"] == pytest.approx(pipeline_schedules.theory_bubble("interleaved", p, m, 2))
    zb = schedule_simulator.simulate(pipeline_schedules.build_schedule("zb-h1", p, m), p)["bubble"]
    assert zb <= pipeline_schedules.theory_bubble("1f1b", p, m) + 1e-9
    assert zb == pytest.approx(pipeline_schedules.theory_bubble("zb-h1", p, m))     # m < p too (p=4, m=1: 2/3)
    for name in ("zb-v", "dualpipev") if m >= 2 * p else ("zb-v",):                  # F = B = W per half-stage
        sim = schedule_simulator.simulate(pipeline_schedules.build_schedule(name, p, m, 2), 2 * p)
        assert sim["bubble"] == pytest.approx(pipeline_schedules.theory_bubble(name, p, m, 2))
        if m >= 2 * p - 1:                                                           # the V full: (p-1)/(6m+p-1)
            assert sim["bubble"] == pytest.approx((p - 1) / (6 * m + p - 1)) and sim["bubble"] < zb


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_does_not_depend_on_the_forward_backward_ratio(name):
    """Equal stages: (p-1)/(m+p-1) whatever F and B cost, as long as every stage costs the same."""
    for p, m in [(2, 1), (2, 8), (3, 5), (4, 16)]:
        for f, b in [(1.0, 1.0), (1.0, 3.0), (2.5, 0.5)]:
            sim = simulate(build(name, p, m), p, {"F": f, "B": b})
            assert sim["bubble"] == pytest.approx((p - 1) / (m + p - 1))
            assert sim["makespan"] == pytest.approx((m + p - 1) * (f + b))


def test_handover_adds_one_latency_per_hop_of_each_wave():
    """GPipe: the forward wave crosses p-1 rank boundaries, the backward wave p-1 more; a hand-over h
    (no longer than an action) delays the step by exactly 2(p-1)·h and nothing else."""
    f, b, h = 1.0, 2.0, 0.25
    for p, m in [(2, 1), (2, 4), (4, 8)]:
        sim = simulate(build("gpipe", p, m), p, {"F": f, "B": b}, handover=h)
        assert sim["makespan"] == pytest.approx((m + p - 1) * (f + b) + 2 * (p - 1) * h)


def test_gap_is_paid_between_actions_of_one_rank_not_before_the_first():
    f, b, g = 1.0, 2.0, 0.1
    for m in (1, 3, 8):                        # one rank: m forwards and m backwards, 2m - 1 gaps between them
        assert simulate(build("1f1b", 1, m), 1, {"F": f, "B": b}, gap=g)["makespan"] == pytest.approx(
            m * (f + b) + (2 * m - 1) * g)


def test_zero_bubble_with_equal_costs_is_a_third_of_1f1b_s_slots():
    """ZB-H1 with F = B = W (any unit): (p-1) / (3m + p-1) once m ≥ p."""
    for p, m in [(2, 2), (2, 16), (4, 4), (4, 8)]:
        for c in (1.0, 2.5):
            sim = simulate(build("zb-h1", p, m), p, {"F": c, "B": c, "W": c})
            assert sim["bubble"] == pytest.approx((p - 1) / (3 * m + p - 1))


def synthetic_trace(name, p, m, v, cost, overhead):
    """A step as the executor's timeline would record it, made by simulate with known costs."""
    sim = simulate(build(name, p, m, v), p * v, cost, handover=overhead, gap=overhead)
    return sim, [{"rank": r, "step": 1, "kind": a.kind, "mb": a.mb, "stage": a.stage, "start": 5.0 + s,
                  "end": 5.0 + e} for r, a, s, e in sim["events"]]


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2), ("dualpipev", 2)])
def test_fit_recovers_the_costs_of_a_synthetic_trace(name, v):
    """Stage costs by kind, and each rank's gap and hand-over, read back from the spans alone; fed back
    into simulate they give the trace's bubble. (Gap = hand-over per rank here: when a message arrives
    within a gap of the rank becoming free, which of the two the rank paid cannot be told apart.)"""
    p, m = 2, 4
    per_stage = {(k, s): 1.0 + 0.3 * s + {"F": 0.0, "B": 0.9, "W": 0.4, "BW": 1.6}[k] for k in ("F", "B", "W", "BW")
                 for s in range(p * v)}
    overhead = {0: 0.05, 1: 0.2}
    sim, events = synthetic_trace(name, p, m, v, lambda r, a: per_stage[(a.kind, a.stage)],
                                  lambda r, a: overhead[r])
    fit = pipeline_costs.fit_costs(events, 1, p * v)
    for key, seconds in fit["cost"].items():
        assert seconds == pytest.approx(per_stage[key])
    assert fit["gap"] == pytest.approx(overhead) and fit["handover"] == pytest.approx(overhead)
    measured = bubble_fraction(events, 1)
    assert measured == pytest.approx(sim["bubble"])                  # one definition of the bubble
    for model in (pipeline_costs.mean_costs, pipeline_costs.own_times):
        assert simulate(build(name, p, m, v), p * v, **model(fit))["bubble"] == pytest.approx(measured)
    assert simulate(build(name, p, m, v), p * v, **pipeline_costs.stage_costs(fit))["bubble"] < measured


def test_timeline_roundtrip_and_bubble(tmp_path):
    sim = schedule_simulator.simulate(pipeline_schedules.one_f_one_b(2, 2), 2)
    events = [{"rank": r, "step": 1, "kind": a.kind, "start": s, "end": e, "mb": a.mb}
              for r, a, s, e in sim["events"]]
    assert bubble_fraction(events) == pytest.approx(sim["bubble"])
    path = timeline.write_chrome_trace(tmp_path / "t.json", events, {"schedule": "1f1b"})
    back, meta = timeline.load_trace(path)
    assert meta["schedule"] == "1f1b" and len(back) == len(events)
    assert bubble_fraction(back) == pytest.approx(sim["bubble"])


def test_print_schedule_table():
    text = schedule_simulator.format_schedule(pipeline_schedules.build_schedule("1f1b", 4, 8), 4)
    assert sum(line.startswith("rank ") for line in text.splitlines()) == 4 and "F7" in text and "B7" in text and "bubble 0.273" in text
