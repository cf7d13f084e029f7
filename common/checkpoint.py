"""Checkpoints: written atomically, loaded without running code, resumable exactly.

Format: one file per save, `step_{k:06d}.pt`, holding the *consolidated single-device* state:
    model   {reference parameter name: full tensor}
    optim   {reference parameter name: {"exp_avg", "exp_avg_sq", "step"}}   (AdamW's state)
    step    the last finished optimizer step k
    rng     torch's global random state (CPU; and this rank's GPU as `cuda_rng` on CUDA)
    meta    the model config, seed and run settings that must match to resume
Because it is the single-device state, a run may resume in any layout: each rank takes its slice.
(The data position needs no saving: the batch of step t is a function of (seed, t), see data.py.)

Nothing lost: a run without --resume refuses a directory that already holds checkpoints (they belong
to another run, and its first save would start replacing them), and the cleanup after a save removes
only checkpoints older than the one just written, never the one `latest` names nor a later one.

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
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng"] = torch.cuda.get_rng_state()
    _atomic_write(path, lambda f: torch.save(state, f))
    _atomic_write(directory / "latest", lambda f: f.write(path.name.encode()))
    older = [p for p in saved_steps(directory) if _step_of(p) < step]
    for old in older[:len(older) - (KEEP - 1)]:       # by step number: the newest KEEP - 1 of them stay
        old.unlink()
    return path


def saved_steps(directory) -> list[Path]:
    """The checkpoint files in `directory`, oldest step first (by number: names sort wrongly past 999,999)."""
    return sorted(Path(directory).glob("step_*.pt"), key=_step_of)


def _step_of(path: Path) -> int:
    digits = path.stem.removeprefix("step_")
    return int(digits) if digits.isdigit() else -1


def refuse_fresh_run_over(directory) -> None:
    """A run without --resume must not write into another run's checkpoints: refuse, naming what is there."""
    directory = Path(directory)
    files = saved_steps(directory) if directory.is_dir() else []
    if not files and not has_checkpoint(directory):
        return
    pointer = directory / "latest"
    name = pointer.read_text().strip() if pointer.is_file() else ""
    if name:
        what = f"its 'latest' names {name!r}" + (f", step {_step_of(Path(name))}" if _step_of(Path(name)) >= 0 else "")
    else:
        what = f"{', '.join(p.name for p in files)}, and no 'latest'"
    raise ConfigError(f"--checkpoint-dir {str(directory)!r} already holds checkpoints ({what}): add --resume to "
                      "continue that run, or give an empty or new --checkpoint-dir for a fresh one "
                      "(this run would replace them)")


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
