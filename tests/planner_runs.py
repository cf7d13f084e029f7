"""Jobs for the spawned ranks of tests/test_planner_runs.py: a training script's run, with the messages each
group's collectives and exchanges sent and received on this rank in the last step (one per call of
common.comm's counter: a collective, one message of a ring's exchange, one send or receive), and with every
tensor's bytes counted (common/live_memory.py: chapter 04's --measure-memory, here for chapters 05 and 06 too)."""
from collections import Counter
from contextlib import ExitStack
from importlib import import_module
from unittest import mock

from common import comm
from common.live_memory import LivePeak

trainer_4d = import_module("05_moe_expert_parallel.trainer_4d")


def run_counting_messages(script: str, argv: list, measure: bool = False) -> tuple[list[dict], dict]:
    """(the run's metrics rows, {group: messages in its last step}) on this rank; `measure`: each row's
    live_peak_bytes, the chapter 05 trainer (chapters 05 and 06 build theirs with it) measured whole."""
    calls, read, counter = Counter(), {}, comm.COUNTER
    add, reset, total, build = counter.add, counter.reset, counter.total, trainer_4d.build_trainer

    def counted(name, sent, received, *call):
        calls[name] += 1
        add(name, sent, received, *call)

    def restart():                          # the scripts reset the counter at the start of every step
        calls.clear()
        read.clear()
        reset()

    def metered(*name):                     # the step's bytes are read for its metrics row: its messages too
        read.setdefault("messages", dict(calls))     # (the bookkeeping after the row counts nothing here)
        return total(*name)
    with ExitStack() as patched:
        patched.enter_context(mock.patch.object(comm.COUNTER, "add", counted))
        patched.enter_context(mock.patch.object(comm.COUNTER, "reset", restart))
        patched.enter_context(mock.patch.object(comm.COUNTER, "total", metered))
        if measure:
            patched.enter_context(mock.patch.object(trainer_4d, "build_trainer",
                                                    lambda *a, **k: LivePeak(build(*a, **k))))
        rows = import_module(script).main(argv)
    return rows, read["messages"]
