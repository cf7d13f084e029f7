"""`grade`: one pytest run over every test of a chapter's exercises, then one verdict per exercise.

    done                      every test that grades it passed (and only then: a skipped test checked nothing);
                              its layout run is left for later while an exercise sharing it is not written
    not done                  its stub is still in the file, or its own NotImplementedError stopped a test
    waits on 02.f_g           its tests fail only where another exercise's NotImplementedError stopped them,
                              or they fail and an exercise before it in its chapter (the LAB's order) graded in
                              the same run fails its own tests: that answer may break this one's tests
    wrong: <test>: <line>     a test failed on its own: the first failing comparison, in one line, and a hint
                              of where to look when the line tells (`hint`)
    wrong: <test> does not import: <line>    the test's module (or the code it imports) did not load
    wrong: its body calls <name> …            the body calls the course's own answer that its tests compare
                                              with (catalog.Exercise.references): borrowed, not written
    skipped: <test>: <reason> no test failed, but this one was skipped: the exercise is not graded yet

Nothing here knows an answer: the verdicts are the course's own tests, read."""
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .catalog import BY_ID, EXERCISES, Exercise, regions
from .run_tests import run_tests
from .student_copy import stub_prefix, unsolved

# A harness failure ("expected 'ok' on every rank; got: --- rank 0: error --- <traceback>") is a wall of
# text: the line worth showing is the exception at the end of the first rank's traceback.
_RANK_BLOCK = re.compile(r"--- rank \d+: \w+ ---\n(.*?)(?=\n--- rank \d+:|\Z)", re.S)
_EXCEPTION = re.compile(r"^(?:[\w.]+(?:Error|Exception)|AssertionError|ConfigError|Failed)\b.*$")


@dataclass
class Verdict:
    exercise: Exercise
    status: str            # "done" | "not done" | "waits on" | "wrong" | "skipped"
    detail: str = ""

    def line(self) -> str:
        ex, width = self.exercise, 26
        if self.status == "waits on":
            return f"{ex.id:<{width}}waits on {self.detail}"
        if self.status in ("wrong", "skipped"):
            return f"{ex.id:<{width}}{self.status}: {self.detail}"
        return f"{ex.id:<{width}}{self.status}" + (f"   ({self.detail})" if self.detail else "")


def short_test(node: str) -> str:
    """tests/test_tp.py::test_x[2] -> test_tp.py::test_x[2]"""
    return node.split("/")[-1]


def first_failure(record: dict) -> str:
    """One line: the failing comparison, or the exception that stopped a rank."""
    line = record.get("line", "").strip()
    if "on every rank; got:" in line or "not run: this rank stopped at job" in line or not line:
        text = re.sub(r"(?m)^E {3,}", "", record.get("text", ""))       # pytest's "E   " before each line
        blocks = _RANK_BLOCK.findall(text)
        if not blocks and "not run: this rank stopped at job" in text:   # one rank's job raised: its traceback
            blocks = [text.split("not run: this rank stopped at job", 1)[1]]
        for block in blocks:
            lines = [ln.strip() for ln in block.splitlines()]
            found = [i for i, ln in enumerate(lines) if _EXCEPTION.match(ln)]
            if found:
                i = found[-1]
                if lines[i] == "AssertionError" and i > 0:           # a bare assert: show its source line,
                    j = i - 1                                         # not the ^^^ under it (Python 3.11+)
                    while j > 0 and re.fullmatch(r"[\^~ ]+", lines[j]):
                        j -= 1
                    return f"AssertionError: {lines[j]}"[:300]
                return lines[i][:300]
    return re.sub(r"^E\s+", "", line)[:300]          # pytest's "E   " prefix of a collection error


# Where the failing line itself says where to look, a `wrong:` verdict adds one hint.
_LOSS_VS_NORM = re.compile(r"losses differ by (\S+) \(≤ (\S+)\), gradient norms by (\S+) \(≤ (\S+)\)")


def hint(line: str) -> str:
    """One hint read from a failure line ("" when the line says nothing more than itself)."""
    if re.match(r"(?:AssertionError: )?cp 1 \w", line):        # chapter 06's attention cases, by cp
        return "fails already at cp 1: the local math, not the ring"
    m = _LOSS_VS_NORM.search(line)
    if m:
        loss, loss_tol, norm, norm_tol = (float(x.rstrip("…")) for x in m.groups())
        if loss <= loss_tol < norm_tol < norm:
            return "the losses match and the gradient norms do not: forward is right; look at backward and the gradient sums"
    return ""


def blocked_by(text: str, me: Exercise) -> list[str]:
    """The other exercises whose stub (their NotImplementedError) appears in a failure's text."""
    return [ex_id for ex_id in BY_ID if ex_id != me.id and stub_prefix(BY_ID[ex_id]) in text]


def layout_waits(ex: Exercise, repo: Path) -> list[str]:
    """The other exercises that share ex's layout run and are not written yet. Until they are, that run
    cannot pass whatever ex holds, so ex is graded on its own tests alone: a student who writes a
    chapter's exercises in the LAB's order never sees one wait on a later one."""
    return [o.id for o in BY_ID.values() if o.id != ex.id and o.layout == ex.layout and unsolved(repo, o)]


def borrowed(ex: Exercise, repo: Path) -> str:
    """The first of ex's `references` (the course's own answer its tests compare with) that its body names
    outside a comment, or "" (also when it has none to name)."""
    if not ex.references:
        return ""
    text = (Path(repo) / ex.file).read_text()
    lines = text.splitlines()
    code = [line.split("#", 1)[0] for ex_id, first, stop in regions(text) if ex_id == ex.id for line in lines[first:stop]]
    return next((name for name in ex.references if any(re.search(rf"\b{re.escape(name)}\b", c) for c in code)), "")


def graded_nodes(ex: Exercise, repo: Path, quick: bool) -> list[str]:
    """The tests that grade ex now: its units, and its layout run unless --quick or layout_waits."""
    return ex.node_ids(quick or bool(layout_waits(ex, repo)))


def verdict(ex: Exercise, repo: Path, outcomes: dict, quick: bool, units_wrong=frozenset()) -> Verdict:
    """`units_wrong`: the exercises of this run whose own unit tests failed. When only the layout run
    fails and it is shared with one of them, that one is the likelier culprit: this one waits on it."""
    if unsolved(repo, ex):
        return Verdict(ex, "not done")
    if name := borrowed(ex, repo):
        return Verdict(ex, "wrong", f"its body calls {name}, the course's own answer that its tests compare with; "
                                    "write it yourself")
    nodes = graded_nodes(ex, repo, quick)
    failed = [(node, outcomes[node]) for node in nodes if outcomes[node]["status"] not in ("passed", "skipped")]
    skipped = [(node, outcomes[node]) for node in nodes if outcomes[node]["status"] == "skipped"]
    if not failed and not skipped:
        later = layout_waits(ex, repo)
        return Verdict(ex, "done", f"its own tests; its layout run waits on {', '.join(later)}"
                       if later and not quick else "")
    if not failed:
        node, rec = skipped[0]
        return Verdict(ex, "skipped", f"{short_test(node)}: {rec['line'] or 'skipped'}")
    if any(stub_prefix(ex) in rec["text"] or stub_prefix(ex) in rec["line"] for _, rec in failed):
        return Verdict(ex, "not done", "its NotImplementedError is still raised")
    waits = sorted({other for _, rec in failed for other in blocked_by(rec["text"] + rec["line"], ex)})
    if not waits and [node for node, _ in failed] == [ex.layout]:
        waits = sorted(other.id for other in BY_ID.values()
                       if other.id in units_wrong and other.id != ex.id and other.layout == ex.layout)
    if not waits:               # an earlier exercise of its chapter, answered wrong, may be what fails its tests
        waits = [other.id for other in EXERCISES[:EXERCISES.index(ex) if ex in EXERCISES else 0]
                 if other.chapter == ex.chapter and other.id in units_wrong]
    if waits:
        return Verdict(ex, "waits on", ", ".join(waits))
    node, rec = failed[0]
    if rec.get("phase") == "collect":
        return Verdict(ex, "wrong", f"{short_test(node)} does not import: {first_failure(rec)}")
    line = first_failure(rec)
    return Verdict(ex, "wrong", f"{short_test(node)}: {line}" + (f" (hint: {hint(line)})" if hint(line) else ""))


def grade(exercises: list[Exercise], repo: Path, quick: bool = False, log=print) -> list[Verdict]:
    """Run every test of `exercises` in `repo` in one pytest run, print one line per exercise, and
    return the verdicts."""
    todo = [ex for ex in exercises if not unsolved(repo, ex)]     # a stub still there needs no test run
    nodes = list(dict.fromkeys(node for ex in todo for node in graded_nodes(ex, repo, quick)))
    log(f"grading {len(exercises)} exercise(s) in {repo}: {len(todo)} written, {len(nodes)} test(s) to run",
        flush=True)
    t0 = time.perf_counter()
    outcomes = run_tests(repo, nodes) if todo else {}
    units_wrong = {ex.id for ex in todo if any(outcomes[n]["status"] not in ("passed", "skipped") for n in ex.units)}
    verdicts = [verdict(ex, repo, outcomes, quick, units_wrong) for ex in exercises]
    for v in verdicts:
        log(v.line())
    done = sum(v.status == "done" for v in verdicts)
    log(f"{done} of {len(verdicts)} done  ({time.perf_counter() - t0:.0f} s)")
    return verdicts
