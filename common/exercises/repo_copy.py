"""A copy of the repository: the files git tracks (or, outside a checkout, every file but the
virtual environment, caches and runs), so a student copy or a museum copy is the course as shipped."""
import shutil
import subprocess
from pathlib import Path

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


def copy_repo(out: Path, src: Path = ROOT) -> Path:
    """Copy the repository at `src` to `out` (which must not exist or be empty); returns `out`."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        from common.errors import ConfigError
        raise ConfigError(f"--out {out}: the directory exists and is not empty; name a new one")
    for rel in tracked_files(Path(src)):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(src) / rel, out / rel)
    return out
