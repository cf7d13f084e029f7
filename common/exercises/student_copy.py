"""`make`: a student copy of the course in which each chosen exercise's marked lines are one raise.

    # >>> exercise 02.f_g
    raise NotImplementedError("exercise 02.f_g: f (identity forward, …) — read 02_tensor_parallel/README.md, section '2. f and g: …'")
    # <<< exercise 02.f_g

The markers stay, so the student sees where to write; the signature and docstring stay, so the copy
imports and compiles. The grader reads "not done" from that same raise (see `stub`)."""
from pathlib import Path

from .catalog import Exercise, regions
from .repo_copy import ROOT, copy_repo


def stub_prefix(ex: Exercise) -> str:
    """What every stub of `ex` starts with: the grader looks for it in the code and in a test's failure."""
    return f"exercise {ex.id}:"


def stub(ex: Exercise) -> str:
    message = f"{stub_prefix(ex)} {ex.title} — read {ex.readme}, section '{ex.section}'"
    return f"raise NotImplementedError({message!r})"


def strip_exercises(text: str, chosen: dict[str, Exercise]) -> str:
    """`text` with the body of every marked region of a chosen exercise replaced by its stub, indented
    like the marker."""
    lines = text.splitlines(keepends=True)
    for ex_id, first, stop in reversed(regions(text)):        # from the end: earlier indices stay valid
        if ex_id in chosen:
            indent = lines[first - 1][:len(lines[first - 1]) - len(lines[first - 1].lstrip())]
            lines[first:stop] = [f"{indent}{stub(chosen[ex_id])}\n"]
    return "".join(lines)


def make_student_copy(out: Path, exercises: list[Exercise], src: Path | None = None) -> list[Path]:
    """Copy the repository to `out` and remove the bodies of `exercises`; returns the files changed."""
    copy_repo(out, **({"src": src} if src else {}))
    chosen = {e.id: e for e in exercises}
    changed = []
    for rel in sorted({e.file for e in exercises}):
        path = Path(out) / rel
        path.write_text(strip_exercises(path.read_text(), chosen))
        changed.append(path)
    return changed


def unsolved(repo: Path, ex: Exercise) -> bool:
    """True while `ex`'s stub is still in its file in `repo` (the student has not written it yet)."""
    path = Path(repo) / ex.file
    return path.exists() and any("NotImplementedError(" in line and stub_prefix(ex) in line
                                 for line in path.read_text().splitlines())


def restore(repo: Path, ex: Exercise, src: Path | None = None) -> None:
    """Put the reference body of `ex` (from `src`, this repository by default) back into `repo`: the
    instructor's solution, and how the tests solve one exercise of a student copy."""
    ref_text = (Path(src or ROOT) / ex.file).read_text()
    ref_lines = ref_text.splitlines(keepends=True)
    bodies = [ref_lines[first:stop] for ex_id, first, stop in regions(ref_text) if ex_id == ex.id]
    path = Path(repo) / ex.file
    lines = path.read_text().splitlines(keepends=True)
    mine = [(first, stop) for ex_id, first, stop in regions("".join(lines)) if ex_id == ex.id]
    if len(mine) != len(bodies):
        raise ValueError(f"{path}: {len(mine)} region(s) of exercise {ex.id}, the reference has {len(bodies)}")
    for (first, stop), body in reversed(list(zip(mine, bodies))):
        lines[first:stop] = body
    path.write_text("".join(lines))
