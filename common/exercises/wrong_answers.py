"""Wrong answers, planted: does the grading of each exercise fail the mistakes students really make?

    python -m common.exercises wrong list                          # every listed wrong answer, one line each
    python -m common.exercises wrong 06.merge.no_max --out DIR     # a copy with that wrong answer written in
    python -m common.exercises wrong --check [ID]                  # plant each in turn, grade it: must be `wrong:`

An exercise lists its wrong answers in catalog.py (`wrong=`: a name and what the student wrote); the code of
each is one edit of the reference body in wrong_answers_key.py, which only the instructor's checkout holds.
`--check` is the grader turned around, like the museum's: it plants each in one copy of the course, grades
the exercise (its unit tests first; the layout run only if they pass) and writes
common/exercises/WRONG_ANSWERS.md. A wrong answer graded anything but `wrong:` is a gap in the tests. The
whole check then writes every exercise in the LABs' order and grades each as it is written (in_order.py):
each must read `done`, never `waits on` one the LAB sets later."""
import tempfile
import time
from pathlib import Path

from common.errors import ConfigError

from . import in_order
from .catalog import EXERCISES, Exercise
from .grader import Verdict, grade
from .repo_copy import ROOT, check_out, copy_repo

WRONG_MD = ROOT / "common" / "exercises" / "WRONG_ANSWERS.md"
ALL = {f"{ex.id}.{name}": (ex, name, said) for ex in EXERCISES for name, said in ex.wrong}   # "06.merge.no_max"


def edit(ex: Exercise, name: str) -> tuple[str, str]:
    """(the reference's lines, the wrong lines) of one wrong answer; a ConfigError in a student's copy."""
    try:
        from .wrong_answers_key import WRONG_EDITS
    except ImportError:
        raise ConfigError("this copy of the course holds no wrong answers' key: plant them from the instructor's "
                          "checkout") from None
    return WRONG_EDITS[ex.id][name]


def planted_text(ex: Exercise, name: str, text: str) -> str:
    """`text` (the exercise's file) with the wrong answer written in; its edit must occur once."""
    old, new = edit(ex, name)
    if text.count(old) != 1:
        raise ConfigError(f"wrong answer {ex.id}.{name} is stale: its text occurs {text.count(old)} times in "
                          f"{ex.file} (must be once); update common/exercises/wrong_answers_key.py to the code")
    return text.replace(old, new)


def grade_planted(ex: Exercise, repo: Path) -> tuple[Verdict, bool]:
    """The exercise's verdict in `repo`, and whether its layout run was needed: the unit tests first (seconds),
    the layout run (a minute) only when they pass."""
    quiet = lambda *a, **k: None                                        # noqa: E731
    v = grade([ex], repo, quick=True, log=quiet)[0]
    if v.status == "wrong" or not ex.units:
        return v, False
    return grade([ex], repo, quick=False, log=quiet)[0], True


def check(ids: list[str]) -> int:
    """Plant each wrong answer in one copy (the file restored after each) and grade it; the table when all ran."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="wrong_") as tmp:
        repo = copy_repo(Path(tmp) / "repo")
        for wid in ids:
            ex, name, said = ALL[wid]
            path = repo / ex.file
            original = path.read_text()
            path.write_text(planted_text(ex, name, original))
            t0 = time.perf_counter()
            v, full = grade_planted(ex, repo)
            seconds = time.perf_counter() - t0
            path.write_text(original)
            print(f"{wid:<44} {v.status:<9} {seconds:5.0f} s  {v.detail[:120]}", flush=True)
            rows.append((wid, said, v, full, seconds))
    missed = sum(v.status != "wrong" for _, _, v, _, _ in rows)
    print(f"{len(rows) - missed} of {len(rows)} graded wrong, {sum(r[4] for r in rows):.0f} s of tests")
    if len(rows) == len(ALL):                       # all of them: then the right answers, in the LABs' order
        print("the exercises written in order, each graded as soon as it is written:")
        ordered = in_order.check_in_order()
        WRONG_MD.write_text(table(rows) + "\n" + in_order.table(ordered))
        print(f"written: {WRONG_MD.relative_to(ROOT)}")
        missed += sum(v.status != "done" for _, v, _ in ordered)
    return 1 if missed else 0


def table(rows) -> str:
    lines = ["# Wrong answers: does the grader fail each one?", "",
             "Written by `python -m common.exercises wrong --check` (`make wrong-answers`): each wrong answer that",
             "common/exercises/catalog.py lists is written into a copy of the course, and its exercise graded: the",
             "unit tests first, the layout run only if they pass. Seconds are this machine's. "
             f"{sum(r[2].status == 'wrong' for r in rows)} of {len(rows)} graded `wrong:`.", "",
             "| wrong answer | what the student wrote | verdict | layout run needed | seconds | the grader's line |",
             "|---|---|---|---|---|---|"]
    for wid, said, v, full, seconds in rows:
        line = v.line().split(None, 1)[1] if v.line().strip() else ""
        line = (line[:140] + "…" if len(line) > 140 else line).replace("|", "\\|")
        lines.append(f"| `{wid}` | {said} | {v.status} | {'yes' if full else 'no'} | {seconds:.0f} | {line} |")
    return "\n".join(lines) + "\n"


def make_copy(wid: str, out: Path) -> int:
    ex, name, said = ALL[wid]
    text = planted_text(ex, name, (ROOT / ex.file).read_text())           # stale? say so before copying
    check_out(out)
    copy_repo(out)
    (Path(out) / ex.file).write_text(text)
    print(f"{out}: the course with exercise {ex.id} written wrong ({said}).\n"
          f"grade it: python -m common.exercises grade --chapter {ex.chapter} --repo {out}")
    return 0


def main(args) -> int:
    """Dispatch of `wrong ...` (common/exercises/__main__.py)."""
    if args.wrong_id not in (None, "list") and args.wrong_id not in ALL:
        raise ConfigError(f"no wrong answer {args.wrong_id!r}; `python -m common.exercises wrong list` names them")
    if args.check:
        return check([args.wrong_id] if args.wrong_id not in (None, "list") else list(ALL))
    if args.wrong_id in (None, "list"):
        for wid, (ex, name, said) in ALL.items():
            print(f"{wid:<44}{said}")
        return 0
    if args.out is None:
        raise ConfigError(f"wrong {args.wrong_id}: name the copy to create with --out DIR")
    return make_copy(args.wrong_id, args.out)
