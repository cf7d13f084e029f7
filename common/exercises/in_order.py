"""The exercises written in the LAB's order: does each read `done` as soon as it and those before it are?

A student copy of every chapter starts with every exercise a stub. This writes them one at a time, in the
catalog's order (each LAB sets its chapter's in that order), and grades each right after it is written.
Every verdict must be `done`: one that reads `waits on` a LATER exercise would make the student wait for
work the LAB has not asked for yet. (A layout run shared with a later exercise is left for that one:
grader.layout_waits.) `python -m common.exercises wrong --check` runs this after the wrong answers and
writes its table into WRONG_ANSWERS.md.
"""
import tempfile
import time
from pathlib import Path

from .catalog import EXERCISES
from .grader import grade
from .student_copy import make_student_copy, restore


def check_in_order(log=print) -> list[tuple]:
    """(exercise, its verdict right after it was written, seconds) for every exercise, in order."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="in_order_") as tmp:
        repo = Path(tmp) / "course"
        make_student_copy(repo, EXERCISES)
        for ex in EXERCISES:
            restore(repo, ex)                               # the student writes this one, the reference's way
            t0 = time.perf_counter()
            v = grade([ex], repo, log=lambda *a, **k: None)[0]
            rows.append((ex, v, time.perf_counter() - t0))
            log(f"{v.line():<100} {rows[-1][2]:4.0f} s", flush=True)
    return rows


def table(rows) -> str:
    done = sum(v.status == "done" for _, v, _ in rows)
    lines = ["## Written in order: each exercise done once it and those before it are", "",
             "A student copy of every chapter; the exercises written one at a time in the catalog's (the LABs')",
             f"order, each graded right after it is written (`common/exercises/in_order.py`). {done} of {len(rows)} "
             "`done`.", "",
             "| exercise | verdict right after it is written | seconds |", "|---|---|---|"]
    for ex, v, seconds in rows:
        said = v.status + (f": {v.detail}" if v.detail else "")
        lines.append(f"| `{ex.id}` | {said.replace('|', chr(92) + '|')} | {seconds:.0f} |")
    return "\n".join(lines) + "\n"
