"""Chapter 04: every DP × TP × PP layout reproduces the single-device run (losses, gradient norms and
validation losses, on every rank); resume across layouts; bad input fails on every rank; a killed
rank does not hang the others. Two verbs of Trainer3D alone, on 2 ranks: sync_gradients and
clip_grad_norm against the single-device gradients and norm (jobs_3d.py)."""
import os
import signal
import subprocess
import sys
import time
from importlib import import_module
from pathlib import Path

import pytest

from harness import (LOSS_RTOL, REFUSAL_TIMEOUT_S, ROOT, assert_same_run, every_rank, free_port,
                     max_rel_diff, ok, run_group)

STEPS = 3          # enough for every layout bug we have seen to show; the resumes start from step 1
# A saving run stops after step 2 (checkpoints every step): the course keeps the newest two on disk
# (common/checkpoint.KEEP), so step 1's is there for the resumes, whose steps 2 and 3 see its moments
SAVING = ["--steps", "2"]
BASE = ["--steps", str(STEPS), "--seq-len", "32", "--global-batch", "8", "--quiet", "--sample-tokens", "0",
        "--val-every", "2", "--val-batches", "1"]       # validation at steps 2 and 3, one held-out batch each
MAIN = "04_3d_combined.train_3d:main"


def layout(dp, tp, pp, *extra):
    return BASE + ["--dp", str(dp), "--tp", str(tp), "--pp", str(pp)] + list(extra)


LAYOUTS_8 = [(2, 2, 2), (1, 2, 4), (2, 1, 4), (4, 2, 1), (8, 1, 1), (1, 1, 8)]
LAYOUTS_4 = [((1, 2, 2), ("--schedule", "gpipe")), ((2, 2, 1), ("--sequence-parallel",)),
             ((1, 1, 4), ("--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "4")),
             ((2, 1, 2), ("--schedule", "zb-h1", "--microbatches", "2")),
             ((1, 2, 2), ("--schedule", "zb-h1", "--microbatches", "4", "--sequence-parallel")),
             ((1, 4, 1), ("--sequence-parallel",))]
# ZeRO-1 runs below as the saving run (2, 2, 1) and its resumes (1, 2, 2) without and (2, 1, 2) with it


@pytest.fixture(scope="module")
def reference():
    (res,) = run_group(1, [(MAIN, BASE)])
    history = ok(res)
    return history, [r.get("val_loss") for r in history]


def _micro(pp):            # a pipeline of p stages gets p micro-batches (8 rows split evenly)
    return ["--microbatches", str(min(8 // 1, max(1, pp)))]


def test_eight_rank_layouts(reference):
    ref_hist, ref_val = reference
    jobs = [(MAIN, layout(dp, tp, pp, *_micro(pp))) for dp, tp, pp in LAYOUTS_8 if 8 // dp >= pp]
    results = run_group(8, jobs)
    for (dp, tp, pp), res in zip(LAYOUTS_8, results):
        history = assert_same_run(res, ref_hist, f"dp {dp} × tp {tp} × pp {pp}")
        vals = [r.get("val_loss") for r in history]
        assert max_rel_diff([v for v in vals if v], [v for v in ref_val if v]) <= LOSS_RTOL, (dp, tp, pp)


def test_four_rank_layouts_and_resume_in_another_layout(reference, tmp_path):
    ref_hist, _ = reference
    ckpt = tmp_path / "ckpt"
    jobs = [(MAIN, layout(dp, tp, pp, *extra)) for (dp, tp, pp), extra in LAYOUTS_4]
    # save in dp1×tp2×pp2 at every step (with a timeline); then pretend the run stopped after step 1 ...
    trace = tmp_path / "trace.json"
    jobs.append((MAIN, layout(1, 2, 2, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--timeline", str(trace),
                              *SAVING)))
    jobs.append(("test_3d:copy_checkpoints", str(ckpt), str(ckpt) + "_b"))    # a resume saves, and drops step 1
    jobs.append(("test_3d:point_latest_at", str(ckpt), "step_000001.pt"))
    # ... and resume it as dp2×tp1×pp2 and as dp1×tp4×pp1
    jobs.append((MAIN, layout(2, 1, 2, "--checkpoint-dir", str(ckpt), "--resume")))
    jobs.append(("test_3d:point_latest_at", str(ckpt) + "_b", "step_000001.pt"))
    jobs.append((MAIN, layout(1, 4, 1, "--checkpoint-dir", str(ckpt) + "_b", "--resume")))
    # ZeRO-1: save as dp2×tp2×pp1, resume as dp1×tp2×pp2 without ZeRO and as dp2×tp1×pp2 with it
    zero_ckpt = tmp_path / "zero"
    jobs.append((MAIN, layout(2, 2, 1, "--zero-stage", "1", "--checkpoint-dir", str(zero_ckpt), "--checkpoint-every", "1",
                              *SAVING)))
    jobs.append(("test_3d:copy_checkpoints", str(zero_ckpt), str(zero_ckpt) + "_b"))
    jobs.append(("test_3d:point_latest_at", str(zero_ckpt), "step_000001.pt"))
    jobs.append((MAIN, layout(1, 2, 2, "--checkpoint-dir", str(zero_ckpt), "--resume")))
    jobs.append(("test_3d:point_latest_at", str(zero_ckpt) + "_b", "step_000001.pt"))
    jobs.append((MAIN, layout(2, 1, 2, "--zero-stage", "1", "--checkpoint-dir", str(zero_ckpt) + "_b", "--resume")))
    # LAYOUTS_4[0] again, each TP rank sending its half between the stages (--pp-sends scatter-gather)
    jobs.append((MAIN, layout(1, 2, 2, *LAYOUTS_4[0][1], "--pp-sends", "scatter-gather")))
    results = run_group(4, jobs)
    for ((dp, tp, pp), extra), res in zip(LAYOUTS_4, results):
        assert_same_run(res, ref_hist, f"dp {dp} × tp {tp} × pp {pp} {' '.join(extra)}")
    n = len(LAYOUTS_4)
    timed = assert_same_run(results[n], ref_hist[:2], "saving dp 1 × tp 2 × pp 2, with --timeline")
    assert all(0 <= r["bubble_fraction"] < 1 for r in timed)
    from common.timeline import load_trace
    events, meta = load_trace(trace)
    assert {e["rank"] for e in events} == {0, 1, 2, 3} and meta["pp"] == 2
    zero = assert_same_run(results[n + 6], ref_hist[:2], "ZeRO-1 saving dp 2 × tp 2 × pp 1")
    # ZeRO-1 over dp 2 keeps half of the AdamW moments of the same (2,2,1) piece (up to padding)
    plain = ok(results[1])[-1]["optim_bytes"]                       # LAYOUTS_4[1]: (2, 2, 1), no ZeRO
    assert LAYOUTS_4[1][0] == (2, 2, 1)
    assert abs(zero[-1]["optim_bytes"] - plain / 2) <= 0.01 * plain, (plain, zero[-1]["optim_bytes"])
    for i in (3, 5, 9, 11):
        assert_same_run(results[n + i], ref_hist[1:], f"resumed (job {n + i})")
    check_scatter_gather(every_rank(results[0]), every_rank(results[n + 12]))


def check_scatter_gather(whole: list, split: list) -> None:
    """dp 1 × tp 2 × pp 2 (gpipe) sent whole and scatter-gathered: the same numbers to the bit on every rank
    (the gathered message is the one sent whole), half the pipeline's bytes, and the all-gathers in TP's,
    each rank's bytes by group what the planner counts for it (layout_costs.rank_traffic)."""
    layout_costs = import_module("07_choosing_a_layout.layout_costs")
    schedule_costs = import_module("07_choosing_a_layout.schedule_costs")
    from common.model import PRESETS
    from common.cli import pipeline_microbatches
    args = import_module("04_3d_combined.train_3d").parse_args(layout(1, 2, 2, *LAYOUTS_4[0][1]))
    c = layout_costs.Candidate(dp=1, tp=2, pp=2, schedule="gpipe", microbatches=pipeline_microbatches(args, 1, 2))
    specs = schedule_costs.specs_for(PRESETS["tiny"], 2, 1, 32, "gpipe")
    runs = [layout_costs.Run(PRESETS["tiny"], 8, 32, "fp32", pp_sends=how) for how in ("whole", "scatter-gather")]
    for rank, (w, g) in enumerate(zip(whole, split)):
        assert [(r["loss"], r["grad_norm"], r.get("val_loss")) for r in g] == \
            [(r["loss"], r["grad_norm"], r.get("val_loss")) for r in w], rank
        sent_whole, gathered = (layout_costs.rank_traffic(run, c, specs, rank // 2)[0] for run in runs)
        assert (w[-1]["comm_bytes_pp"], w[-1]["comm_bytes_tp"]) == (sent_whole["pp"], sent_whole["tp"]), rank
        assert (g[-1]["comm_bytes_pp"], g[-1]["comm_bytes_tp"]) == (gathered["pp"], gathered["tp"]), rank
        assert g[-1]["comm_bytes_pp"] * 2 == w[-1]["comm_bytes_pp"] and g[-1]["comm_bytes_tp"] > w[-1]["comm_bytes_tp"]


# --- two verbs alone, each against one device, in one group of 2 ranks ---------------------------------
GRID = ["--seq-len", "32", "--global-batch", "8", "--quiet"]
SYNC_LAYOUTS = {"dp 2": ["--dp", "2", "--tp", "1", "--pp", "1"],                  # the DP all-reduces
                "tp 2, sequence parallel": ["--dp", "1", "--tp", "2", "--pp", "1", "--sequence-parallel"]}  # TP sums
CLIP_LAYOUTS = {"dp 2": ["--dp", "2", "--tp", "1", "--pp", "1"],                  # replicas: not summed
                "tp 2": ["--dp", "1", "--tp", "2", "--pp", "1"],                  # shards summed, gains counted once
                "pp 2": ["--dp", "1", "--tp", "1", "--pp", "2", "--microbatches", "2"]}   # stages summed
GRAD_RTOL = 1e-5          # float32 sums in another order: round-off, ~1e-7 of a tensor's largest entry
NORM_RTOL = 1e-9          # the same gradients put in, squares summed in float64: only the order differs


@pytest.fixture(scope="module")
def verbs_at_two_ranks():
    """results[job][rank]: the sync's checks first, so that they have run while clip_grad_norm is a stub."""
    jobs = [("jobs_3d:sync_gradients_job", GRID + argv) for argv in SYNC_LAYOUTS.values()]
    jobs += [("jobs_3d:clip_norm_job", GRID + argv) for argv in CLIP_LAYOUTS.values()]
    return run_group(2, jobs)


def test_sync_gradients_gives_the_single_device_gradients(verbs_at_two_ranks):
    for name, res in zip(SYNC_LAYOUTS, verbs_at_two_ranks):
        for rank, got in enumerate(every_rank(res)):
            assert got["rel"] <= GRAD_RTOL, \
                f"{name}, rank {rank}: after sync_gradients the gradient of {got['name']} differs from one " \
                f"device's by {got['rel']:.1e} of its largest entry (expected ≤ {GRAD_RTOL:g}, round-off)"


def test_clip_grad_norm_is_the_single_device_norm(verbs_at_two_ranks):
    for name, res in zip(CLIP_LAYOUTS, verbs_at_two_ranks[len(SYNC_LAYOUTS):]):
        for rank, got in enumerate(every_rank(res)):
            assert abs(got["norm"] - got["ref_norm"]) <= NORM_RTOL * got["ref_norm"], \
                f"{name}, rank {rank}: clip_grad_norm returned {got['norm']:.9f}, one device's norm is " \
                f"{got['ref_norm']:.9f} (expected equal within {NORM_RTOL:g} of it)"
            assert got["rel"] <= GRAD_RTOL, \
                f"{name}, rank {rank}: clipped to half the norm, the gradient of {got['name']} differs from one " \
                f"device's by {got['rel']:.1e} of its largest entry (expected ≤ {GRAD_RTOL:g}: every gradient " \
                f"scaled by the same factor)"


def copy_checkpoints(directory, to):
    """A copy of a run's checkpoints (rank 0 copies, every rank waits), for a second resume from the same step."""
    import shutil
    import torch.distributed as dist
    if dist.get_rank() == 0:
        shutil.copytree(directory, to)
    dist.barrier()


def point_latest_at(directory, name):
    """Make `name` the latest checkpoint, as if the run had stopped right after saving it."""
    import torch.distributed as dist
    if dist.get_rank() == 0:
        (Path(directory) / "latest").write_text(name)
    dist.barrier()


@pytest.mark.parametrize("argv, world, expected", [
    (["--dp", "2", "--tp", "2", "--pp", "4"], 8, "must equal the world size"),
    (["--dp", "1", "--tp", "3", "--pp", "1"], 3, "query heads do not split"),
    (["--tp", "2", "--pp", "2", "--sequence-parallel", "--seq-len", "33"], 4, "--seq-len 33 is not a multiple"),
    (["--pp", "4", "--tp", "1", "--virtual-stages", "4", "--schedule", "interleaved", "--microbatches", "4"], 4,
     "too few for 16 stages"),
    (["--pp", "2", "--tp", "1", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "3",
      "--global-batch", "6"], 2, "multiple of --pp"),
    (["--dp", "2", "--tp", "1", "--pp", "1", "--global-batch", "6", "--microbatches", "2"], 2, "does not split"),
    (["--pp", "2", "--tp", "1", "--virtual-stages", "2"], 2, "virtual"),
    (["--zero-stage", "4"], 4, "invalid choice: 4"),
    (["--val-every", "-1"], 4, "--val-every must be a whole number ≥ 0, got -1"),
    (["--tp", "2", "--pp", "2", "--sequence-parallel", "--pp-sends", "scatter-gather"], 4,
     "got --tp 2 --pp 2 with --sequence-parallel"),
    (["--dp", "2", "--tp", "1", "--pp", "2", "--pp-sends", "scatter-gather"], 4, "it needs --tp > 1 and --pp > 1"),
    (["--dp", "2", "--tp", "2", "--pp", "1", "--pp-sends", "scatter-gather"], 4, "got --tp 2 --pp 1"),
    (["--pp-sends", "halves"], 4, "invalid choice: 'halves'"),
])
def test_bad_layouts_are_refused_before_any_communication(monkeypatch, argv, world, expected):
    """The checks are pure functions of the flags and the world size, so every rank reaches the same
    verdict; here one process stands for all of them."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    from common.errors import ConfigError
    from common.model import PRESETS
    train_3d = import_module("04_3d_combined.train_3d")
    parallel_3d = import_module("04_3d_combined.parallel_3d")
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        args = train_3d.parse_args(argv + ["--quiet"])
        layout = parallel_3d.decide_layout(args, PRESETS[args.model], world)
        parallel_3d.plan_pipeline(args, PRESETS[args.model], layout)


def _env(rank, world, port):
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    return env


def test_bad_degrees_exit_nonzero_on_every_rank_with_one_message():
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "04_3d_combined/train_3d.py", "--dp", "2", "--tp", "2", "--pp", "2"],
                              cwd=ROOT, env=_env(r, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=REFUSAL_TIMEOUT_S) for p in procs]
    assert all(p.returncode == 2 for p in procs)
    errors = [line for _, err in outs for line in err.splitlines() if line.startswith("error:")]
    assert errors and all("must equal the world size 2" in e for e in errors)
    assert not any("Traceback" in err for _, err in outs)


def test_a_killed_rank_makes_the_others_exit_with_a_clear_error(tmp_path):
    """Ranks started by hand (no torchrun agent to clean up): rank 3 is killed mid-run; the others
    must notice through the backend and exit with one line each, well within a minute."""
    port, metrics = free_port(), tmp_path / "m.jsonl"
    argv = [sys.executable, "04_3d_combined/train_3d.py", "--dp", "1", "--tp", "2", "--pp", "2", "--steps", "500",
            "--seq-len", "32", "--global-batch", "4", "--microbatches", "2", "--sample-tokens", "0", "--val-every", "0",
            "--quiet", "--timeout", "30"]
    procs = [subprocess.Popen(argv + (["--metrics", str(metrics)] if r == 0 else []), cwd=ROOT, env=_env(r, 4, port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(4)]
    try:
        deadline = time.time() + 120
        while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
            exited = [p for p in procs if p.poll() is not None]      # a rank that failed: say why, do not wait on
            assert not exited, f"a rank exited before the kill:\n{exited[0].communicate()[1][-2000:]}"
            time.sleep(0.2)
        assert metrics.exists(), "training never started"
        procs[3].send_signal(signal.SIGKILL)
        killed_at = time.time()
        outs = [p.communicate(timeout=60) for p in procs[:3]]
        assert time.time() - killed_at < 60
        for p, (_, err) in zip(procs[:3], outs):
            assert p.returncode not in (0, None)
            assert "lost contact with another rank" in err, err[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
