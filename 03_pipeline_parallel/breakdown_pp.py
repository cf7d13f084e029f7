"""Chapter 03: where a pipeline step's time goes, ours and torch.distributed.pipelining's, p = 2 and 4.

    python 03_pipeline_parallel/breakdown_pp.py        # torchrun at 2 and 4 ranks, about 3 min on 2 cores
    python 03_pipeline_parallel/breakdown_pp.py --v-schedules   # ZB-V and DualPipeV instead, about 2 min

Writes 03_pipeline_parallel/results/pp_breakdown.md (--v-schedules: pp_breakdown_v.md). Every schedule runs four times on the same
configuration as bench_pp.py's throughput table (m = 8, 16 × 128 tokens per step): ours as the
chapter runs it (timeline and activation meter on), ours with --no-activation-meter, ours posting
each irecv one action ahead as it does with NCCL (train_pp.py's hidden --irecv-one-ahead, instead of all
at the step's start, as with gloo: pipeline_executor.py, "When to post"), and PyTorch's.

A stopwatch watches the calls of the functions that do each kind of work (sys.settrace: Python tells it
where each call of this thread begins and, for the named functions, where it ends; nothing is replaced)
and charges each call its OWN time (its named callees' time subtracted), so the parts add up to the time
of the step's forward_backward:
  F, B, W      the stage's compute (ours: the executor's _forward/_backward (and _whole_backward: a BW is
               counted as B)/_weights; torch's: the stage module's forward and loss, and its stage_backward /
               _input / _weight)
  waiting      blocked until a message has arrived (ours: receive and wait_sends, less the posting
               done inside them; torch's: _wait_batch_p2p)
  posting      handing an isend or irecv to the backend (ours: common.comm.send / recv; torch's:
               _batch_p2p)
  measurement  ours only: the MeasuredExecutor's own lines (timeline spans, the activation meter).
               The meter's pack hook runs inside each F, so the F column holds it: the run with
               --no-activation-meter shows the whole meter's cost as the difference of the totals
  runtime      the rest: the executor's (or torch's runtime's) own Python between the pieces above,
               cutting the batch into micro-batches included
Each value is ms per step: the mean over the ranks of the median over steps 3..8 of two runs (alternated rounds). The
stopwatch's cost is spread over the parts: its trace function runs at every Python call of the step (one
dictionary look-up for a call it does not time), and at the start and end of the few hundred it times.
"""
import argparse
import inspect
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from importlib import import_module
from itertools import product
from pathlib import Path

import torch.distributed as dist
from torch.distributed.pipelining import schedules, stage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import comm  # noqa: E402
from common.distributed import init_distributed  # noqa: E402
from common.errors import run_main  # noqa: E402
from common.launch import launch  # noqa: E402

pipeline_executor = import_module("03_pipeline_parallel.pipeline_executor")   # this chapter: the executor
measured_executor = import_module("03_pipeline_parallel.measured_executor")   # and what it measures
pipeline_trainer = import_module("03_pipeline_parallel.pipeline_trainer")     # the step verbs around it
torch_pipelining = import_module("03_pipeline_parallel.torch_pipelining")     # PyTorch's runtime
train_pp = import_module("03_pipeline_parallel.train_pp")                     # the training loop

HERE = Path(__file__).resolve().parent
OUT = HERE / "results"
SCHEDS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]
V_SCHEDS = [("zb-v", 2), ("dualpipev", 2)]                                    # --v-schedules
RUNS = {"ours": ["--impl", "ours"], "ours, no meter": ["--impl", "ours", "--no-activation-meter"],
        "ours, irecv one ahead": ["--impl", "ours", "--irecv-one-ahead"], "torch": ["--impl", "torch"]}
PARTS = ("F", "B", "W", "waiting", "posting", "measurement", "runtime")      # F: with torch's "loss"
SKIP = 2                                       # steps 1..2: warm-up (allocations, the zero-bubble split)
ROUNDS = 2                                     # every run twice, the rounds alternated; their steps pooled


def code_of(owner, name: str):
    """The code object of the function `name` defined on `owner` (a class or a module), under its decorators:
    what a frame running it holds as f_code."""
    fn = owner.__dict__[name]
    return inspect.unwrap(getattr(fn, "__func__", fn)).__code__


class Stopwatch:
    """Exclusive time per part, per step, of the functions in `targets` ((owner, attribute name, part)),
    watched inside `with watch.timing():` through sys.settrace; nothing is replaced. A call's callees that
    are timed too are subtracted from it. The outermost timed call (forward_backward) ends a step."""

    def __init__(self, targets):
        self.parts = {code_of(owner, name): part for owner, name, part in targets}
        self.stack: list[list] = []            # each open timed call: [part, start, time in timed callees]
        self.now: dict = defaultdict(float)    # this step so far: part -> seconds (and "n F" -> calls)
        self.steps: list[dict] = []

    def _call(self, frame, event, arg):
        """Python calls this at the start of every call of this thread: a timed function's frame gets
        `_end` as its own tracer (its return), any other none (no more events from it)."""
        part = self.parts.get(frame.f_code)
        if part is None:
            return None
        frame.f_trace_lines = False
        self.stack.append([part, time.perf_counter(), 0.0])
        return self._end

    def _end(self, frame, event, arg):
        if event != "return":                  # (an exception passing through: its return follows)
            return self._end
        part, start, inner = self.stack.pop()
        took = time.perf_counter() - start
        self.now[part] += took - inner
        self.now[f"n {part}"] += 1
        if self.stack:
            self.stack[-1][2] += took
        else:                                  # forward_backward returned: one step
            self.now["step"] = took
            self.steps.append(dict(self.now))
            self.now.clear()
        return None

    @contextmanager
    def timing(self):
        sys.settrace(self._call)
        try:
            yield self
        finally:
            sys.settrace(None)


def timed_functions():
    """What the stopwatch wraps, ours and torch's, with the part each one's own time belongs to."""
    executor = pipeline_executor.PipelineExecutor
    ours = [(pipeline_trainer.PipelineTrainer, "forward_backward", "runtime"), (executor, "run", "runtime"),
            (executor, "_forward", "F"), (executor, "_backward", "B"), (executor, "_whole_backward", "B"),
            (executor, "_weights", "W"),
            (executor, "receive", "waiting"), (executor, "wait_sends", "waiting"),
            (comm, "send", "posting"), (comm, "recv", "posting")]
    ours += [(measured_executor.MeasuredExecutor, name, "measurement")
             for name in ("run", "receive", "compute", "send", "wait_sends", "_count_activations")]
    theirs = [(torch_pipelining.TorchPipelineTrainer, "forward_backward", "runtime"),
              (torch_pipelining.ChunkModule, "forward", "F"),
              (schedules._PipelineSchedule, "_compute_loss", "loss"), (stage, "stage_backward", "B"),
              (stage, "stage_backward_input", "B"), (stage, "stage_backward_weight", "W"),
              (schedules, "_batch_p2p", "posting"), (schedules, "_wait_batch_p2p", "waiting")]
    return ours + theirs


def worker(p: int, tmp: Path, scheds: list) -> None:
    """Runs inside torchrun: every schedule × run, timed; rank 0 writes every rank's steps."""
    init_distributed()
    results = defaultdict(list)
    for _, (name, v), (run, flags) in product(range(ROUNDS), scheds, RUNS.items()):
        argv = ["--seq-len", "128", "--quiet", "--warmup", "2", "--schedule", name, "--virtual-stages", str(v),
                "--microbatches", "8", "--global-batch", "16", "--steps", "8"] + flags
        with Stopwatch(timed_functions()).timing() as watch:
            train_pp.main(argv)
        every = [None] * p if dist.get_rank() == 0 else None
        dist.gather_object(watch.steps[SKIP:], every, dst=0)
        if every:                                           # rank 0: every rank's timed steps, rounds pooled
            results[f"{name} {run}"] = [mine + steps for mine, steps in
                                        zip(results[f"{name} {run}"] or [[] for _ in every], every)]
    if dist.get_rank() == 0:
        (tmp / f"p{p}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def per_step_ms(ranks: list[list[dict]], key: str) -> float:
    """Mean over ranks of the median over steps, in ms. F includes torch's loss, timed apart."""
    keys = (key, "loss") if key == "F" else (key,)
    return statistics.mean(statistics.median(1e3 * sum(s.get(k, 0.0) for k in keys) for s in steps)
                           for steps in ranks)


def per_action_ms(ranks: list[list[dict]], kind: str) -> float | None:
    calls = sum(s.get(f"n {kind}", 0) for steps in ranks for s in steps)
    keys = (kind, "loss") if kind == "F" else (kind,)
    time_in = sum(s.get(k, 0.0) for steps in ranks for s in steps for k in keys)
    return 1e3 * time_in / calls if calls else None


def report(all_results: dict, scheds: list) -> list[str]:
    flag = " --v-schedules" if scheds is V_SCHEDS else ""
    lines = ["# Chapter 03 — where a pipeline step's time goes", "",
             f"Command: `python 03_pipeline_parallel/breakdown_pp.py{flag}` (2-core CPU, gloo, `tiny` model, m = 8, "
             "16 × 128 tokens per step). ms per step: mean over ranks of the median over steps 3..8 of two runs; each "
             "call's own time (see the file's docstring). `measurement`: the timeline and the meter's lines "
             "in MeasuredExecutor; the meter's hook itself is inside F, so its whole cost is the step "
             "difference between `ours` and `ours, no meter`. Per action: the mean over every rank's "
             "actions; torch's stage B on rank 0 of zb-h1, which does nothing, lowers its B.", "",
             "| p | schedule | run | step ms | F | B | W | waiting | posting | measurement | runtime | "
             "per action F / B / W ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p, res in sorted(all_results.items()):
        for name, _ in scheds:
            for run in RUNS:
                ranks = res[f"{name} {run}"]
                parts = [per_step_ms(ranks, k) for k in PARTS]
                cells = ["" if run == "torch" and k == "measurement" else f"{x:.1f}" for k, x in zip(PARTS, parts)]
                actions = " / ".join("–" if x is None else f"{x:.1f}" for x in (per_action_ms(ranks, k) for k in "FBW"))
                lines.append(f"| {p} | {name} | {run} | {per_step_ms(ranks, 'step'):.1f} | " + " | ".join(cells)
                             + f" | {actions} |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--v-schedules", action="store_true", help="ZB-V and DualPipeV instead of the loop schedules")
    ap.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    scheds = V_SCHEDS if args.v_schedules else SCHEDS
    if args.worker:
        return worker(args.worker, Path(args.tmp), scheds)
    tmp = Path(tempfile.mkdtemp(prefix="breakdown_pp_"))
    results = {}
    for p in (2, 4):
        launch(__file__, p, ["--worker", p, "--tmp", tmp] + (["--v-schedules"] if args.v_schedules else []))
        results[p] = {k: v for k, v in json.loads((tmp / f"p{p}.json").read_text()).items()}
    lines = report(results, scheds)
    OUT.mkdir(exist_ok=True)
    (OUT / f"pp_breakdown{'_v' if args.v_schedules else ''}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    run_main(main)
