"""Chapter 01 under the real launcher: bad input through torchrun, and a killed run resumed exactly."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dp_jobs import RESUME_ARGS, TRAIN
from harness import REFUSAL_TIMEOUT_S, ROOT, losses, ok, run_group

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
SCRIPT = str(ROOT / "01_data_parallel" / "train_dp.py")
OUR_FRAME = re.compile(r'File ".*(common|01_data_parallel)[/\\]')   # a traceback line inside our code


def torchrun(args, tmp_path, name, **popen):
    out, err = open(tmp_path / f"{name}.out", "w"), open(tmp_path / f"{name}.err", "w")
    return subprocess.Popen(TORCHRUN + [SCRIPT] + args, stdout=out, stderr=err, cwd=ROOT, **popen)


def read(tmp_path, name):
    return (tmp_path / f"{name}.out").read_text(), (tmp_path / f"{name}.err").read_text()


@pytest.mark.parametrize("kind,args,message", [
    ("batch", ["--global-batch", "7"], "error: --global-batch 7 does not split over 2 data-parallel rank(s)"),
    ("corrupt", ["--resume", "--checkpoint-dir", "{corrupt}"], "is corrupt or unreadable"),
])
def test_bad_input_under_torchrun(tmp_path, kind, args, message):
    corrupt = tmp_path / "ck"
    corrupt.mkdir()
    (corrupt / "step_000002.pt").write_bytes(os.urandom(4096))     # garbage where a checkpoint should be
    (corrupt / "latest").write_text("step_000002.pt")
    args = [a.format(corrupt=corrupt) for a in args]
    proc = torchrun(args + ["--steps", "2"], tmp_path, kind)
    assert proc.wait(timeout=REFUSAL_TIMEOUT_S) != 0
    _, err = read(tmp_path, kind)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors and message in errors[0], err
    assert len(set(errors)) == 1, errors                 # one message (printed once, or alike by each rank)
    assert not OUR_FRAME.search(err), err                # no traceback wall from our code


def _children(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (torchrun starts each rank in its own session)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find the ranks")
def test_killed_run_resumes_exactly(tmp_path):
    """SIGKILL every rank after the first checkpoint; the resumed run continues bit for bit."""
    ck = tmp_path / "ck"
    args = RESUME_ARGS + ["--checkpoint-dir", str(ck)]
    proc = torchrun(args + ["--metrics", str(tmp_path / "killed.jsonl")], tmp_path, "killed")
    deadline = time.time() + 180
    while not (ck / "latest").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert (ck / "latest").exists(), \
        f"the run saved no checkpoint; its error output:\n{read(tmp_path, 'killed')[1][-3000:]}"
    for pid in _children(proc.pid):
        os.kill(pid, signal.SIGKILL)                     # no clean-up, no last save: a crash
    proc.kill()
    proc.wait(timeout=30)
    k = int((ck / "latest").read_text().strip()[len("step_"):-len(".pt")])
    assert k < 10, "the run finished before it could be killed; make its steps longer"

    resumed = torchrun(args + ["--resume", "--metrics", str(tmp_path / "resumed.jsonl")], tmp_path, "resumed")
    assert resumed.wait(timeout=180) == 0, read(tmp_path, "resumed")
    from common.metrics import read_metrics
    rows = read_metrics(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in rows] == list(range(k + 1, 11))

    (never_stopped,) = run_group(2, [(TRAIN, RESUME_ARGS)])               # the same run, never stopped
    uninterrupted = losses(ok(never_stopped))
    for r in rows:
        want = uninterrupted[r["step"] - 1]
        assert abs(r["loss"] - want) <= 1e-6 * abs(want), (r["step"], r["loss"], want)
    killed = read_metrics(tmp_path / "killed.jsonl")                      # and before the kill, too
    assert [r["loss"] for r in killed[:k]] == pytest.approx(uninterrupted[:k], rel=1e-6)
