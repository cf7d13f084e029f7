"""A copy of the repository: the files git tracks (or, outside a checkout, every file but the
virtual environment, caches and runs), without the instructor's answer keys (answer_keys.py names them),
so a student copy or a museum copy is the course as a student receives it.

`check_out` and `course_copy` are the command line's checks of a copy's folder: the one `make` and
`bug ID` create (--out), and the one `grade` reads (--repo). Each refuses with one ConfigError before
anything is copied or run."""
import os
import shutil
import subprocess
from pathlib import Path

from common.errors import ConfigError

from .answer_keys import is_key, write_public_files

ROOT = Path(__file__).resolve().parents[2]
_SKIP = {".venv", ".git", "runs", "__pycache__", ".pytest_cache", ".ipynb_checkpoints"}


def tracked_files(src: Path) -> list[Path]:
    """Paths relative to `src`: what `git ls-files` lists (untracked new files included), else a walk."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=src, check=True,
                             capture_output=True, text=True).stdout
        return [Path(line) for line in out.splitlines() if line and (src / line).is_file()]
    except (subprocess.CalledProcessError, FileNotFoundError):
        return [p.relative_to(src) for p in src.rglob("*")
                if p.is_file() and not _SKIP.intersection(p.relative_to(src).parts)]


def check_out(out: Path, src: Path = ROOT, flag: str = "--out") -> None:
    """Refuse (ConfigError) a folder that a copy of `src` must not be made in: an existing file, a
    directory that holds anything (nothing of the user's is ever overwritten), a place inside `src`
    itself (the course would copy itself into itself), or one that cannot be created."""
    out, src = Path(out), Path(src).resolve()
    where = out.resolve()
    if where == src or src in where.parents:
        raise ConfigError(f"{flag} {out}: inside the course's checkout {src}; name a new directory outside it "
                          f"(e.g. {src.parent / (src.name + '-copy')})")
    if os.path.lexists(out) and not out.is_dir():
        raise ConfigError(f"{flag} {out}: a file of that name exists (not a directory); name a new directory")
    if out.is_dir():
        if any(out.iterdir()):
            raise ConfigError(f"{flag} {out}: the directory exists and is not empty; name a new one")
        if not os.access(out, os.W_OK | os.X_OK):
            raise ConfigError(f"{flag} {out}: the directory is not writable; name one you can write")
        return
    parent = next(p for p in out.absolute().parents if os.path.lexists(p))   # the nearest that exists
    if not parent.is_dir():
        raise ConfigError(f"{flag} {out}: {parent} is a file, not a directory; name a new directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {out}: cannot create it in {parent} (not writable); name a directory you can write")


def copy_repo(out: Path, src: Path = ROOT) -> Path:
    """Copy the repository at `src` to `out` (which must not exist or be empty: see `check_out`), without
    its answer keys; returns `out`."""
    out = Path(out)
    check_out(out, src)
    try:                        # what the checks cannot see: a place the system refuses (/proc, a full disk)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--out {out}: cannot create it ({err.strerror}); name a directory you can write") from None
    for rel in tracked_files(Path(src)):
        if is_key(rel):                       # the answers stay in the instructor's checkout
            continue
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(src) / rel, out / rel)
    write_public_files(out)
    return out


def course_copy(repo: Path | None, flag: str = "--repo") -> Path:
    """The resolved copy of the course that `grade` runs the tests in (this repository when None); a
    ConfigError when `repo` is no such copy: the tests there could not even load the grader's plugin."""
    if repo is None:
        return ROOT
    path = Path(repo)
    if not path.exists():
        why = "no such directory"
    elif not path.is_dir():
        why = "it is a file, not a directory"
    elif not (path / "common" / "exercises").is_dir():
        why = "no common/exercises in it"
    elif not (path / "common" / "exercises" / "outcome_plugin.py").is_file():
        why = "no common/exercises/outcome_plugin.py in it"
    elif "--outcomes-select" not in (path / "common" / "exercises" / "outcome_plugin.py").read_text():
        why = "its common/exercises/outcome_plugin.py is older than this grader; make a new copy"
    else:
        return path.resolve()
    raise ConfigError(f"{flag} {repo}: not a copy of the course ({why}); name a folder that `make` or `bug ID --out` created")
