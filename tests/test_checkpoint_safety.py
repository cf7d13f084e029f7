"""Nothing lost: a fresh run never writes over another run's checkpoints, the cleanup after a save never
removes the checkpoint `latest` names or a later one, and a resumed run finds torch's global random
generator as the uninterrupted run had it (every script, at world size 1, one spawned group each)."""
import hashlib
import importlib
from pathlib import Path

import torch

from common import checkpoint
from common.errors import ConfigError
from harness import every_rank, run_group

SCRIPTS = ["01_data_parallel.train_dp", "01_data_parallel.train_zero", "02_tensor_parallel.train_tp",
           "03_pipeline_parallel.train_pp", "04_3d_combined.train_3d", "05_moe_expert_parallel.train_moe",
           "05_moe_expert_parallel.train_4d", "06_context_parallel.train_cp", "06_context_parallel.train_5d"]
SMALL = ["--seq-len", "16", "--global-batch", "2", "--quiet"]
SAMPLE_OFF = {"04_3d_combined.train_3d", "05_moe_expert_parallel.train_4d", "06_context_parallel.train_5d"}


def small(script: str) -> list[str]:
    return SMALL + (["--sample-tokens", "0"] if script in SAMPLE_OFF else [])


def tiny_save(directory: Path, step: int) -> None:
    checkpoint.save(directory, step, {"w": torch.full((2,), float(step))}, {}, {"model": "tiny"})


def contents(directory: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_cleanup_keeps_what_latest_names_and_every_later_checkpoint(tmp_path):
    for step in (2, 4, 6):
        tiny_save(tmp_path, step)
    assert sorted(p.name for p in tmp_path.glob("step_*.pt")) == ["step_000004.pt", "step_000006.pt"]
    (tmp_path / "latest").write_text("step_000004.pt")          # resumed from step 4: step 6 is later
    tiny_save(tmp_path, 5)
    assert sorted(p.name for p in tmp_path.glob("step_*.pt")) == ["step_000004.pt", "step_000005.pt",
                                                                  "step_000006.pt"]
    assert (tmp_path / "latest").read_text() == "step_000005.pt"
    # by step number, not by name: "step_1000000" sorts before "step_999999"
    for step in (999_999, 1_000_000, 1_000_001):
        tiny_save(tmp_path / "long", step)
    assert sorted(p.name for p in (tmp_path / "long").glob("step_*.pt")) == ["step_1000000.pt", "step_1000001.pt"]


def test_refusal_names_what_the_directory_holds(tmp_path):
    checkpoint.refuse_fresh_run_over(tmp_path / "new")            # missing or empty: a fresh run may use it
    checkpoint.refuse_fresh_run_over(tmp_path)
    (tmp_path / "step_000003.pt").write_bytes(b"x")              # a checkpoint without a pointer
    try:
        checkpoint.refuse_fresh_run_over(tmp_path)
        raise AssertionError("a directory holding step_000003.pt was accepted")
    except ConfigError as err:
        assert "step_000003.pt, and no 'latest'" in str(err) and "--resume" in str(err)


def test_a_fresh_run_refuses_another_runs_checkpoints_and_leaves_them_byte_identical(tmp_path):
    """Every script, without --resume, on a directory holding a later run's checkpoints: one line that
    names the step its `latest` names and --resume; afterwards every file is as it was."""
    old = tmp_path / "old_run"
    for step in (8, 10):
        tiny_save(old, step)
    before = contents(old)
    results = run_group(1, [(f"{s}:main", ["--steps", "2", "--checkpoint-dir", str(old)] + small(s)) for s in SCRIPTS])
    for script, res in zip(SCRIPTS, results):
        kind, message = res[0]
        assert kind == "config_error", f"{script}: a fresh run into a directory of checkpoints gave {kind}: {message}"
        assert "already holds checkpoints (its 'latest' names 'step_000010.pt', step 10)" in message, message
        assert "add --resume" in message and "\n" not in message, message
    assert contents(old) == before


def draws_per_step(script: str, argv: list[str]) -> list[float]:
    """Run a script's main with one draw from torch's global generator at the start of every step
    (where the learning rate is set), and return the draws."""
    module = importlib.import_module(script)
    real, draws = module.lr_at, []

    def lr_at_and_draw(*a, **k):
        draws.append(torch.rand(()).item())
        return real(*a, **k)

    module.lr_at = lr_at_and_draw
    try:
        module.main(argv)
    finally:
        module.lr_at = real
    return draws


def point_latest_at(directory: str, step: int) -> None:
    (Path(directory) / "latest").write_text(f"step_{step:06d}.pt")


def test_resume_restores_torchs_global_generator(tmp_path):
    """Save, draw, resume, compare: the draw of step 2 after resuming from step 1 is the uninterrupted
    run's, and a fresh run's first draw is the one --seed gives, in every script."""
    jobs = []
    for i, script in enumerate(SCRIPTS):
        ckpt = str(tmp_path / f"ck{i}")
        run = ["--steps", "2", "--checkpoint-dir", ckpt] + small(script)
        jobs += [("test_checkpoint_safety:draws_per_step", script, run + ["--checkpoint-every", "1"]),
                 ("test_checkpoint_safety:point_latest_at", ckpt, 1),
                 ("test_checkpoint_safety:draws_per_step", script, run + ["--resume"])]
    results = run_group(1, jobs)
    seeded = torch.Generator().manual_seed(1337)
    first = torch.rand((), generator=seeded).item()
    for i, script in enumerate(SCRIPTS):
        full, resumed = every_rank(results[3 * i])[0], every_rank(results[3 * i + 2])[0]
        assert full[0] == first, f"{script}: the first step's draw is not the one --seed 1337 gives"
        assert resumed == full[1:], f"{script}: after resuming at step 2 the generator draws {resumed}, " \
                                    f"the uninterrupted run {full[1:]}"
