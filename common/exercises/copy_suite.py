"""A student copy against its own tests: does the copy fail only where an exercise is still to do?

    python -m common.exercises copies [--chapter NN|all]

For each chapter: a fresh student copy (`make`), then that chapter's tests in it, as a student runs them
(`make test CHAPTER=NN`: pytest --chapter NN, three workers), each test's outcome recorded
(outcome_plugin.py). A test that fails is put down to an open exercise only when its failure shows one
of the copy's stubs, the NotImplementedError that stands in for the exercise's body (`exercise 03.zbv: …`);
every other failure is the copy's own fault (a link into a file the copy leaves out, a test that reads an
answer key it does not have, a fixture that needs the reference) and the command exits 1 naming it."""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .catalog import CHAPTERS, for_chapter
from .student_copy import make_student_copy, stub_prefix


def run_chapter_tests(copy: Path, chapter: str, outcomes: Path, timeout_s: float = 1800) -> float:
    """The chapter's tests in `copy`, each outcome written to `outcomes`; returns the seconds they took."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "3", "--dist", "loadfile", "-p", "no:cacheprovider",
           "-p", "common.exercises.outcome_plugin", f"--outcomes={outcomes}", "--chapter", chapter, "tests"]
    started = time.perf_counter()
    subprocess.run(cmd, cwd=copy, capture_output=True, text=True, timeout=timeout_s,
                   env={**os.environ, "PYTHONPATH": str(copy)})
    return time.perf_counter() - started


def classify(records: dict, exercises: list) -> dict[str, list[str]]:
    """{"passed", "skipped", "open exercise", "other": [node ids]}: a failure is an open exercise's when
    its text shows the stub of one of `exercises`."""
    out = {"passed": [], "skipped": [], "open exercise": [], "other": []}
    for node, rec in sorted(records.items()):
        if rec["status"] == "passed":
            out["passed"].append(node)
        elif rec["status"] == "skipped":
            out["skipped"].append(node)
        elif any(stub_prefix(ex) in rec["line"] + rec["text"] for ex in exercises):
            out["open exercise"].append(node)
        else:
            out["other"].append(node)
    return out


def check_chapter(chapter: str) -> tuple[dict, float]:
    exercises = for_chapter(chapter)
    with tempfile.TemporaryDirectory(prefix=f"copy{chapter}_") as tmp:
        copy, outcomes = Path(tmp) / "copy", Path(tmp) / "outcomes.json"
        make_student_copy(copy, exercises)
        seconds = run_chapter_tests(copy, chapter, outcomes)
        records = json.loads(outcomes.read_text()) if outcomes.exists() else {}
    if not records:
        return {"passed": [], "skipped": [], "open exercise": [], "other": ["(the tests did not run)"]}, seconds
    return classify(records, exercises), seconds


def main(chapter: str) -> int:
    chapters = CHAPTERS if chapter == "all" else [for_chapter(chapter)[0].chapter]
    print("| chapter | tests | passed | skipped | failed on an open exercise | failed otherwise | seconds |")
    print("|---|---|---|---|---|---|---|")
    others = {}
    for ch in chapters:
        result, seconds = check_chapter(ch)
        n = sum(len(v) for v in result.values())
        print(f"| {ch} | {n} | {len(result['passed'])} | {len(result['skipped'])} | "
              f"{len(result['open exercise'])} | {len(result['other'])} | {seconds:.0f} |", flush=True)
        if result["other"]:
            others[ch] = result["other"]
    for ch, nodes in others.items():
        print(f"chapter {ch}'s copy fails where no exercise is open:", *(f"  {n}" for n in nodes), sep="\n")
    return 1 if others else 0
