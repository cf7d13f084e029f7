"""The museum of real bugs (common/exercises/museum.py): every exhibit still fits the code it breaks,
planting changes exactly that code and leaves Python that compiles, its catching tests exist, the
command line refuses what it cannot do with one line, and one bug is planted and caught end to end, in a
copy that holds no answer. (`python -m common.exercises bug --check` runs every exhibit's tests; MUSEUM.md
holds its table.) In a student's copy the museum has no key: the tests that need it are skipped there."""
import re
import subprocess
import sys

import pytest

from common.exercises import answer_keys, museum
from common.exercises.__main__ import main as cli
from common.exercises.museum_catalog import EXHIBITS
from harness import ROOT

CHEAPEST = "06.bug1"          # caught by one 4-rank group of attention checks
pytestmark = pytest.mark.skipif(not all(e.has_key for e in EXHIBITS),
                                reason="a student's copy of the course: the museum's key stays with the instructor")


def test_every_chapter_has_an_exhibit_and_ids_are_unique():
    assert sorted({e.chapter for e in EXHIBITS}) == ["01", "02", "03", "04", "05", "06"]
    assert len({e.id for e in EXHIBITS}) == len(EXHIBITS)
    # an id names no cause: the chapter, then a number ("you get the symptom, never the cause")
    assert all(re.fullmatch(r"\d\d\.bug\d+", e.id) for e in EXHIBITS), [e.id for e in EXHIBITS]
    assert all(e.id.startswith(e.chapter + ".") and e.catch and e.see and e.key for e in EXHIBITS)


@pytest.mark.parametrize("ex", EXHIBITS, ids=[e.id for e in EXHIBITS])
def test_planting_changes_exactly_the_snippet_and_compiles(ex, tmp_path):
    original = (ROOT / ex.file).read_text()
    assert original.count(ex.old) == 1, f"{ex.id}: the snippet must occur once in {ex.file}"
    (tmp_path / ex.file).parent.mkdir(parents=True)
    (tmp_path / ex.file).write_text(original)
    museum.plant(ex, tmp_path)
    planted = (tmp_path / ex.file).read_text()
    start = original.index(ex.old)
    assert planted[:start] == original[:start] and planted[start + len(ex.new):] == original[start + len(ex.old):]
    assert planted != original
    compile(planted, ex.file, "exec")


def test_a_stale_exhibit_says_so(tmp_path):
    ex = museum.exhibit(CHEAPEST)
    (tmp_path / ex.file).parent.mkdir(parents=True)
    (tmp_path / ex.file).write_text("nothing of the kind")
    with pytest.raises(museum.ConfigError, match="exhibit 06.bug1 is stale: its snippet occurs 0 times"):
        museum.plant(ex, tmp_path)


def test_catching_tests_exist():
    nodes = sorted({n for e in EXHIBITS for n in e.catch})
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *nodes], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = proc.stdout
    for node in nodes:
        assert node in collected, f"{node} collects no test"


def test_list_and_refusals(capsys, tmp_path):
    assert cli(["bug", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(EXHIBITS) and all(line.startswith(e.id) for line, e in zip(out, EXHIBITS))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    for argv, message in [(["bug", "no.such_bug", "--out", str(tmp_path / "a")], "no bug 'no.such_bug' in the museum"),
                          (["grade", "--bug", "no.such_bug"], "no bug 'no.such_bug' in the museum"),
                          (["bug", CHEAPEST], "name the copy to create with --out DIR"),
                          (["bug", CHEAPEST, "--out", str(tmp_path / "full")], "exists and is not empty")]:
        assert cli(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)


def test_a_planted_bug_is_caught_end_to_end(capsys, tmp_path):
    out = tmp_path / "copy"
    assert cli(["bug", CHEAPEST, "--out", str(out)]) == 0
    shown = capsys.readouterr().out
    ex = museum.exhibit(CHEAPEST)
    assert f"grade --bug {CHEAPEST} --repo {out}" in shown and ex.bug_class not in shown   # the symptom, not the cause
    assert answer_keys.answers_in(out) == []        # no lab key, no museum key: the copy can be handed out
    assert ex.title in (out / answer_keys.PUBLIC_CATALOG).read_text()
    inside = subprocess.run([sys.executable, "-m", "common.exercises", "bug", CHEAPEST, "--out", str(tmp_path / "again")],
                            cwd=out, capture_output=True, text=True, timeout=120)    # the copy cannot plant bugs
    assert inside.returncode == 2 and "holds each bug's symptom, not the bug itself" in inside.stderr, inside.stderr
    assert cli(["grade", "--bug", CHEAPEST, "--repo", str(out)]) == 1
    verdict = capsys.readouterr().out.strip()
    assert verdict.startswith(f"{CHEAPEST}: still broken: tests/test_ring_attention.py::"), verdict


@pytest.mark.parametrize("chapter", ["01", "02", "03", "04", "05", "06"])
def test_each_lab_sets_a_bug_and_its_key_explains_it(chapter):
    folder = next(ROOT.glob(f"{chapter}_*"))
    lab, answers = (folder / "LAB.md").read_text(), (folder / "LAB_ANSWERS.md").read_text()
    assert "Find the bug" in lab and any(f"bug {e.id} --out" in lab for e in EXHIBITS if e.chapter == chapter)
    title, text = museum.key_section(chapter)
    assert f"## {title}\n\n{text.strip()}\n" in answers, f"{folder.name}/LAB_ANSWERS.md lacks the museum's key"
