"""Launches beyond one torchrun agent on one machine: two "nodes", and a run that loses a rank.

- Two torchrun agents on this host (2 + 2 ranks, node ranks 0 and 1, rendezvous on 127.0.0.1) run the
  main job's script (at 4 ranks: tp 2 × pp 2) with the same losses and gradient norms, bit for bit, as the
  same 4 ranks in one group on one node: global and local ranks are kept apart everywhere (device, threads,
  who prints and writes). Two ranks per node are enough for that: local rank 1 of node 1 is global rank 3.
- A TP run of 9 steps, checkpointed every 3, under `torchrun --max-restarts 2` with the same command
  line that starts it (`--resume` with an empty directory starts at step 1): one rank is killed with
  SIGKILL after step 5, torchrun restarts the group, the run resumes from its last checkpoint and exits
  0 with the losses of an uninterrupted run. The metrics file keeps the rows of both attempts; the
  course's readers take the last row of each step.

The uninterrupted runs each is compared with are spawned by the test harness (tests/harness.py: the
ranks forked from a process that has imported torch already), not by another torchrun: the same script's
`main` on the same ranks, without paying torch's imports on every rank once more.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import ROOT, free_port, ok, run_group

from common.metrics import read_metrics

RUN = [sys.executable, "-m", "torch.distributed.run"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
MAIN_JOB = ["04_3d_combined/train_3d.py", "--steps", "2", "--val-every", "0", "--val-batches", "1", "--sample-tokens", "0",
            "--quiet"]


def launch(launcher: list, script_argv: list, log: Path) -> subprocess.Popen:
    """torchrun with its output in `log` (a file, not a pipe: a pipe nobody reads while the test watches
    the metrics would fill up and stop the ranks in their next print)."""
    with open(log, "w") as out:
        return subprocess.Popen(RUN + launcher + script_argv, cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT,
                                text=True)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 300) -> str:
    proc.wait(timeout=timeout)
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    return out


def test_two_agents_as_two_nodes_match_one_agent_bit_for_bit(tmp_path):
    one = tmp_path / "one.jsonl"
    ok(run_group(4, [("04_3d_combined.train_3d:main", MAIN_JOB[1:] + ["--metrics", str(one)])])[0])
    two = tmp_path / "two.jsonl"
    port = free_port()
    node = ["--nnodes=2", "--nproc_per_node=2", "--master-addr=127.0.0.1", f"--master-port={port}"]
    logs = [tmp_path / f"node{i}.log" for i in (0, 1)]
    agents = [launch(node + [f"--node-rank={i}"], MAIN_JOB + ["--metrics", str(two)], logs[i]) for i in (0, 1)]
    for agent, log in zip(agents, logs):
        finish(agent, log)
    a, b = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert [(r["loss"], r["grad_norm"]) for r in a] == [(r["loss"], r["grad_norm"]) for r in b]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc): torchrun's workers are its children or grandchildren."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


def worker_with_rank(pid: int, rank: int) -> int | None:
    for p in descendants(pid):
        try:
            env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return p
    return None


def test_a_killed_rank_restarts_from_the_last_checkpoint_with_the_same_losses(tmp_path):
    tp_run = ["02_tensor_parallel/train_tp.py", "--steps", "9", "--seq-len", "32", "--global-batch", "4",
              "--checkpoint-every", "3", "--resume"]
    straight = tmp_path / "straight.jsonl"
    ok(run_group(2, [("02_tensor_parallel.train_tp:main",
                      tp_run[1:] + ["--checkpoint-dir", str(tmp_path / "a"), "--metrics", str(straight), "--quiet"])])[0])
    metrics = tmp_path / "restarted.jsonl"
    log = Path(os.environ.get("LAUNCH_LOG", tmp_path / "restarted.log"))    # LAUNCH_LOG: keep the run's output
    proc = launch(["--standalone", "--nproc_per_node=2", "--max-restarts=2"],
                  tp_run + ["--checkpoint-dir", str(tmp_path / "b"), "--metrics", str(metrics)], log)
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.stat().st_size and any(r["step"] >= 5 for r in read_metrics(metrics))):
        assert proc.poll() is None and time.time() < deadline, "the run ended or stalled before step 5"
        time.sleep(0.05)
    victim = worker_with_rank(proc.pid, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    out = finish(proc, log)
    assert "no checkpoint in" in out and "starts at step 1" in out     # the first attempt, same command
    raw = [int(line.split('"step": ')[1].split(",")[0]) for line in metrics.read_text().splitlines()]
    again = [s for prev, s in zip(raw, raw[1:]) if s <= prev]            # steps the second attempt trained again
    # killed after step 5 was logged: the second attempt resumes after the checkpoint of step 3 (4… again) or of
    # step 6 (7… again; none again when the kill landed after step 6 was logged, its checkpoint written); a run
    # started over from step 1 would train 1 again
    assert again[:1] in ([4], [7], []) and raw[-1] == 9, raw
    resumed_at = again[0] if again else 7
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert [(r["loss"], r["grad_norm"]) for r in rows] == [(r["loss"], r["grad_norm"]) for r in read_metrics(straight)]
    print(f"killed rank 1 (pid {victim}) after step 5; resumed at step {resumed_at}; final loss {rows[-1]['loss']}")
