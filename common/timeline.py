"""Timeline recorder: what each rank did when, as a Chrome / Perfetto trace.

Every rank records spans (kind, start, end, plus labels such as the micro-batch) with its own clock,
measured from a common origin: `begin_step()` is called right after a barrier, so the ranks' step
origins agree to within the barrier's skew (microseconds on one machine). At the end the spans are
gathered to rank 0 (`gather`), which writes one JSON file that chrome://tracing or ui.perfetto.dev
open directly (one row per rank), and that `load_trace` reads back for plotting.

Kinds used by the pipeline chapter: F, B, W (compute), send, recv (time blocked waiting for a peer),
idle (gaps between compute inside a step, derived when writing), optimizer.
"""
import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

COMPUTE = ("F", "B", "W")


class Timeline:
    def __init__(self, rank: int, enabled: bool = True):
        self.rank, self.enabled = rank, enabled
        self.events: list[dict] = []
        self.step, self.origin = 0, time.perf_counter()
        self._step_t0 = 0.0

    def begin_step(self, step: int) -> None:
        """Mark the start of a step (call right after a barrier so every rank's mark is the same moment)."""
        self.step = step
        self._step_t0 = time.perf_counter()
        if step == 1 or not self.events:
            self.origin = self._step_t0

    def now(self) -> float:
        return time.perf_counter()

    def add(self, kind: str, start: float, end: float, **args) -> None:
        if self.enabled:
            self.events.append({"rank": self.rank, "step": self.step, "kind": kind,
                                "start": start - self.origin, "end": end - self.origin, **args})

    @contextmanager
    def span(self, kind: str, **args):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, t, time.perf_counter(), **args)

    def step_events(self, step: int | None = None) -> list[dict]:
        step = self.step if step is None else step
        return [e for e in self.events if e["step"] == step]

    def gather(self, group=None, dst: int = 0) -> list[dict] | None:
        """Every rank's events on global rank `dst` (None elsewhere). Collective over `group`."""
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return list(self.events)
        out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
        dist.gather_object(self.events, out, dst=dst, group=group)
        return [e for evs in out for e in evs] if out is not None else None


def busy_and_span(events: list[dict], kinds=COMPUTE) -> tuple[dict, dict]:
    """Per (step, rank): seconds of compute, and (first start, last end) of compute."""
    busy, span = {}, {}
    for e in events:
        if e["kind"] not in kinds:
            continue
        key = (e["step"], e["rank"])
        busy[key] = busy.get(key, 0.0) + e["end"] - e["start"]
        s0, s1 = span.get(key, (e["start"], e["end"]))
        span[key] = (min(s0, e["start"]), max(s1, e["end"]))
    return busy, span


def bubble_fraction(events: list[dict], step: int | None = None) -> float:
    """Idle share of the pipeline: 1 - Σ_ranks compute / (ranks × step length), averaged over steps.

    The step length is the time from the earliest compute start to the latest compute end over all
    ranks (the part of the step the schedule is responsible for; the optimizer is left out).
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
        trace.append({"name": name, "cat": e["kind"], "ph": "X", "pid": 0, "tid": e["rank"],
                      "ts": e["start"] * 1e6, "dur": (e["end"] - e["start"]) * 1e6, "args": args})
    for r in sorted({e["rank"] for e in events}):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
    path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms", "metadata": metadata or {}}))
    return path


def load_trace(path) -> tuple[list[dict], dict]:
    """Read a trace written by `write_chrome_trace` back into (events, metadata); idle spans dropped."""
    data = json.loads(Path(path).read_text())
    events = []
    for t in data["traceEvents"]:
        if t.get("ph") != "X" or t["cat"] == "idle":
            continue
        events.append({"rank": t["tid"], "kind": t["cat"], "start": t["ts"] / 1e6,
                       "end": (t["ts"] + t["dur"]) / 1e6, **t.get("args", {})})
    return events, data.get("metadata", {})
