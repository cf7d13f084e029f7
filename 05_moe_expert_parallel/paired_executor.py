"""DualPipeV's pairs run as pairs: one micro-batch's forward beside another's backward, on one rank.

Chapter 03's DualPipeV (03_pipeline_parallel/v_schedules.py) issues, in its steady state, the forward of
one micro-batch on one stage together with the whole backward of an older one on the other stage of the V:
one action, a Pair (03_pipeline_parallel/pipeline_actions.py); chapter 03's executor runs the two one after
the other. Its point
is for a runtime to run them TOGETHER, so that while one waits in an all-to-all (the experts' dispatch or
combine, inside every MoE layer, forward and backward) the other computes. This executor does:

    F(i, s) ─ forward thread:  attention, route, [dispatch ~~wait~~], experts, [combine ~~wait~~], ...
    BW(j, t) ─ this thread:    ... backward of the experts, [a2a ~~wait~~], attention backward, ...
                               (one whole backward pass, input and weight gradients)

  - the pair's messages are received before it starts and sent after it ends, in the schedule's order
    (chapter 03's channels are matched in order: two threads sending would race);
  - the two threads must not share a communicator: the EP peers of this rank (the same pipeline rank in
    other dp coordinates, running the same pairs) would see the two threads' all-to-alls in whatever order
    the threads reached them. The backward talks on a twin of each group (common/comm.on_twins): the
    same ranks, their own communicator, so each communicator sees one thread's exchanges in schedule order;
  - gradients accumulate only in the backward's thread; the forward's saves its activations. Neither
    reads what the other writes, so the result is the same sums in the same order: equal to one device.

What overlaps where. On this CPU the ranks share two cores, so two threads of one rank do not compute
faster than one: what the pair hides is WAITING, the time an all-to-all spends until its slowest peer
arrives, under the other micro-batch's compute. `exposed_all_to_all` measures it from the timeline: the
time a rank waits in an all-to-all while neither of its threads computes. On GPUs the same pair needs a
second CUDA stream for the forward's kernels and the transfers running on their own engines (DeepSeek-V3
also splits the SMs between compute and communication); this course runs its pairs on CPU threads only.
"""
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from importlib import import_module

import torch.distributed as dist

from common import comm

pipeline_executor = import_module("03_pipeline_parallel.pipeline_executor")     # chapter 03: the executor
measured_executor = import_module("03_pipeline_parallel.measured_executor")     # and its measured form
pipeline_actions = import_module("03_pipeline_parallel.pipeline_actions")       # the actions' kinds
from common.timeline import COMPUTE, length, minus, union                        # noqa: E402


def twin_groups(mesh, dims: tuple) -> dict:
    """{this rank's group of each dim: its twin}, the same ranks on a communicator of their own. Collective:
    every rank creates every line's twin, in the same order (torch.distributed.new_group's rule)."""
    twins = {}
    for dim in dims:
        for line in mesh.lines(dim):
            twin = dist.new_group(line)
            if mesh.rank in line:
                twins[mesh.group(dim)] = twin
    return twins


class PairedExecutor(measured_executor.MeasuredExecutor):
    """Chapter 03's measured executor, whose Pairs run on two threads; `twins`: twin_groups' map, the
    groups the backward of a pair talks on. Every other action runs as chapter 03 runs it."""

    def __init__(self, *args, twins: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.twins = twins
        self.forward_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self.pairs_run = 0                              # pairs of the last step (the tests read it)
        self.meter_lock = threading.Lock()              # the activation meter's sums, from two threads

    def run_actions(self, actions, tokens: list, targets: list, on_stage_grads_ready) -> None:
        last_grad_action = pipeline_executor.last_grad_actions(actions)
        self.pairs_run = 0
        for i, a in enumerate(actions):
            if a.kind == pipeline_actions.OVERLAP:
                self.run_pair(a, tokens, targets)
                self.pairs_run += 1
            else:
                outgoing = self.compute(a, self.receive(a), tokens, targets)
                if outgoing is not None:
                    self.send(*outgoing)
            for stage in {u.stage for u in pipeline_actions.units([a])}:
                if last_grad_action[stage] == i:
                    on_stage_grads_ready(stage)

    def _count_activations(self, a, saved: list) -> None:
        with self.meter_lock:
            super()._count_activations(a, saved)

    def run_pair(self, pair, tokens: list, targets: list) -> None:
        f, b = pair.forward, pair.backward                            # an F, and a BW on another stage
        got_f, got_b = self.receive(f), self.receive(b)               # both inputs first (mb, S, D)
        forward = self.forward_thread.submit(self.compute, f, got_f, tokens, targets)
        with comm.on_twins(self.twins):                               # the backward on its own communicators
            out_b = self.compute(b, got_b, tokens, targets)
        out_f = forward.result()                                      # (re-raises the forward's error)
        for outgoing in (out_f, out_b):                               # in the schedule's order: F's, then B's
            if outgoing is not None:
                self.send(*outgoing)


@contextmanager
def _timed(timeline, name: str):
    start = timeline.now()
    try:
        yield
    finally:
        thread = threading.current_thread().name
        timeline.add("a2a", start, timeline.now(), what=name,
                     **({} if thread == "MainThread" else {"thread": thread}))


def time_all_to_alls(timeline) -> None:
    """Every all-to-all of this process from now on leaves an "a2a" span on `timeline` (with its thread)."""
    comm.time_all_to_alls(lambda name: _timed(timeline, name))


# --- what the timeline says ------------------------------------------------------------------------------

def step_metrics(timeline, executor) -> dict:
    """The metrics row's all-to-all numbers for this rank's last step, and the pairs it ran two at once."""
    return {**exposed_all_to_all(timeline.step_events()), "pairs_run": getattr(executor, "pairs_run", 0)}


def exposed_all_to_all(events: list[dict]) -> dict:
    """One rank's one step: {"a2a_wait_s": the time inside its all-to-alls during its actions,
    "a2a_exposed_s": the part of it while no thread of the rank computed}. Computing is being inside an
    action (F, B, W) and not inside one of that thread's all-to-alls. Run one action at a time, the two are
    equal; a pair hides what one thread waits under the other's compute."""
    actions = union((e["start"], e["end"]) for e in events if e["kind"] in COMPUTE)
    threads = {e.get("thread") for e in events if e["kind"] in COMPUTE or e["kind"] == "a2a"}
    computing, waiting = [], []
    for t in threads:
        mine = [e for e in events if e.get("thread") == t]
        a2a = union((e["start"], e["end"]) for e in mine if e["kind"] == "a2a")
        computing += minus(union((e["start"], e["end"]) for e in mine if e["kind"] in COMPUTE), a2a)
        waiting += a2a
    waiting = minus(union(waiting), minus(union(waiting), actions))     # inside the actions only
    return {"a2a_wait_s": length(waiting), "a2a_exposed_s": length(minus(waiting, union(computing)))}
