"""Spawn a group of ranks once and run many checks inside it.

Starting a rank costs about a second, so a test module spawns one group per world size and runs all
its jobs there, in order, on every rank. A job is ("package.module:function", args...); it runs on
every rank after the default process group exists, and what it returns (or the error it raised)
comes back per rank:

    results = run_group(4, [("01_data_parallel.train_dp:main", ["--steps", "3", "--quiet"])])
    results[job][rank] -> ("ok", value) | ("config_error", message) | ("error", traceback text)

A rank that raised skips its remaining jobs; each of them reports the traceback that stopped it.
`ok` and `every_rank` fail with the ranks' tracebacks in the message.

The training scripts' `main(argv)` joins the existing process group instead of creating one, so the
same function a user runs under torchrun runs here.
"""
import importlib
import json
import multiprocessing as mp
from multiprocessing import forkserver
import os
import queue as queue_module
import shutil
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# how long a test waits for a launch that must fail at once (bad input): seconds alone, but under the suite's
# workers on two cores a rank's start-up (torch imported, ~5 s of CPU) has taken over a minute
REFUSAL_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(path: str):
    module, func = path.split(":")
    return getattr(importlib.import_module(module), func)


def _worker(rank, world, store_path, jobs, queue, timeout_s):
    import torch
    torch.set_num_threads(1)            # first thing: ranks share 2 cores
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import datetime
    import torch.distributed as dist
    from common.errors import ConfigError
    # The ranks meet through a file, not a TCP port: no port to pick, so none that another process
    # could take between our choosing it and rank 0 listening on it.
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    out = []
    for path, *args in jobs:
        started = time.perf_counter()
        try:
            out.append(("ok", _resolve(path)(*args)))
        except ConfigError as err:
            out.append(("config_error", str(err)))
        except BaseException:
            out.append(("error", traceback.format_exc()))
            break       # after an unexpected error the group may be out of step: stop here
        finally:
            _profile(rank, world, path, args, time.perf_counter() - started)
    queue.put((rank, out))
    queue.close()
    queue.join_thread()                 # the results are in the pipe
    dist.destroy_process_group()
    from common.errors import exit_now
    exit_now(0)                         # no interpreter teardown: see common/errors.py for the race it avoids


def _profile(rank: int, world: int, path: str, args, seconds: float) -> None:
    """With HARNESS_PROFILE=file, rank 0 appends each job's seconds there: where a group's time goes."""
    if rank == 0 and os.environ.get("HARNESS_PROFILE"):
        with open(os.environ["HARNESS_PROFILE"], "a") as f:
            f.write(json.dumps({"world": world, "job": path, "args": str(args)[:300], "s": round(seconds, 2)}) + "\n")


# Ranks are forked from one server process per test session that has already imported torch and what the
# ranks import after it (rank_preload.py): a rank then starts in milliseconds instead of paying ~2.5 s of
# imports, 8 ranks sharing 2 cores ~10 s per group. The server never computes, so its children start with no
# thread pool to inherit (forking after compute can hang).
PRELOAD = ["torch", "torch.distributed", "harness", "rank_preload"]


def modules_loaded(names: list) -> list:
    """A job: which of `names` this rank has imported before its first job (rank_preload.py's, if the server
    preloaded them)."""
    return [n for n in names if n in sys.modules]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    # The server imports PRELOAD by name but, in Python 3.11, without our sys.path: it gets the course and tests/
    # through PYTHONPATH, set only while it starts (it keeps it, and so do its ranks).
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")] + ([before] if before else []))
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


def run_group(world: int, jobs: list, timeout_s: float | None = None) -> list[list]:
    """Run `jobs` on `world` spawned ranks; returns results[job_index][rank]. The whole group must
    finish within `timeout_s` (default 240 s, or HARNESS_TIMEOUT_S on a machine busy with other work)."""
    timeout_s = timeout_s or float(os.environ.get("HARNESS_TIMEOUT_S", 240))
    ctx = _context()
    queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="harness_")
    procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(store_dir, "store"), jobs, queue, 60.0))
             for r in range(world)]
    for p in procs:
        p.start()
    per_rank = {}
    deadline = time.time() + timeout_s
    try:
        while len(per_rank) < world:
            try:
                rank, out = queue.get(timeout=1.0)
                per_rank[rank] = out
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in per_rank]
                if dead:        # a rank crashed without reporting: the others would wait for their timeout
                    raise RuntimeError(f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
                if time.time() > deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(world)) - set(per_rank))} did not finish "
                                       f"within {timeout_s} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(store_dir, ignore_errors=True)
    return [[per_rank[r][j] if j < len(per_rank[r]) else _not_run(jobs, per_rank[r]) for r in range(world)]
            for j in range(len(jobs))]


def _not_run(jobs: list, done: list) -> tuple:
    """The result of a job that a rank skipped because an earlier job raised: that job's traceback, so
    whichever test reads a later job shows the real error."""
    failed = len(done) - 1
    return "error", f"not run: this rank stopped at job {failed} ({jobs[failed][0]}) with\n{done[failed][1]}"


def ok(results_for_job: list):
    """The value of a job that must have succeeded on every rank (rank 0's), or fail with the error."""
    return every_rank(results_for_job)[0]


def every_rank(results_for_job: list) -> list:
    """The value of a job on every rank (for checks where ranks hold different things)."""
    raise_rank_errors(results_for_job, expected="ok")
    return [value for _, value in results_for_job]


def raise_rank_errors(results_for_job: list, expected: str) -> None:
    """Fail with every rank's own message (a traceback, as the rank printed it) where a rank's result is
    not `expected`: the test's failure then shows the real error, not a later symptom of it."""
    wrong = [(rank, kind, value) for rank, (kind, value) in enumerate(results_for_job) if kind != expected]
    if wrong:
        raise AssertionError(f"expected {expected!r} on every rank; got:\n" +
                             "\n".join(f"--- rank {rank}: {kind} ---\n{value}" for rank, kind, value in wrong))


def assert_one_config_error(results_for_job: list, expected: str) -> None:
    """Bad input: every rank stopped on a configuration error, all with the same message, which
    contains `expected`."""
    raise_rank_errors(results_for_job, expected="config_error")
    messages = {message for _, message in results_for_job}
    assert len(messages) == 1 and expected in messages.pop(), messages


def losses(history: list[dict]) -> list[float]:
    return [row["loss"] for row in history]


def grad_norms(history: list[dict]) -> list[float]:
    return [row["grad_norm"] for row in history]


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# How far a layout may drift from the single-device run over the tests' runs (4 to 10 steps), relative, in
# fp32. Measured over 10 steps of every layout of chapters 01-04, every rank (ROUNDOFF_LOG below): losses ≤ 1.4e-7,
# gradient norms ≤ 1.9e-6. The tolerances leave a factor of 5-7 for other CPUs' kernels and no more:
# a wrong reduction that AdamW and clipping hide from the loss still moves the gradient norm by ~1e-3.
LOSS_RTOL = 1e-6
GRAD_NORM_RTOL = 1e-5


def assert_same_run(results_for_job: list, reference: list[dict], label: str) -> list[dict]:
    """Every rank's history against the reference rows: the loss and the gradient norm of every step.
    (Both are global values, printed by every rank alike.) Returns rank 0's history.

    ROUNDOFF_LOG=path appends each comparison's largest differences to `path`, as they were measured."""
    for rank, history in enumerate(every_rank(results_for_job)):
        assert [r["step"] for r in history] == [r["step"] for r in reference], (label, rank)
        d_loss = max_rel_diff(losses(history), losses(reference))
        d_norm = max_rel_diff(grad_norms(history), grad_norms(reference))
        if os.environ.get("ROUNDOFF_LOG"):
            with open(os.environ["ROUNDOFF_LOG"], "a") as f:
                f.write(json.dumps({"label": label, "rank": rank, "loss": d_loss, "grad_norm": d_norm}) + "\n")
        assert d_loss <= LOSS_RTOL and d_norm <= GRAD_NORM_RTOL, \
            f"{label}, rank {rank}: losses differ by {d_loss:.2e} (≤ {LOSS_RTOL:g}), gradient norms by {d_norm:.2e} " \
            f"(≤ {GRAD_NORM_RTOL:g}) from the single-device run"
    return results_for_job[0][1]


def run_single(jobs: list) -> list:
    """Run jobs in a world of one (spawned, so no state leaks into pytest)."""
    return [r[0] for r in run_group(1, jobs)]
