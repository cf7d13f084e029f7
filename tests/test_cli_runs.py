"""Runs started the way a user starts them (`python` / `torchrun` / ranks by hand), read from the console.

- bad input: exit code 2, one `error:` line that names the flag, no traceback;
- a run that diverges stops at that step on every rank, and the checkpoint before it is kept whole;
- a run with the console on (not --quiet) shows what it trains on, the layout, progress, the summary
  and the text sample.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

from harness import ROOT, free_port

PYTHON = [sys.executable]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
OUR_FRAME = re.compile(r'File ".*[/\\](common|0\d_[a-z0-9_]+)[/\\]')   # a traceback line inside our code
SMALL = ["--seq-len", "32", "--global-batch", "4"]


def run(launcher, script, argv, timeout=180):
    return subprocess.run(launcher + [script] + argv, cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error")]


@pytest.mark.parametrize("launcher, script, argv, message", [
    (PYTHON, "02_tensor_parallel/train_tp.py", ["--data", "{binary}"], "a binary file, not text"),
    (TORCHRUN, "04_3d_combined/train_3d.py", ["--pp", "0"], "error: --pp must be a whole number ≥ 1, got 0"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, launcher, script, argv, message):
    (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 8)
    argv = [a.format(binary=tmp_path / "binary.bin", dir=tmp_path) for a in argv]
    proc = run(launcher, script, argv + ["--steps", "1"])
    assert proc.returncode != 0 if launcher is TORCHRUN else proc.returncode == 2, proc.stderr
    lines = errors(proc.stderr)
    assert lines and message in lines[0] and len(set(lines)) == 1, proc.stderr
    assert not OUR_FRAME.search(proc.stderr), proc.stderr          # torchrun prints its own, never ours


def test_a_diverging_run_stops_on_every_rank_and_keeps_the_last_checkpoint(tmp_path):
    """ZeRO-3 on two ranks with a learning rate no model survives: the weights blow up after step 1.
    Both ranks (started by hand, so each one's console is its own) stop at the same step with the
    same message, exit 2, and the checkpoint of the step before holds finite weights."""
    ckpt, port = tmp_path / "ckpt", free_port()
    # --timeout 300: the start-up rendezvous waits that long for the other rank. On a test machine loaded with
    # the suite's workers' ranks, rank 0 once started over 60 s (the default) after rank 1, and both failed to meet
    argv = [sys.executable, "01_data_parallel/train_zero.py", "--zero-stage", "3", "--lr", "1e30", "--steps", "5",
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--quiet", "--timeout", "300"] + SMALL
    procs = [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**ENV, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(2)]
    outs = [p.communicate(timeout=180)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    messages = [errors(err) for err in outs]
    assert all(len(m) == 1 for m in messages) and messages[0] == messages[1], outs
    assert not any("Traceback" in err for err in outs), outs
    message = messages[0][0]
    step = int(re.match(r"error: step (\d+): the (loss|gradient norm) is (nan|inf)", message).group(1))
    assert step >= 2 and "with --lr 1e+30" in message and "to try: a lower --lr (e.g. --lr 1e+29)" in message, message
    assert "cause" not in message, message          # what was seen and what to try: no guess at why
    saved = sorted(p.name for p in ckpt.glob("step_*.pt"))
    assert saved[-1] == f"step_{step - 1:06d}.pt" and (ckpt / "latest").read_text() == saved[-1], saved
    state = torch.load(ckpt / saved[-1], weights_only=True)
    assert state["step"] == step - 1 and all(torch.isfinite(t).all() for t in state["model"].values())


def test_the_3d_run_as_a_user_sees_it(tmp_path):
    """Two ranks under torchrun, console on, text sample on: rank 0 alone prints the run."""
    proc = run(TORCHRUN, "04_3d_combined/train_3d.py",
               ["--steps", "3", "--val-every", "2", "--sample-tokens", "40", "--metrics", str(tmp_path / "m.jsonl")] + SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for shown in ("3D parallel pretraining", "2 = dp 1 × pp 1 × tp 2", "common/corpus/stdlib_docstrings.txt: 700,943 tokens",
                  "the ranks: grid = arange(world).view(dp, pp, tp)", "the groups:", "step 2: validation loss", "3/3", "summary",
                  "loss first → last", "sample from the trained model (prompt 'The ')"):
        assert out.count(shown) == 1, (shown, out)                # once: the other rank stays quiet
    assert "error" not in proc.stderr.lower(), proc.stderr
    first, last = re.search(r"loss first → last\s+│?\s*([\d.]+) → ([\d.]+)", out).groups()
    assert float(last) < float(first) < 6.0                        # ~ln(256) = 5.5 at the start, then falling
    sample = out.split("sample from the trained model (prompt 'The '):")[1]
    assert sample.strip().startswith("The ") and len(sample.strip()) >= 20


@pytest.mark.parametrize("launched", [True, False])
def test_other_ranks_give_rank_0_time_to_report_a_configuration_error(monkeypatch, launched):
    """Rank 1 waits before printing, so that rank 0 prints the one line: under torchrun (which stops rank 1
    as soon as rank 0 exits) long enough for a rank 0 that a loaded machine started late."""
    from common import errors
    waited, printed = [], []
    monkeypatch.setattr(errors.time, "sleep", waited.append)
    monkeypatch.setattr(errors, "fail", lambda prefix, reason, code: printed.append((prefix, reason, code)))
    monkeypatch.setattr(errors, "exit_now", lambda code: None)
    monkeypatch.setenv("RANK", "1")
    if launched:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)

    def main():
        raise errors.ConfigError("--ep 4 does not divide the world size 2")
    errors.run_main(main)
    assert waited == [errors.LAUNCHED_GRACE_S if launched else errors.PEER_GRACE_S] and waited[0] >= 5
    assert printed == [("error", "--ep 4 does not divide the world size 2", 2)]
