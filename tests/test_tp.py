"""Chapter 02 tensor parallelism: every layout reproduces the single-device losses.

One spawned group per world size (2 and 4) runs the operator and layer checks of test_tp_ops.py,
the training runs (TP, TP + sequence parallelism, TP × DP, DTensor, resume in another --tp) and
the bad-input runs, in order."""
import os
import subprocess
import sys

import pytest

from harness import ROOT, losses, max_rel_diff, ok, run_group

STEPS = 10
BASE = ["--steps", str(STEPS), "--seq-len", "32", "--global-batch", "8", "--quiet"]
TRAIN = "02_tensor_parallel.train_tp:main"
PIECES = {2: [("test_tp_ops:check_operators",), ("test_tp_ops:check_layers", False),
              ("test_tp_ops:check_layers", True), ("test_tp_ops:check_vocab_parallel_loss",),
              ("test_tp_ops:check_partial_stage", True)],
          4: [("test_tp_ops:check_operators",), ("test_tp_ops:check_layers", False),
              ("test_tp_ops:check_layers", True), ("test_tp_ops:check_vocab_parallel_loss",),
              ("test_tp_ops:check_kv_replicated",)]}
# name -> (extra flags, tolerance); None tolerance: a bad input, the value is the message fragment
RUNS = {
    2: {"tp2": (["--tp", "2"], 1e-5),
        "tp2+sp": (["--tp", "2", "--sequence-parallel"], 1e-5),
        "torch tp2": (["--impl", "torch"], 1e-5),
        "bad tp": (["--tp", "3"], "does not divide the world size 2")},
    4: {"tp4": ([], 1e-5),
        "tp4+sp": (["--sequence-parallel"], 1e-5),
        "tp2×dp2+sp": (["--tp", "2", "--sequence-parallel"], 1e-5),
        "bad tp": (["--tp", "3"], "does not divide the world size 4"),
        "bad seq": (["--sequence-parallel", "--seq-len", "30"], "--seq-len 30 is not a multiple of 4")},
}


@pytest.fixture(scope="module")
def reference():
    (res,) = run_group(1, [(TRAIN, BASE)])
    return losses(ok(res))


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tp_ckpt"))


def _group(world, ckpt_dir):
    jobs = list(PIECES[world])
    for flags, _ in RUNS[world].values():
        jobs.append((TRAIN, BASE + flags))
    if world == 2:       # save at tp=2 (steps 5 and 10), resume from step 5 at tp=1 × dp=2
        jobs.append((TRAIN, BASE + ["--tp", "2", "--checkpoint-dir", ckpt_dir, "--checkpoint-every", "5",
                                    "--steps", "5"]))
        jobs.append((TRAIN, BASE + ["--tp", "1", "--checkpoint-dir", ckpt_dir, "--resume"]))
    return jobs, run_group(world, jobs)


@pytest.mark.parametrize("world", [2, 4])
def test_tp_layouts_match_single_device(reference, ckpt_dir, world):
    jobs, results = _group(world, ckpt_dir)
    for job, res in zip(jobs, results[:len(PIECES[world])]):
        assert ok(res) is True, job
    runs = results[len(PIECES[world]):]
    for (name, (flags, expect)), res in zip(RUNS[world].items(), runs):
        if isinstance(expect, str):                     # bad input: the same message on every rank
            for kind, msg in res:
                assert kind == "config_error" and expect in msg, (name, kind, msg)
            continue
        history = ok(res)
        assert max_rel_diff(losses(history), reference) <= expect, (name, losses(history), reference)
        row = history[-1]
        if "torch" not in name:
            assert row["comm_bytes_tp"] > 0 and row["param_bytes"] < 6.6e6 / 2 * 1.05, name
    if world == 2:
        saved, resumed = ok(runs[-2]), ok(runs[-1])
        assert [r["step"] for r in resumed] == list(range(6, STEPS + 1))
        assert max_rel_diff(losses(saved) + losses(resumed), reference) <= 1e-5


def test_bad_tp_under_torchrun():
    """A real launch: one clear line from rank 0, non-zero exit, no traceback from the script."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           str(ROOT / "02_tensor_parallel" / "train_tp.py"), "--sequence-parallel",
                           "--seq-len", "31", "--steps", "1", "--quiet"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode != 0
    assert "error: --sequence-parallel splits each sequence over --tp 2" in proc.stderr
    assert "use a --seq-len divisible by 2" in proc.stderr
    assert proc.stderr.count("error: ") == 1                # rank 0 speaks, once
    assert 'train_tp.py", line' not in proc.stderr           # no traceback from our ranks (torchrun adds its own)
