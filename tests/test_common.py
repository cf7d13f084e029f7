"""Single-process tests of common/: data, optimizer and LR schedule, metrics, CLI, errors (checkpoint files:
test_checkpoint_files.py)."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common.cli import base_parser, check_common
from common.comm import CommCounter
from common.data import TextData, decode, encode, shard_rows
from common.errors import ConfigError
from common.metrics import RunLog, format_bytes, read_metrics
from common.optim import AdamW, build_adamw, clip_by_global_norm, decays, lr_at, set_lr
from harness import ROOT


# --- data ----------------------------------------------------------------------------------------

def test_batches_are_a_function_of_seed_and_step():
    data = TextData(None, seq_len=16, seed=1)
    x1, y1 = data.global_batch(3, 8)
    x2, y2 = TextData(None, seq_len=16, seed=1).global_batch(3, 8)
    assert x1.shape == y1.shape == (8, 16) and torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, data.global_batch(4, 8)[0])
    assert not torch.equal(x1, TextData(None, seq_len=16, seed=2).global_batch(3, 8)[0])
    assert torch.equal(x1[:, 1:], y1[:, :-1])                 # targets are the next tokens


def test_rank_slices_and_microbatches_tile_the_global_batch():
    x, _ = TextData(None, seq_len=8, seed=1).global_batch(1, 12)
    assert torch.equal(torch.cat([shard_rows(x, r, 4) for r in range(4)]), x)
    rank1 = shard_rows(x, 1, 2)
    assert torch.equal(torch.cat([shard_rows(rank1, m, 3) for m in range(3)]), x[6:12])


def test_validation_split_is_held_out():
    data = TextData(None, seq_len=16, seed=1)
    assert len(data.valid) >= 0.04 * (len(data.train) + len(data.valid))
    assert not torch.equal(data.global_batch(1, 4, "valid")[0], data.global_batch(1, 4)[0])


def test_byte_tokenizer_round_trips():
    text = "naïve → bucketed ✓"
    assert decode(encode(text)) == text and int(encode(text).max()) < 256


def test_bad_data_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        TextData(str(tmp_path / "nope.txt"), 16, 1)
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(ConfigError, match="too short"):
        TextData(str(short), 16, 1)


# --- optimizer, LR schedule, clipping --------------------------------------------------------------

def test_lr_schedule_warmup_then_cosine_to_the_floor():
    peak, warmup, total = 1e-3, 10, 100
    lrs = [lr_at(s, peak, warmup, total) for s in range(1, total + 1)]
    assert lrs[0] == pytest.approx(peak / warmup) and lrs[warmup - 1] == pytest.approx(peak)
    assert all(a >= b for a, b in zip(lrs[warmup - 1:], lrs[warmup:]))     # non-increasing after warmup
    assert lrs[-1] == pytest.approx(0.1 * peak)
    assert lr_at(55, peak, warmup, total) == pytest.approx(peak * (0.1 + 0.9 * 0.5))   # halfway: cos = 0


def test_weight_decay_is_chosen_by_name():
    assert decays("layers.0.attn.wq.weight") and decays("tok_emb.weight")
    assert not decays("layers.3.mlp_norm.weight") and not decays("norm.weight")
    a, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    opt = build_adamw([("w.weight", a), ("attn_norm.weight", b)], lr=1e-3, weight_decay=0.1)
    assert [(g["weight_decay"], len(g["params"])) for g in opt.param_groups] == [(0.1, 1), (0.0, 1)]


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "fused"])
def test_adamw_is_torchs_to_the_bit(fused):
    """The course's AdamW beside torch.optim.AdamW with the same kernel (the loop: foreach=False; fused: the
    CPU's fused kernel), six steps of two groups (weight decay 0.1 and 0) with a changing learning rate and
    gradients of very different sizes: every weight and both moments equal to the bit after each step. A tensor
    without a gradient at a step is left alone and its count does not move."""
    torch.manual_seed(0)
    ours_p = [torch.randn(s, requires_grad=True) for s in [(5, 3), (7,), (4, 4)]]
    theirs_p = [p.detach().clone().requires_grad_() for p in ours_p]

    def groups(ps):
        return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]
    ours = AdamW(groups(ours_p), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=fused)
    theirs = torch.optim.AdamW(groups(theirs_p), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                               **({"fused": True} if fused else {"foreach": False}))
    for step in range(1, 7):
        for i, (a, b) in enumerate(zip(ours_p, theirs_p)):
            g = None if (step, i) == (3, 1) else torch.randn_like(a) * 10.0 ** (2 * i - 2)
            a.grad, b.grad = g, (None if g is None else g.clone())
        for opt in (ours, theirs):
            set_lr(opt, 3e-3 * step / 6)
            opt.step()
        for a, b in zip(ours_p, theirs_p):
            assert torch.equal(a, b), step
    for a, b in zip(ours_p, theirs_p):
        assert {k: v.dtype for k, v in ours.state[a].items()} == {k: v.dtype for k, v in theirs.state[b].items()}
        assert all(torch.equal(ours.state[a][k], theirs.state[b][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert ours.state[ours_p[1]]["step"].item() == 5


def test_clip_by_global_norm_matches_torch():
    torch.manual_seed(0)
    grads = [torch.randn(5, 3) * 4, torch.randn(7)]
    theirs = [g.clone().requires_grad_() for g in grads]
    for t, g in zip(theirs, grads):
        t.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0).item()
    norm = clip_by_global_norm(grads, 1.0)
    assert norm == pytest.approx(want, rel=1e-6)
    for t, g in zip(theirs, grads):
        torch.testing.assert_close(g, t.grad)
    assert math.sqrt(sum(g.pow(2).sum().item() for g in grads)) == pytest.approx(1.0, rel=1e-5)
    small = [torch.full((3,), 0.01)]
    clip_by_global_norm(small, 1.0)
    assert torch.equal(small[0], torch.full((3,), 0.01))    # below the limit: untouched


# --- metrics, CLI, errors, comm accounting -----------------------------------------------------------

def test_metrics_file_has_one_object_per_step(tmp_path):
    path = tmp_path / "run" / "m.jsonl"
    log = RunLog(0, 2, str(path), quiet=True)
    log.start()
    log.log_step(1, 5.5, 1e-3, 1024, 0.5, comm_bytes=10)
    log.log_step(2, 5.0, 2e-3, 1024, 0.25)
    log.finish()
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["comm_bytes"] == 10
    assert {"step", "loss", "lr", "tokens", "step_time_s", "tokens_per_s"} <= set(rows[1])
    assert rows[1]["tokens_per_s"] == 4096 and json.loads(path.read_text().splitlines()[0])["loss"] == 5.5
    again = RunLog(0, 2, str(path), quiet=True, append=True)          # a restart re-runs step 2, then 3
    again.log_step(2, 4.9, 2e-3, 1024, 0.25)
    again.log_step(3, 4.5, 3e-3, 1024, 0.25)
    again.finish()
    assert len(path.read_text().splitlines()) == 4                   # both attempts' rows are kept
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 5.5), (2, 4.9), (3, 4.5)]   # the last of each
    other = RunLog(1, 2, str(tmp_path / "rank1.jsonl"), quiet=True)   # only global rank 0 writes
    other.log_step(1, 5.5, 1e-3, 1024, 0.5)
    other.finish()
    assert not (tmp_path / "rank1.jsonl").exists()


def test_tables_through_a_pipe_keep_each_row_on_one_line(monkeypatch, capsys):
    """Printed into a pipe, a file or a notebook's cell (not a terminal), rich would assume 80 columns
    and wrap a 4D mesh row in two, `[0, 1,` over `2, 3]`; COLUMNS, where set, still decides."""
    from rich.table import Table
    from common.metrics import PIPE_COLUMNS
    monkeypatch.delenv("COLUMNS", raising=False)
    log = RunLog(0, 1, None, quiet=False)
    assert not log.console.is_terminal and log.console.width == PIPE_COLUMNS
    mesh = Table(title="the mesh")
    for col in ("rank", "dp", "edp", "ep", "pp", "tp", "dp group", "pp group", "tp group", "ep group", "edp group"):
        mesh.add_column(col)
    mesh.add_row("0", "0", "0", "0", "0", "0", "[0, 2, 4, 6]", "[0, 8]", "[0, 1]", "[0, 2]", "[0, 4]")
    log.print(mesh)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    assert len(rows) == 1 and "[0, 2, 4, 6]" in rows[0], rows
    monkeypatch.setenv("COLUMNS", "100")
    assert RunLog(0, 1, None, quiet=False).console.width == 100


def test_format_bytes():
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.5 KiB" and format_bytes(3 * 2**20) == "3.0 MiB"


def test_cli_defaults_and_errors():
    p = base_parser("test")
    args = p.parse_args([])
    assert (args.steps, args.model, args.global_batch, args.seq_len, args.microbatches) == (50, "tiny", 16, 128, 1)
    check_common(args, dp=4)
    with pytest.raises(ConfigError, match="see --help"):
        p.parse_args(["--dtype", "fp8"])
    cases = [(["--model", "nosuch"], 1, "--model nosuch: unknown preset"), (["--global-batch", "12"], 8, "use a multiple of 8"),
             (["--global-batch", "16", "--microbatches", "3"], 2, "use a multiple of 6"),
             (["--seq-len", "4096"], 1, "exceeds the tiny preset"), (["--resume"], 1, "--resume needs --checkpoint-dir"),
             (["--steps", "0"], 1, "--steps must be a whole number ≥ 1, got 0")]
    for argv, dp, message in cases:
        with pytest.raises(ConfigError, match=message.replace("-", r"\-")):
            check_common(p.parse_args(argv), dp=dp)


def test_run_main_prints_one_line_and_exits_2():
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from common.errors import run_main, ConfigError\n"
            "def main(): raise ConfigError('the batch does not split; use 8')\n"
            "run_main(main)\n") % str(ROOT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: the batch does not split; use 8"


def test_under_torchrun_its_failure_report_ends_with_the_ranks_line(tmp_path):
    """torchrun reads each failed rank's TORCHELASTIC_ERROR_FILE into its closing report; without one
    the report says "To enable traceback see: <url>" where the reason should be."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from common.errors import run_main, ConfigError\n"
            "def main(): raise ConfigError('the batch does not split; use 8')\n"
            "run_main(main)\n") % str(ROOT)
    error_file = tmp_path / "error.json"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert proc.returncode == 2 and proc.stderr.strip() == "error: the batch does not split; use 8"
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    report = ChildFailedError("train.py", {0: failure}).format_msg()
    assert "traceback : the batch does not split; use 8\n" in report and "To enable traceback" not in report


def test_run_main_on_success_flushes_and_exits_0_without_teardown():
    code = ("import sys, atexit; sys.path.insert(0, %r)\n"
            "from common.errors import run_main\n"
            "atexit.register(lambda: print('teardown ran'))\n"       # skipped: the process leaves at once
            "run_main(lambda: print('trained', end=''))\n") % str(ROOT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "trained")


def test_launch_builds_the_command_and_shows_a_failed_runs_error(capsys):
    from common.launch import LaunchError, command, launch, shown
    assert shown(command("x/train.py", 4, ["--steps", 3])) == "torchrun --standalone --nproc_per_node=4 x/train.py --steps 3"
    assert shown(command("x/train.py", 1, [])) == "python x/train.py"
    with pytest.raises(LaunchError, match="exit code 2"):
        launch("01_data_parallel/train_dp.py", 1, ["--model", "nosuch"], quiet=True)
    assert "error: --model nosuch: unknown preset" in capsys.readouterr().err


def _live_members(pgid: int) -> list[int]:
    """Processes of group `pgid` that still run (a zombie, dead but not yet reaped, does not count)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()      # after "pid (comm)": state ppid pgrp ...
        except OSError:
            continue                                                 # it ended while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process groups from Linux's /proc")
def test_an_interrupted_launch_stops_the_run_and_what_it_started(tmp_path):
    """Interrupting a notebook's kernel while `launch` waits (SIGINT: KeyboardInterrupt) must stop the
    run and every process it started, as torchrun starts its ranks: none may keep running."""
    script, pids = tmp_path / "sleeper.py", tmp_path / "pids.txt"
    script.write_text("import os, subprocess, sys, time\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                      "open(sys.argv[1] + '.tmp', 'w').write(f'{os.getpgid(0)} {child.pid}')\n"
                      "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
                      "time.sleep(120)\n")
    # The driver answers SIGINT with KeyboardInterrupt, as a Jupyter kernel does, even when this test
    # runs in a background job (whose children inherit SIGINT ignored)
    driver = subprocess.Popen([sys.executable, "-c", "import signal, sys; sys.path.insert(0, %r)\n"
                               "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                               "from common.launch import launch\n"
                               "launch(%r, 1, [%r], echo=False)\n" % (str(ROOT), str(script), str(pids))],
                              start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(300):
            if pids.exists() or driver.poll() is not None:
                break
            time.sleep(0.1)
        pgid, grandchild = map(int, pids.read_text().split())
        assert grandchild in _live_members(pgid)
        os.kill(driver.pid, signal.SIGINT)
        _, err = driver.communicate(timeout=60)
        assert driver.returncode != 0 and "KeyboardInterrupt" in err, err      # re-raised to the caller
        for _ in range(50):                                  # the orphaned grandchild, if any, is not ours to reap
            if not _live_members(pgid):
                break
            time.sleep(0.1)
        assert not _live_members(pgid), f"still running after the interrupt: {_live_members(pgid)}"
    finally:
        for group in (driver.pid, *([pgid] if "pgid" in locals() else [])):
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_comm_counter():
    c = CommCounter()
    c.add("dp", 100, 60)
    c.add("tp", 5, 5)
    c.add("dp", 1, 1)
    assert c.total() == 172 and c.total("dp") == 162 and c.by_group() == {"dp": 162, "tp": 10}
    c.reset()
    assert c.total() == 0
