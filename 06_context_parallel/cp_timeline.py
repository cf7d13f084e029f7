"""`train_cp.py --timeline PATH`: when each rank's ring attention computes, and when it waits for a block.

The ring's forward takes a `span`, a timer of each part of a ring step: posting the next hop, computing on
the held block and waiting for the next one. With --timeline, train_cp.py hands every attention
`ring_spans(timeline)` (attention_bookkeeping.RingSpans, which bench_cp.py's overlap part uses too), and
those spans go into a common/timeline.Timeline: every rank's are gathered on rank 0, written as a
Chrome / Perfetto trace, and summed per rank into one line each. That is where the contiguous split's
imbalance shows as time: rank r computes r+1 of the cp blocks (a skipped block costs nothing), so the
last rank computes cp times what rank 0 does, and rank 0 spends the difference waiting.

Why the step time hides it on a laptop: cp ranks share a few cores, so a rank that waits gives its core
to one that computes, and the step lasts about the total work ÷ the cores, the same for both splits (the
total differs only by the diagonal's masked half). With one GPU per rank, a waiting GPU helps nobody: the
step lasts as long as the busiest rank, cp times the idlest's work with the contiguous split."""
from common.timeline import Timeline, write_chrome_trace

from .attention_bookkeeping import RingSpans
from .ring_attention import untimed

KINDS = ("compute", "wait", "post")


def start(path, rank: int) -> Timeline:
    """The run's timeline (collective: the ranks' clocks are compared); it records only when `path` is set."""
    return Timeline(rank, enabled=path is not None)


def ring_spans(timeline: Timeline):
    """The ring's `span` for this run: its steps' parts on `timeline` if it records, else nothing timed."""
    return RingSpans(timeline) if timeline.enabled else untimed


def seconds_per_rank(events: list[dict]) -> dict[int, dict[str, float]]:
    """{rank: {kind: wall seconds, "compute_cpu": CPU seconds computing}} of the ring's spans, summed over every
    step and layer. The CPU seconds are the work: on shared cores a rank is descheduled mid-span, which its
    wall-clock span counts."""
    out: dict[int, dict[str, float]] = {}
    for e in events:
        if e["kind"] in KINDS:
            per = out.setdefault(e["rank"], dict.fromkeys(KINDS + ("compute_cpu",), 0.0))
            per[e["kind"]] += e["end"] - e["start"]
            per["compute_cpu"] += e.get("cpu_s", 0.0) if e["kind"] == "compute" else 0.0
    return dict(sorted(out.items()))


def finish(timeline: Timeline, path, rt, log, metadata: dict) -> None:
    """Gather every rank's spans on rank 0 (a collective), write the trace, print one line per rank."""
    if path is None:
        return
    events = timeline.gather()
    if not rt.is_main:
        return
    write_chrome_trace(path, events, {**metadata, **timeline.clock_metadata()})
    log.note(f"timeline written: {path} (chrome://tracing or ui.perfetto.dev; one row per rank)")
    for rank, s in seconds_per_rank(events).items():
        log.note(f"  rank {rank}: ring attention forward, all steps and layers: computing {s['compute_cpu'] * 1e3:6.1f} ms "
                 f"of CPU ({s['compute'] * 1e3:6.1f} ms wall), waiting for a block {s['wait'] * 1e3:6.1f} ms, "
                 f"posting {s['post'] * 1e3:5.1f} ms")
