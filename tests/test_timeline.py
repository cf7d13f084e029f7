"""Timelines that cannot lie: a real 4-rank pipeline run, every rank's spans on one clock.

A stage receives micro-batch k's activation only after the previous stage has computed and sent it,
so on a common clock F(k) on stage s must start after F(k) on stage s-1 has ended, whatever the load
on the machine; likewise each B waits for the next stage's B. Before the clock fix (an origin per
rank taken when it left a barrier) this failed by up to tens of ms on a busy machine.
"""
import pytest
from harness import ok, run_group

from common.timeline import COMPUTE, bubble_fraction, load_trace

PP = "03_pipeline_parallel.train_pp:main"
BASE = ["--steps", "3", "--seq-len", "32", "--global-batch", "8", "--microbatches", "8", "--quiet"]
SCHEDULES = ("1f1b", "zb-h1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("timeline")
    traces = {name: tmp / f"{name}.json" for name in SCHEDULES}
    results = run_group(4, [(PP, BASE + ["--schedule", name, "--timeline", str(path)]) for name, path in traces.items()])
    return {name: (ok(res), *load_trace(traces[name])) for name, res in zip(SCHEDULES, results)}


def spans(events, kind):
    return {(e["step"], e["stage"], e["mb"]): (e["start"], e["end"]) for e in events if e["kind"] == kind}


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_message_arrives_after_it_was_computed(runs, name):
    _, events, meta = runs[name]
    F, B = spans(events, "F"), spans(events, "B")
    p = meta["pp"]
    assert len(F) == len(B) == 3 * 8 * p                        # every step, micro-batch and stage
    for (step, s, k), (start, _) in F.items():
        if s > 0:
            assert start >= F[(step, s - 1, k)][1], f"step {step}: F{k} on stage {s} starts before stage {s - 1} ends it"
    for (step, s, k), (start, _) in B.items():
        if s < p - 1:
            assert start >= B[(step, s + 1, k)][1], f"step {step}: B{k} on stage {s} starts before stage {s + 1} ends it"


@pytest.mark.parametrize("name", SCHEDULES)
def test_sends_and_receives_are_spans_of_their_own(runs, name):
    _, events, _ = runs[name]
    for rank in range(4):
        mine = sorted((e for e in events if e["rank"] == rank), key=lambda e: e["start"])
        assert any(e["kind"] == "send" for e in mine) and any(e["kind"] == "recv" for e in mine)
        compute = [(e["start"], e["end"]) for e in mine if e["kind"] in COMPUTE]
        for e in mine:                          # no send or recv inside an F, B or W box
            if e["kind"] in ("send", "recv"):
                assert all(e["end"] <= s or e["start"] >= t for s, t in compute), e
    F, B = spans(events, "F"), spans(events, "B")
    for e in events:                            # a message goes out after the F or B that made it
        if e["kind"] == "send" and "mb" in e:
            made_by = F[(e["step"], e["stage"] - 1, e["mb"])] if e["what"] == "act" else B[(e["step"], e["stage"] + 1, e["mb"])]
            assert e["start"] >= made_by[1], e


def test_one_clock_and_its_record(runs):
    history, events, meta = runs["1f1b"]
    assert min(e["start"] for e in events) == 0                 # the origin: the earliest span of any rank
    clocks = meta["clock_offsets"]
    assert [c["rank"] for c in clocks] == [0, 1, 2, 3]
    for c in clocks:                            # one machine: the same clock, estimated offset ~0
        assert c["same_clock"] and c["applied_s"] == 0
        assert abs(c["offset_s"]) <= c["rtt_s"] / 2 + 1e-9    # the true offset is 0: error ≤ RTT/2
    for row in history:                         # the metrics' bubble is the trace's, step by step
        assert row["bubble_fraction"] == pytest.approx(bubble_fraction(events, row["step"]), rel=1e-9)
        assert row["mfu"] > 0


def test_busy_seconds_counts_overlapping_spans_once():
    """A rank's compute: the sum of its spans on one thread; where a second thread computes at the same
    time (chapter 05's pairs), each moment once."""
    from common.timeline import busy_seconds
    span = lambda start, end: {"start": start, "end": end}                    # noqa: E731
    assert busy_seconds([span(0.0, 1.0), span(2.0, 3.5)]) == 2.5
    assert busy_seconds([span(1.0, 3.0), span(0.0, 2.0)]) == 3.0
    assert busy_seconds([span(0.0, 5.0), span(1.0, 2.0), span(4.0, 6.0)]) == 6.0


def test_time_as_sets_of_intervals():
    """union merges what overlaps (touching spans stay two), minus cuts out every piece of b, on either side
    and inside, and length adds what is left: the arithmetic behind busy_seconds and chapter 05's exposed
    all-to-all."""
    from common.timeline import length, minus, union
    assert union([(2.0, 3.0), (0.0, 1.0), (0.5, 1.5), (1.5, 2.0)]) == [(0.0, 1.5), (1.5, 2.0), (2.0, 3.0)]
    a = union([(0.0, 10.0), (12.0, 14.0)])
    b = union([(1.0, 2.0), (4.0, 5.0), (9.0, 13.0)])
    assert minus(a, b) == [(0.0, 1.0), (2.0, 4.0), (5.0, 9.0), (13.0, 14.0)]
    assert minus(b, a) == [(10.0, 12.0)]
    assert length(minus(a, b)) == 1.0 + 2.0 + 4.0 + 1.0
    assert minus(a, []) == a and minus([], b) == []
