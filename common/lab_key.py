"""What every chapter's answer-key generator (`0N_*/lab_answers.py`) stands on.

A generator runs its lab's commands, exactly as LAB.md prints them, from the repository root (with
the venv's `python` and `torchrun` first on PATH, as after `source .venv/bin/activate`), reads the
metrics files they write, and writes LAB_ANSWERS.md next to LAB.md: each exercise's numbers from
these runs, and the reasoning behind each "why". `make lab-answers` runs every chapter's generator.

Two guards keep the lab and its key from drifting apart:
- `Key.run(cmd)` refuses a command that LAB.md does not print (whitespace aside), so the key's
  numbers always come from the lab's own commands;
- `Key.broken(edits)` applies the lab's "break it on purpose" edits to a copy of the repository and
  refuses an edit whose old text is not in the named file exactly once, or that LAB.md does not
  print: if the code changes, the generator fails instead of the lab silently going stale.
"""
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from common.compare_metrics import compare, summary
from common.exercises.repo_copy import copy_repo
from common.metrics import PIPE_COLUMNS, read_metrics

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    cmd: str
    code: int
    out: str          # standard output and standard error, in that order
    seconds: float

    def error_line(self) -> str:
        """The one line a failed run prints for the user (`error: ...`), or '' if there is none."""
        return next((line.strip() for line in self.out.splitlines() if line.strip().startswith("error:")), "")

    def line_with(self, text: str) -> str:
        return next((line.strip() for line in self.out.splitlines() if text in line), "")

    def first_above(self) -> str:
        """What compare_metrics says of its first file's first step above the tolerance ("step 7",
        "none"), or "" if it printed no such line."""
        return self.line_with("first step above").split(": ")[-1]

    def rank_exit_codes(self) -> str:
        """The ranks' exit codes as torchrun's failure report lists them ("2"), or "" for a plain run."""
        return ", ".join(sorted(set(re.findall(r"exitcode\s*:\s*(-?\d+)", self.out))))


@dataclass
class Edit:
    """In `file`, replace `old` (which must occur exactly once) by `new`."""
    file: str
    old: str
    new: str


def squeeze(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


class Key:
    def __init__(self, chapter: str, title: str):
        self.chapter, self.title = chapter, title
        self.lab = squeeze((ROOT / chapter / "LAB.md").read_text())
        self.sections: list[str] = []
        self.started = time.time()

    # --- running the lab's commands -------------------------------------------------------------
    def run(self, cmd: str, root: Path = ROOT, check: bool = True) -> Result:
        """Run one of LAB.md's commands with bash from `root`; `check`: a non-zero exit is an error."""
        assert squeeze(cmd) in self.lab, f"{self.chapter}/LAB.md does not print this command:\n{cmd}"
        print(f"$ {squeeze(cmd)}" + (f"   (in {root})" if root != ROOT else ""), flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(["bash", "-c", cmd], cwd=root, env=self.env(), capture_output=True, text=True)
        result = Result(cmd, proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0)
        if check and result.code != 0:
            raise RuntimeError(f"exit code {result.code}: {cmd}\n{result.out[-3000:]}")
        return result

    def heredoc(self, opening: str) -> str:
        """LAB.md's multi-line command that starts with `opening` (e.g. `python - <<'PY'`), through the
        line that ends its here-document (`PY`), as printed."""
        text = (ROOT / self.chapter / "LAB.md").read_text()
        start, end = text.index(opening), opening.split("<<")[-1].strip("'\" ")
        return text[start:text.index(f"\n{end}\n", start) + len(end) + 1]

    @staticmethod
    def fresh(*folders: str) -> None:
        """Remove checkpoint folders an earlier run of this key left, so that the lab's runs start as
        a student's first try does (a run without --resume refuses a folder that holds checkpoints)."""
        for folder in folders:
            shutil.rmtree(ROOT / folder, ignore_errors=True)

    def interrupt_when(self, cmd: str, path: Path) -> None:
        """Run one of LAB.md's commands and press Ctrl-C (SIGINT to its process group) once `path`
        exists, e.g. a checkpoint directory's `latest` pointer."""
        assert squeeze(cmd) in self.lab, f"{self.chapter}/LAB.md does not print this command:\n{cmd}"
        print(f"$ {squeeze(cmd)}   (Ctrl-C once {path} exists)", flush=True)
        proc = subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, env=self.env(), start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not path.exists() and proc.poll() is None:
            time.sleep(0.2)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=300)

    @staticmethod
    def env() -> dict:
        """The environment of an activated venv: its `python` and `torchrun` first on PATH; the width
        a console gets through a pipe (PIPE_COLUMNS) even where the shell sets COLUMNS, so that the
        tables the scripts print keep every cell on one line, whatever terminal runs the generator."""
        return {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
                "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": str(PIPE_COLUMNS)}

    @contextmanager
    def broken(self, *edits: Edit):
        """A copy of the repository with the lab's edits applied; yields its root."""
        with tempfile.TemporaryDirectory(prefix=f"lab_{self.chapter[:2]}_") as tmp:
            root = Path(tmp) / "repo"
            copy_repo(root, ROOT)                # the course as shipped: what git tracks
            for e in edits:
                assert squeeze(e.old) in self.lab and squeeze(e.new) in self.lab, \
                    f"{self.chapter}/LAB.md does not print the edit {e}"
                path = root / e.file
                text = path.read_text()
                assert text.count(e.old) == 1, f"{e.file}: the text to replace occurs {text.count(e.old)} times:\n{e.old}"
                path.write_text(text.replace(e.old, e.new))
            yield root

    def failures(self, cmds: list[str], after: str) -> str:
        """Run commands that must fail with one `error:` line; a table of their flags (the command
        after `after`), exit codes and messages."""
        rows = []
        for cmd in cmds:
            r = self.run(cmd, check=False)
            assert r.code != 0 and r.error_line(), f"expected a one-line failure from: {cmd}\n{r.out[-2000:]}"
            rows.append([f"`{cmd.split(after, 1)[1].strip()}`", r.code, r.rank_exit_codes() or "-",
                         r.error_line().replace("|", "\\|")])
        return (table(["flags", "exit code ($?)", "ranks' exit codes (torchrun's report)", "message"], rows)
                + "\n\n" + textwrap.fill(
                    "Under torchrun, `$?` is torchrun's own exit code (1 when a worker failed). Its report lists "
                    "the ranks' codes: 2 for the rank that stopped on the configuration error first (every rank "
                    "runs the same check; the others wait a few seconds so that rank 0 speaks first), -15 for the "
                    "ranks torchrun then stopped with SIGTERM.", 100))

    @staticmethod
    def names(file: str, *names: str) -> None:
        """The key's prose names these in `file` (functions, classes): fail if the code lost them."""
        text = (ROOT / file).read_text()
        missing = [n for n in names if n not in text]
        assert not missing, f"{file} no longer has {missing}: update the answer key's text"

    def bench(self, cmd: str, result: str) -> str:
        """Run a benchmark command of LAB.md in a copy of the repository (benchmarks rewrite the
        committed results/ files) and return the text of the result file it wrote there."""
        with self.broken() as root:
            self.run(cmd, root=root)
            return (root / result).read_text().strip()

    # --- reading what the runs wrote ----------------------------------------------------------------
    @staticmethod
    def rows(path, root: Path = ROOT) -> list[dict]:
        return read_metrics(root / path)

    @staticmethod
    def worst(reference, other, key: str = "loss", root: Path = ROOT, ref_root: Path = ROOT) -> dict:
        """compare_metrics' summary of one file against a reference (max relative difference, its step)."""
        result = compare([ref_root / reference, root / other], key)
        return summary(next(iter(result["diffs"].values())), tol=1e-5)

    # --- writing the key ------------------------------------------------------------------------------
    def section(self, title: str, text: str) -> None:
        self.sections.append(f"## {title}\n\n{text.strip()}\n")

    def write(self) -> Path:
        minutes = (time.time() - self.started) / 60
        head = (f"# {self.title} — answer key\n\n"
                f"For the instructor. Generated by `python {self.chapter}/lab_answers.py` (or `make lab-answers`),"
                f" which ran every command of [LAB.md](LAB.md) as printed there and took the numbers below from"
                f" those runs; do not edit by hand. Machine: {platform.machine()}, {os.cpu_count()} cores,"
                f" Python {platform.python_version()}, about {max(1, round(minutes))} minute(s). What another machine"
                f" gives: bytes and counts exactly these; losses the same for the first steps (to about 1e-7),"
                f" then a 50-step trajectory drifts by up to about 1e-4 on another CPU, and where a mixture of"
                f" experts parts from one device (a routing near-tie) moves by a few steps; every equality with"
                f" one device that a check below asks for holds on any machine. Times, tokens/s and their ratios"
                f" are this machine's, and vary from run to run.\n")
        path = ROOT / self.chapter / "LAB_ANSWERS.md"
        path.write_text(head + "\n" + "\n".join(self.sections))
        print("written:", path, file=sys.stderr)
        return path


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def table_rows(markdown: str) -> list[dict]:
    """The rows of the (first) markdown table in `markdown`, as {column header: cell}."""
    lines = [line.strip().strip("|") for line in markdown.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.split("|")))) for line in lines[2:]]


def results_text(text: str) -> str:
    """A results/ file as a key shows it: its relative links rewritten to resolve from the chapter."""
    return re.sub(r"\]\((?![a-z]+:|/|#)([^)]+)\)", r"](results/\1)", text)


def mesh_row(out: str, rank: int, columns: int) -> list[str]:
    """The cells of `rank`'s row in the ranks table a training script prints (a row of `columns` cells)."""
    for line in out.splitlines():
        cells = [c.strip() for c in re.split(r"[│|┃]", line) if c.strip()]
        if len(cells) == columns and cells[0] == str(rank):
            return cells
    raise ValueError(f"no mesh row for rank {rank} in:\n{out[-2000:]}")


def mesh_groups(out: str, rank: int) -> dict[str, str]:
    """{dimension: the ranks of `rank`'s group, "4,5"} from the groups table a training script prints
    (`dp = edp × ep │ (0,2,4,6) (1,3,5,7)`; a long row continues on lines whose first cell is empty)."""
    rows: dict[str, str] = {}
    name, lines = None, out.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("the groups")), len(lines))
    for line in lines[start:]:
        parts = [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]
        if len(parts) != 2 or "(" not in parts[1]:
            continue
        name = parts[0].split(" ")[0] if parts[0] else name
        rows[name] = rows.get(name, "") + " " + parts[1]
    found = {dim: next((g for g in re.findall(r"\(([\d,]+)\)", groups) if str(rank) in g.split(",")), "")
             for dim, groups in rows.items()}
    if not found:
        raise ValueError(f"no groups table in:\n{out[-2000:]}")
    return found


def median_step_s(rows: list[dict]) -> float:
    """A run's median step time, its first step (the warm-up) left out."""
    return statistics.median(r["step_time_s"] for r in rows[1:])
