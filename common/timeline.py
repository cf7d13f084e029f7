"""Timeline recorder: what each rank did when, as a Chrome / Perfetto trace.

Every rank records spans (kind, start, end, plus labels such as the micro-batch). A timeline is only
worth drawing if all ranks stamp their spans on ONE clock; otherwise a stage can appear to start a
micro-batch before the previous stage has finished it.

One clock. Every rank reads `time.monotonic_ns()`: on Linux that is CLOCK_MONOTONIC, one counter kept
by the kernel for the whole machine, so the ranks of one machine (one kernel: same boot id) already
share it and need no correction. Ranks on other machines have their own counter with its own zero.
When a Timeline is created, each rank estimates its offset to rank 0's clock by ping-pong over the
default group (Cristian's algorithm): rank r stamps t0, sends, rank 0 replies with its own time T,
rank r stamps t1; then T ≈ (t0 + t1)/2 + offset, with an error of at most half the round trip. Of a
few rounds the one with the shortest round trip is kept. The offset is applied only to ranks whose
kernel differs from rank 0's; on one machine it is still estimated and recorded (it should be ~0,
within the round trip), as a check of the method.

No origin is taken per rank (a barrier releases the ranks at slightly different moments, so an
origin taken "right after the barrier" differs per rank: that skewed the old timelines by up to
70 ms on a loaded machine). Times stay absolute until `gather` brings every rank's spans to rank 0,
which shifts them so that the earliest span of any rank starts at 0, and `write_chrome_trace`
writes one JSON file that chrome://tracing or ui.perfetto.dev open directly (one row per rank), and
that `load_trace` reads back for plotting.

Kinds used by the pipeline chapter: F, B, W (compute), send (posting an isend, and the wait for
all sends at the end of the step), recv (time blocked waiting for a message), idle (gaps between
compute inside a step, derived when writing). The bubble is idle = not inside F, B, W or BW.
"""
import json
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist

COMPUTE = ("F", "B", "W", "BW")        # BW: B and W in one pass (03_pipeline_parallel/pipeline_actions.py)
CLOCK = "time.monotonic_ns (CLOCK_MONOTONIC on Linux: one clock per machine)"


def machine_clock_id() -> str:
    """Ranks with the same id read the same monotonic clock: the kernel's boot id on Linux."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return platform.node()


def estimate_offset_to_rank0(rounds: int = 8) -> dict:
    """Each rank's offset to rank 0's monotonic clock, by ping-pong (collective over the default group).

    Rank 0 answers every other rank in turn, `rounds` times. Returns this rank's
    {"offset_s": rank 0's clock − mine, "rtt_s": the shortest round trip (bound on the error × 2),
     "same_clock": same kernel as rank 0, so the offset is not applied}.
    Small messages on the default group: bookkeeping, not counted in comm_bytes."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {"offset_s": 0.0, "rtt_s": 0.0, "same_clock": True}
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = [machine_clock_id()]
    dist.broadcast_object_list(ids, src=0)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.zeros(1, dtype=torch.int64, device=device)
    if rank == 0:
        for peer in range(1, world):
            for _ in range(rounds):
                dist.recv(t, src=peer)
                t.item()                                 # (on a GPU: wait until it has arrived)
                t.fill_(time.monotonic_ns())
                dist.send(t, dst=peer)
        return {"offset_s": 0.0, "rtt_s": 0.0, "same_clock": True}
    best = None
    for _ in range(rounds):
        t0 = time.monotonic_ns()
        dist.send(t, dst=0)
        dist.recv(t, src=0)
        theirs = t.item()
        t1 = time.monotonic_ns()
        if best is None or t1 - t0 < best[1]:
            best = (theirs - (t0 + t1) // 2, t1 - t0)
    return {"offset_s": best[0] / 1e9, "rtt_s": best[1] / 1e9, "same_clock": ids[0] == machine_clock_id()}


class Timeline:
    """Per-rank span recorder. Creating one is collective when a process group exists (clock offset)."""

    def __init__(self, rank: int, enabled: bool = True):
        self.rank, self.enabled = rank, enabled
        self.events: list[dict] = []
        self.step = 0
        self.clock = estimate_offset_to_rank0()
        # seconds to add to my clock to read rank 0's: 0 on rank 0's machine (one kernel, one clock)
        self.shift = 0.0 if self.clock["same_clock"] else self.clock["offset_s"]
        self.clock.update(rank=rank, applied_s=self.shift)
        self.clocks: list[dict] = [self.clock]           # every rank's, on rank 0 after `gather`

    def begin_step(self, step: int) -> None:
        """Label the spans that follow with `step` (no clock origin is taken here: see the docstring)."""
        self.step = step

    def now(self) -> float:
        """Seconds on the common clock (rank 0's monotonic clock)."""
        return time.monotonic_ns() / 1e9 + self.shift

    def add(self, kind: str, start: float, end: float, **args) -> None:
        if self.enabled:
            self.events.append({"rank": self.rank, "step": self.step, "kind": kind, "start": start, "end": end, **args})

    def step_events(self, step: int | None = None) -> list[dict]:
        step = self.step if step is None else step
        return [e for e in self.events if e["step"] == step]

    def gather(self, group=None, dst: int = 0) -> list[dict] | None:
        """Every rank's events on global rank `dst` (None elsewhere), shifted so that the earliest span
        of any rank starts at 0; `self.clocks` then holds every rank's clock estimate. Collective."""
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return shift_to_zero(list(self.events))
        out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
        dist.gather_object((self.events, self.clock), out, dst=dst, group=group)
        if out is None:
            return None
        self.clocks = [clock for _, clock in out]
        return shift_to_zero([e for evs, _ in out for e in evs])

    def clock_metadata(self) -> dict:
        """What the trace's metadata says about its clock (after `gather`, for every rank)."""
        return {"clock": CLOCK, "clock_offsets": self.clocks}


def shift_to_zero(events: list[dict]) -> list[dict]:
    """The origin chosen after gathering: the earliest start over all ranks becomes 0."""
    t0 = min((e["start"] for e in events), default=0.0)
    return [{**e, "start": e["start"] - t0, "end": e["end"] - t0} for e in events]


def busy_seconds(events: list[dict]) -> float:
    """Seconds inside at least one of the events' spans: their sum when they do not overlap (a rank's one
    thread), each moment counted once when a rank's second thread computes at the same time (chapter 05's
    DualPipeV pairs), so that a pipeline's bubble never goes below 0."""
    return length(union((e["start"], e["end"]) for e in events))


# --- time as sets of intervals: (start, end) pairs, sorted and disjoint ----------------------------------

def union(spans) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as `spans`; overlapping ones merge (two that only
    touch stay two, so spans that never overlap keep their own lengths, to the bit)."""
    out = []
    for s, e in sorted(spans):
        if out and s < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def minus(a: list, b: list) -> list[tuple[float, float]]:
    """The parts of union `a` outside union `b` (both sorted and disjoint)."""
    out = []
    for s, e in a:
        for bs, be in b:
            if be <= s or bs >= e:
                continue
            if bs > s:
                out.append((s, bs))
            s = max(s, be)
            if s >= e:
                break
        if s < e:
            out.append((s, e))
    return out


def length(spans: list) -> float:
    return sum(e - s for s, e in spans)


def busy_and_span(events: list[dict], kinds=COMPUTE) -> tuple[dict, dict]:
    """Per (step, rank): seconds of compute (busy_seconds), and (first start, last end) of compute."""
    mine, span = {}, {}
    for e in events:
        if e["kind"] not in kinds:
            continue
        key = (e["step"], e["rank"])
        mine.setdefault(key, []).append(e)
        s0, s1 = span.get(key, (e["start"], e["end"]))
        span[key] = (min(s0, e["start"]), max(s1, e["end"]))
    return {key: busy_seconds(evs) for key, evs in mine.items()}, span


def bubble_fraction(events: list[dict], step: int | None = None) -> float:
    """Idle share of the pipeline: 1 - Σ_ranks compute / (ranks × step length), averaged over steps.

    Compute is the time inside F, B and W spans; everything else (waiting for a message, sending,
    Python between actions) is idle. The step length is the time from the earliest compute start to
    the latest compute end over all ranks (the part of the step the schedule is responsible for;
    the optimizer is left out).
    """
    busy, span = busy_and_span(events)
    steps = sorted({s for s, _ in busy}) if step is None else [step]
    fractions = []
    for s in steps:
        ranks = [r for (st, r) in busy if st == s]
        t0 = min(span[(s, r)][0] for r in ranks)
        t1 = max(span[(s, r)][1] for r in ranks)
        fractions.append(1 - sum(busy[(s, r)] for r in ranks) / (len(ranks) * (t1 - t0)))
    return sum(fractions) / len(fractions) if fractions else 0.0


def idle_events(events: list[dict]) -> list[dict]:
    """The gaps between compute spans of each rank inside each step, as 'idle' events."""
    busy, span = busy_and_span(events)
    out = []
    for step in sorted({s for s, _ in busy}):
        ranks = [r for (s, r) in busy if s == step]
        t0 = min(span[(step, r)][0] for r in ranks)
        t1 = max(span[(step, r)][1] for r in ranks)
        for r in ranks:
            spans = sorted((e["start"], e["end"]) for e in events
                           if e["step"] == step and e["rank"] == r and e["kind"] in COMPUTE)
            cursor = t0
            for s, e in spans + [(t1, t1)]:
                if s - cursor > 1e-6:
                    out.append({"rank": r, "step": step, "kind": "idle", "start": cursor, "end": s})
                cursor = max(cursor, e)
    return out


def write_chrome_trace(path, events: list[dict], metadata: dict | None = None) -> Path:
    """Write events (+ derived idle spans) as Chrome trace JSON: one process, one thread row per rank."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    trace = []
    for e in sorted(events + idle_events(events), key=lambda e: (e["rank"], e["start"])):
        args = {k: v for k, v in e.items() if k not in ("rank", "kind", "start", "end")}
        name = e["kind"] + (str(e["mb"]) if "mb" in e else "")
        trace.append({"name": name, "cat": e["kind"], "ph": "X", "pid": 0, "tid": _row(e),
                      "ts": e["start"] * 1e6, "dur": (e["end"] - e["start"]) * 1e6, "args": args})
    for e in {_row(e): e for e in events}.values():
        label = f"rank {e['rank']}" + (f", {e['thread']} thread" if "thread" in e else "")
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": _row(e), "args": {"name": label}})
    path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms", "metadata": metadata or {}}))
    return path


def _row(e: dict) -> int:
    """A rank's row of the trace; spans from a second thread of the rank (chapter 05's pairs, labelled
    "thread") on a row of their own below all ranks."""
    return e["rank"] + (1000 if "thread" in e else 0)


def load_trace(path) -> tuple[list[dict], dict]:
    """Read a trace written by `write_chrome_trace` back into (events, metadata); idle spans dropped."""
    data = json.loads(Path(path).read_text())
    events = []
    for t in data["traceEvents"]:
        if t.get("ph") != "X" or t["cat"] == "idle":
            continue
        events.append({"rank": t["tid"] % 1000, "kind": t["cat"], "start": t["ts"] / 1e6,
                       "end": (t["ts"] + t["dur"]) / 1e6, **t.get("args", {})})
    return events, data.get("metadata", {})
