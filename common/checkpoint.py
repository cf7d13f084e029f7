"""Checkpoints: written atomically, loaded without running code, resumable exactly.

Format: one file per save, `step_{k:06d}.pt`, holding the *consolidated single-device* state:
    model   {reference parameter name: full tensor}
    optim   {reference parameter name: {"exp_avg", "exp_avg_sq", "step"}}   (AdamW's state)
    step    the last finished optimizer step k
    rng     torch's CPU random state
    meta    the model config, seed and run settings that must match to resume
Because it is the single-device state, a run may resume in any layout: each rank takes its slice.
(The data position needs no saving: the batch of step t is a function of (seed, t), see data.py.)

Atomic: the file is written to a temporary name, flushed to disk, then renamed over the final name
(a rename is atomic on POSIX), and only then does the `latest` pointer move. A crash mid-save leaves
the previous checkpoint and pointer untouched.
Safe: torch.load(weights_only=True) only rebuilds tensors and plain containers, never runs code.
"""
import os
from pathlib import Path

import torch

from common.errors import ConfigError, require

KEEP = 2   # checkpoints kept on disk; older ones are removed after a successful save


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(directory, step: int, model: dict, optim: dict, meta: dict) -> Path:
    """Write one checkpoint (call on one rank only, with the consolidated state)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:06d}.pt"
    state = {"model": model, "optim": optim, "step": step, "rng": torch.get_rng_state(), "meta": meta}
    _atomic_write(path, lambda f: torch.save(state, f))
    _atomic_write(directory / "latest", lambda f: f.write(path.name.encode()))
    for old in sorted(directory.glob("step_*.pt"))[:-KEEP]:
        old.unlink()
    return path


def has_checkpoint(directory) -> bool:
    """Whether `directory` has a checkpoint to resume (its `latest` pointer), as after the first save."""
    return (Path(directory) / "latest").is_file()


def latest_path(directory) -> Path:
    directory = Path(directory)
    pointer = directory / "latest"
    require(pointer.is_file(), f"no checkpoint to resume in {str(directory)!r} (no 'latest' file); "
                               "run without --resume first, or point --checkpoint-dir at a run's directory")
    path = directory / pointer.read_text().strip()
    require(path.is_file(), f"{str(pointer)!r} names {path.name!r}, which is missing; restore it or remove --resume")
    return path


def load(path, expect_meta: dict) -> dict:
    """Load a checkpoint on this rank and check it belongs to this run. Every rank calls this."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:   # truncated, overwritten, not a torch file...
        raise ConfigError(f"checkpoint {str(path)!r} is corrupt or unreadable ({type(err).__name__}); "
                          "delete it (and its 'latest' entry) to resume from an earlier one") from None
    require(isinstance(state, dict) and {"model", "optim", "step", "meta"} <= set(state),
            f"checkpoint {str(path)!r} is not a checkpoint of this project; point --checkpoint-dir elsewhere")
    for key, want in expect_meta.items():
        have = state["meta"].get(key)
        require(have == want, f"checkpoint {str(path)!r} was saved with {key}={have!r} but this run has "
                              f"{key}={want!r}; resume with the same {key}, or use another --checkpoint-dir")
    return state
