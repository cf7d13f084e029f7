"""The museum of real bugs: plant one in a copy of the course, find it with the course's tools, fix it.

    python -m common.exercises bug list                       # one line per exhibit: id, chapter, symptom
    python -m common.exercises bug 06.bug1 --out DIR      # a copy of the course with that bug planted
    python -m common.exercises grade --bug 06.bug1 --repo DIR   # "fixed", or the first test still failing
    python -m common.exercises bug --check [ID]               # plant each, run the tests that must catch it

The exhibits are in museum_catalog.py. `--check` is the museum turned around: it measures the test
suite's strength (does it catch each bug, and how fast?) and writes common/exercises/MUSEUM.md.
"""
import tempfile
import time
from pathlib import Path

from common.errors import ConfigError

from .grader import first_failure, hint
from .museum_catalog import BY_ID, EXHIBITS, Exhibit
from .repo_copy import ROOT, check_out, copy_repo, course_copy
from .run_tests import run_tests

MUSEUM_MD = ROOT / "common" / "exercises" / "MUSEUM.md"


def exhibit(bug_id: str) -> Exhibit:
    if bug_id not in BY_ID:
        raise ConfigError(f"no bug {bug_id!r} in the museum; `python -m common.exercises bug list` names them all")
    return BY_ID[bug_id]


def require_key(ex: Exhibit) -> None:
    """A student's copy names each bug's symptom, not the bug: planting needs the instructor's checkout."""
    if not ex.has_key:
        raise ConfigError(f"bug {ex.id}: this copy of the course holds each bug's symptom, not the bug itself; "
                          "plant it from the instructor's checkout")


def planted_text(ex: Exhibit, text: str) -> str:
    """`text` (the file's content) with the exhibit's snippet replaced; the snippet must occur once."""
    require_key(ex)
    n = text.count(ex.old)
    if n != 1:
        raise ConfigError(f"exhibit {ex.id} is stale: its snippet occurs {n} times in {ex.file} (must be once); "
                          "update common/exercises/museum_catalog.py to the code")
    return text.replace(ex.old, ex.new)


def plant(ex: Exhibit, repo: Path) -> None:
    """Plant the exhibit's bug in the copy at `repo`, in place."""
    path = Path(repo) / ex.file
    path.write_text(planted_text(ex, path.read_text()))


def catch(ex: Exhibit, repo: Path) -> tuple[str | None, str]:
    """Run the exhibit's catching tests in `repo`: (None, "") if all passed, else (the first test that did
    not pass, one line on why). A skipped test is no pass: it checked nothing."""
    results = run_tests(repo, list(ex.catch))
    for node in ex.catch:                          # a failure first: it is what catches the bug
        rec = results[node]
        if rec["status"] not in ("passed", "skipped"):
            line = first_failure(rec)
            return node, ("does not import: " if rec.get("phase") == "collect" else "") + line + \
                (f" (hint: {hint(line)})" if hint(line) else "")
    for node in ex.catch:
        if results[node]["status"] == "skipped":
            return node, f"skipped: {results[node]['line']}"
    return None, ""


# --- the subcommands ------------------------------------------------------------------------------------

def list_exhibits() -> int:
    width = max(len(e.id) for e in EXHIBITS)
    for e in EXHIBITS:
        print(f"{e.id:<{width}}  chapter {e.chapter}  {e.title}")
    return 0


def make_copy(ex: Exhibit, out: Path) -> int:
    require_key(ex)
    planted_text(ex, (ROOT / ex.file).read_text())          # stale? say so before copying anything
    check_out(out)
    copy_repo(out)
    plant(ex, out)
    print(f"{out}: the course with bug {ex.id} planted. What a user reported:\n  {ex.title}\n")
    print("See it for yourself (from that directory):")
    for cmd in ex.see:
        print(f"  {cmd}")
    print("\nFind it with the course's tools (compare_metrics, the tests, the timelines), fix it, then:\n"
          f"  python -m common.exercises grade --bug {ex.id} --repo {out}")
    return 0


def grade(ex: Exhibit, repo: Path) -> int:
    failed, line = catch(ex, repo)
    if failed is None:
        print(f"{ex.id}: fixed")
        return 0
    if line.startswith("skipped: "):          # nothing was checked: not "fixed", and not proof of the bug either
        print(f"{ex.id}: not confirmed: {failed} was {line}")
    else:
        print(f"{ex.id}: still broken: {failed}: {line}")
    return 1


def check(exhibits) -> int:
    """Plant each exhibit in a fresh copy and run its catching tests; write MUSEUM.md when all were checked."""
    rows, missed = [], 0
    for ex in exhibits:
        require_key(ex)
    for ex in exhibits:
        with tempfile.TemporaryDirectory(prefix="museum_") as tmp:
            repo = Path(tmp) / "repo"
            copy_repo(repo)
            plant(ex, repo)
            t0 = time.perf_counter()
            failed, line = catch(ex, repo)
            seconds = time.perf_counter() - t0
        caught = failed is not None and not line.startswith("skipped: ")     # a skipped test caught nothing
        verdict = "caught" if caught else "MISSED"
        missed += not caught
        print(f"{ex.id:<40} {verdict:<7} {seconds:6.0f} s  {failed or ', '.join(ex.catch)}", flush=True)
        rows.append((ex, verdict, seconds, failed, line))
    if len(rows) == len(EXHIBITS):
        MUSEUM_MD.write_text(museum_table(rows))
        print(f"written: {MUSEUM_MD.relative_to(ROOT)}")
    print(f"{len(rows) - missed} of {len(rows)} caught, {sum(r[2] for r in rows):.0f} s of tests")
    return 1 if missed else 0


def museum_table(rows) -> str:
    total = sum(r[2] for r in rows)
    caught = sum(r[1] == "caught" for r in rows)
    lines = ["# The museum of real bugs: does the test suite catch them?", "",
             "Written by `python -m common.exercises bug --check` (`make museum`): each bug planted in a fresh copy",
             "of the course, then the tests that must catch it run there. Seconds are this machine's (other work",
             f"on it slows them); a test module's spawned groups dominate them. {caught} of {len(rows)} caught,",
             f"{total:.0f} s of tests in all.", "",
             "| bug | chapter | class of real bug | catching test | verdict | seconds | first failure line |",
             "|---|---|---|---|---|---|---|"]
    for ex, verdict, seconds, failed, line in rows:
        first = (line[:110] + "…" if len(line) > 110 else line).replace("|", "\\|")
        lines.append(f"| `{ex.id}` | {ex.chapter} | {ex.bug_class} | `{failed or ex.catch[0]}` | {verdict} | "
                     f"{seconds:.0f} | {first} |")
    return "\n".join(lines) + "\n"


def key_section(chapter: str) -> tuple[str, str]:
    """(title, text) of a chapter's answer-key section "Find the bug": how each of its exhibits is found.
    Each chapter's lab_answers.py adds it, so LAB_ANSWERS.md carries the museum's key."""
    parts = []
    for ex in (e for e in EXHIBITS if e.chapter == chapter):
        parts.append(f"**`{ex.id}`** — *{ex.title}* ({ex.bug_class}; planted in `{ex.file}`).\n\n{ex.key}\n\n"
                     f"Caught by `{'`, `'.join(ex.catch)}`.")
    return "Find the bug — the museum's key", "\n\n".join(parts)


def main(args) -> int:
    """Dispatch of `bug ...` and `grade --bug ID` (common/exercises/__main__.py)."""
    if args.command == "grade":
        if args.chapter is not None:
            raise ConfigError(f"grade --bug {args.bug} --chapter {args.chapter}: give one of them "
                              "(--bug grades a museum copy, --chapter a student copy)")
        ex, repo = exhibit(args.bug), course_copy(args.repo)      # both checked before any test runs
        return grade(ex, repo)
    if args.check:
        return check([exhibit(args.bug_id)] if args.bug_id else EXHIBITS)
    if args.bug_id in (None, "list"):
        return list_exhibits()
    ex = exhibit(args.bug_id)
    if args.out is None:
        raise ConfigError(f"bug {ex.id}: name the copy to create with --out DIR")
    return make_copy(ex, args.out)

