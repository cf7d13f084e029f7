"""common/checkpoint.py's files: a round trip that keeps the last two, a crash while writing or while moving
the pointer that leaves the previous checkpoint whole, bad files refused as ConfigErrors, and no pickle that
runs code. Runs' restarts and resumes are test_checkpoint_safety.py's and each chapter's."""
import pytest
import torch

from common import checkpoint
from common.errors import ConfigError


META = {"model": "tiny", "seed": 1}


def _state(value: float):
    return {"w": torch.full((4,), value)}, {"w": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4),
                                                   "exp_avg_sq": torch.zeros(4)}}


def test_checkpoint_round_trip_and_keep_last_two(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, *_state(step), META)
    assert sorted(p.name for p in tmp_path.glob("step_*.pt")) == ["step_000002.pt", "step_000003.pt"]
    state = checkpoint.load(checkpoint.latest_path(tmp_path), META)
    assert state["step"] == 3 and torch.equal(state["model"]["w"], torch.full((4,), 3.0))


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 1, *_state(1), META)

    def dying_save(obj, f):          # writes half a file, then the disk fills / the process is killed
        f.write(b"\x80partial checkpoint bytes")
        raise OSError("No space left on device")
    monkeypatch.setattr(checkpoint.torch, "save", dying_save)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, 2, *_state(2), META)
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "step_000001.pt"
    assert not (tmp_path / "step_000002.pt").exists()
    state = checkpoint.load(checkpoint.latest_path(tmp_path), META)
    assert state["step"] == 1 and torch.equal(state["model"]["w"], torch.ones(4))


def test_crash_while_moving_the_pointer_keeps_the_old_pointer(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 1, *_state(1), META)
    real = checkpoint._atomic_write

    def pointer_dies(path, write):
        if path.name == "latest":
            raise KeyboardInterrupt
        real(path, write)
    monkeypatch.setattr(checkpoint, "_atomic_write", pointer_dies)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 2, *_state(2), META)
    assert (tmp_path / "latest").read_text() == "step_000001.pt"   # the new file exists, but is not named yet
    assert checkpoint.load(checkpoint.latest_path(tmp_path), META)["step"] == 1


def test_bad_checkpoints_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint to resume"):
        checkpoint.latest_path(tmp_path)
    checkpoint.save(tmp_path, 1, *_state(1), META)
    with pytest.raises(ConfigError, match="saved with model='tiny' but this run has model='small'"):
        checkpoint.load(checkpoint.latest_path(tmp_path), {"model": "small"})
    (tmp_path / "step_000001.pt").write_bytes(b"garbage" * 100)
    with pytest.raises(ConfigError, match="corrupt or unreadable"):
        checkpoint.load(checkpoint.latest_path(tmp_path), META)
    (tmp_path / "latest").write_text("step_000009.pt")
    with pytest.raises(ConfigError, match="missing"):
        checkpoint.latest_path(tmp_path)


def test_checkpoints_load_without_running_code(tmp_path):
    """weights_only=True: a pickle that would call a function is refused, as a clear ConfigError."""
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "optim": {}, "step": 1, "meta": {}, "payload": print}, path)
    with pytest.raises(ConfigError, match="corrupt or unreadable"):
        checkpoint.load(path, {})
