"""Starting a project script on N ranks from Python: what the notebooks and benchmarks do.

One rank is a plain `python script.py`; more go through `torchrun --standalone`, which finds a free
port for the rendezvous, so two launches on one machine never collide on the default port. On a CPU
the ranks share the machine's cores: each sets its torch threads to its share, cores ÷ ranks on the
machine and at least one (common/distributed.set_cpu_threads); the `OMP_NUM_THREADS=1` set here holds
until then (and spares torchrun's warning that it sets it itself). A run that fails never fails
silently: its error output (the rank's message, or torchrun's summary) is printed, then
`LaunchError` is raised. A run never outlives the Python that launched it: interrupting a notebook's
kernel (or Ctrl-C, or any error while waiting) stops the run and every process it started.
"""
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHOWN_LINES = 40     # how much of a failed run's error output to print
STOP_GRACE_S = 10    # how long a run may take to stop on SIGTERM before it is killed


class LaunchError(RuntimeError):
    """A launched run exited with a non-zero code."""


def command(script: str | Path, nproc: int, args: list[str]) -> list[str]:
    """The command line that runs `script` (a path from the repository root) on `nproc` ranks."""
    launcher = ([sys.executable] if nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"])
    return launcher + [str(script)] + [str(a) for a in args]


def shown(cmd: list[str]) -> str:
    """The command as a person would type it: `torchrun ...` or `python ...`."""
    if cmd[1:3] == ["-m", "torch.distributed.run"]:
        return " ".join(["torchrun"] + cmd[3:])
    return " ".join(["python"] + cmd[1:])


def launch(script: str | Path, nproc: int, args: list[str], echo: bool = True, quiet: bool = False,
           env: dict | None = None) -> None:
    """Run `script` on `nproc` ranks from the repository root and wait for it.

    Its standard output goes to ours (unless `quiet`); its error output is kept and printed only if
    the run fails (torchrun's banner is noise when it succeeds).
    """
    cmd = command(script, nproc, args)
    if echo:
        print("$", shown(cmd), flush=True)
    # Its own session, so its own process group: the run and what it starts can be stopped together,
    # and a signal meant for us (a kernel interrupt) is ours to pass on.
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate()
    except BaseException:               # KeyboardInterrupt above all: the run must not go on without us
        stop(proc)
        raise
    if proc.returncode != 0:
        print("\n".join(ranks_errors(stderr)[-SHOWN_LINES:]), file=sys.stderr, flush=True)
        raise LaunchError(f"exit code {proc.returncode}: {shown(cmd)}")


def stop(proc: subprocess.Popen) -> None:
    """Stop a launched run and its process group: SIGTERM, then SIGKILL after STOP_GRACE_S.

    SIGTERM first, and a grace, because of torchrun: it starts each rank in a session of its own (out of
    reach of a signal to its group), and on SIGTERM it stops its ranks and waits for them. Killed at
    once, it would leave them running."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=STOP_GRACE_S)   # (reading its error output: a full pipe would block it)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)       # whatever of the group ignored SIGTERM
    except ProcessLookupError:
        pass
    proc.communicate()


def ranks_errors(stderr: str) -> list[str]:
    """The ranks' own error lines: torchrun's banner and its closing failure report are left out (the
    report is ~35 lines of launcher traceback that would push the rank's message out of view)."""
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("*" * 10)
             and "OMP_NUM_THREADS" not in line]
    for i, line in enumerate(lines):
        if "elastic/multiprocessing/api.py" in line or line.startswith("torch.distributed.elastic"):
            return lines[:i] or lines     # where the launcher's report starts
    return lines
