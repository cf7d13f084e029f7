"""list, make and grade (the museum's `bug` and `grade --bug` live in museum.py)."""
from pathlib import Path

from common.errors import ConfigError

from .catalog import EXERCISES, for_chapter
from .grader import grade
from .repo_copy import course_copy
from .student_copy import make_student_copy


def list_exercises() -> int:
    """One line per exercise: its id, its file, what it asks, and the tests that grade it."""
    for ex in EXERCISES:
        tests = ", ".join(node.split("/")[-1] for node in ex.node_ids())
        print(f"{ex.id:<26}{ex.file:<44}{ex.title}\n{'':<26}graded by: {tests}")
    return 0


def make(chapter: str, out: Path) -> int:
    exercises = for_chapter(chapter)
    changed = make_student_copy(out, exercises)
    print(f"a student copy in {out}: {len(exercises)} exercise(s) to write in "
          f"{', '.join(str(p.relative_to(out)) for p in changed)}")
    for ex in exercises:
        print(f"  {ex.id:<26}{ex.title}")
    print(f"grade it: python -m common.exercises grade --chapter {chapter} --repo {out}   "
          f"(or, from the course's checkout: make grade CHAPTER={chapter} REPO={out})")
    return 0


def main(args) -> int:
    if args.command == "list":
        return list_exercises()
    if args.command == "make":
        return make(args.chapter, args.out)
    if args.command == "grade":
        if args.chapter is None:
            raise ConfigError("grade needs --chapter NN (or --chapter all)")
        exercises, repo = for_chapter(args.chapter), course_copy(args.repo)     # both checked before any run
        verdicts = grade(exercises, repo, quick=args.quick)
        return 0 if all(v.status == "done" for v in verdicts) else 1
    raise ConfigError(f"unknown command {args.command}")
