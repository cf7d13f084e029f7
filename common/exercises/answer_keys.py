"""What a copy of the course handed to a student leaves out: every answer key of the instructor's checkout.

    0N_*/LAB_ANSWERS.md, 0N_*/lab_answers*.py   each lab's answers, and the scripts that write them
    common/exercises/MUSEUM.md                  the museum's table (each bug's class and first failure)
    common/exercises/museum_catalog*.py         each bug's cause, file, original and planted lines, and key
    common/exercises/wrong_answers_key.py       the wrong answers the grader is checked against (one line
                                                away from the right answer, so as good as the answer)
    common/exercises/WRONG_ANSWERS.md           their table (each one's verdict)

`make` and `bug ID --out` copy the course without them (repo_copy.copy_repo), and write, in the museum
catalog's place, one holding each bug's public fields only: its id, the symptom a user reported, the
commands that show it, and the tests that grade the fix. The instructor's checkout keeps everything."""
from fnmatch import fnmatch
from pathlib import Path

from .museum_catalog import EXHIBITS

KEY_FILES = ("0*/LAB_ANSWERS.md", "0*/lab_answers*.py", "common/exercises/MUSEUM.md",
             "common/exercises/museum_catalog*.py", "common/exercises/wrong_answers_key.py",
             "common/exercises/WRONG_ANSWERS.md")
PUBLIC_CATALOG = "common/exercises/museum_catalog.py"


def is_key(rel: Path) -> bool:
    """True for a file (its path from the repository root) that a student's copy must not hold."""
    return any(fnmatch(Path(rel).as_posix(), pattern) for pattern in KEY_FILES)


def public_catalog() -> str:
    """The museum catalog of a student's copy: every exhibit's id, symptom, commands and catching tests."""
    rows = "".join(f"    Exhibit({e.id!r},\n            {e.title!r},\n            catch={e.catch!r},\n"
                   f"            see={e.see!r}),\n" for e in EXHIBITS)
    return ('"""The museum of real bugs, as this copy of the course holds it: each bug\'s symptom, the commands\n'
            'that show it, and the tests that grade your fix. Its cause, place and fix stay with the instructor."""\n'
            "from .museum_exhibit import Exhibit\n\n"
            f"EXHIBITS = (\n{rows})\n\nBY_ID = {{e.id: e for e in EXHIBITS}}\n")


def write_public_files(out: Path) -> None:
    """In a copy just made without the keys, the public museum catalog in place of the instructor's (in a copy
    of a course that has the exercise tooling: a test's miniature repository may not)."""
    if (Path(out) / PUBLIC_CATALOG).parent.is_dir():
        (Path(out) / PUBLIC_CATALOG).write_text(public_catalog())


def answers_in(copy: Path) -> list[str]:
    """What in `copy` gives an answer away, one line each ([] for a copy fit to hand out): a key file, a museum
    catalog other than the public one, a text holding a bug's class or the start of its key."""
    copy = Path(copy)
    files = [p.relative_to(copy) for p in copy.rglob("*") if p.is_file()]
    found = [f"{rel}: an answer key" for rel in files if is_key(rel) and rel.as_posix() != PUBLIC_CATALOG]
    if (copy / PUBLIC_CATALOG).read_text() != public_catalog():
        found.append(f"{PUBLIC_CATALOG}: not the public catalog")
    secrets = [(f"bug {e.id}'s {what}", text) for e in EXHIBITS for what, text in
               (("class", e.bug_class), ("key", e.key[:80]))]
    for rel in (r for r in files if r.suffix in (".py", ".md")):
        text = (copy / rel).read_text(errors="replace")
        found += [f"{rel}: {what}" for what, secret in secrets if secret in text]
    return found
