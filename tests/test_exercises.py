"""Exercise mode (common/exercises): the markers in the code and the catalog agree; `make` gives a copy
that compiles, whose marked bodies raise, and that holds no answer key; `grade` passes the reference, calls
an untouched copy's exercises "not done", sees one solved exercise as "done" (chapter 03, --quick: its unit
tests), and grades planted wrong answers `wrong:` (a cheap few here; `make wrong-answers` plants them all)."""
import ast
import re
import subprocess
import sys
import traceback

import pytest

from common.errors import ConfigError
from common.exercises import answer_keys, catalog, grader, repo_copy, student_copy, wrong_answers
from common.exercises.__main__ import main as exercises_main
from harness import ROOT, assert_same_run, raise_rank_errors


def _python_files():
    """The chapters and common/, but not common/exercises (its docstrings show the markers)."""
    return list(ROOT.glob("[0-9][0-9]_*/*.py")) + [p for p in (ROOT / "common").rglob("*.py")
                                                    if "exercises" not in p.parts]


def test_every_marker_is_in_the_catalog_and_back():
    found = {}
    for path in _python_files():
        for ex_id, first, stop in catalog.regions(path.read_text()):
            assert stop > first, f"{path}: exercise {ex_id} marks no line"
            found.setdefault(ex_id, set()).add(str(path.relative_to(ROOT)))
    assert set(found) == set(catalog.BY_ID), (set(found) ^ set(catalog.BY_ID))
    for ex in catalog.EXERCISES:
        assert found[ex.id] == {ex.file}, (ex.id, found[ex.id])
    assert len(catalog.EXERCISES) >= 10 and all(2 <= len(catalog.for_chapter(c)) <= 4 for c in catalog.CHAPTERS)


def test_every_readme_section_and_test_named_exists_and_each_lab_sets_its_exercises():
    for ex in catalog.EXERCISES:
        lab = (ROOT / ex.readme).with_name("LAB.md").read_text().partition("\n## Write it yourself\n")[2]
        assert f"**`{ex.id}`**" in lab and ex.hint in lab, f"{ex.id}: not set in its LAB.md's 'Write it yourself'"
        headings = {line.lstrip("#").strip() for line in (ROOT / ex.readme).read_text().splitlines()
                    if line.startswith("#")}
        assert ex.section in headings, f"{ex.id}: no heading '{ex.section}' in {ex.readme}"
        for node in ex.node_ids():
            path, name = node.split("::")
            assert re.search(rf"^def {re.escape(name.split('[')[0])}\(", (ROOT / path).read_text(), re.M), node


def test_list_prints_one_line_per_exercise(capsys):
    assert exercises_main(["list"]) == 0
    ids = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line and not line[0].isspace()]
    assert ids == [ex.id for ex in catalog.EXERCISES]


def test_verdicts_read_the_failures():
    """Without running anything: which failure text gives which verdict line."""
    ex, other = catalog.BY_ID["03.receive_order"], catalog.BY_ID["03.one_f_one_b"]
    node = ex.node_ids(quick=True)[0]
    stopped = {node: {"status": "failed", "line": "NotImplementedError: exercise 03.one_f_one_b: …",
                      "text": student_copy.stub(other)}}
    assert grader.verdict(ex, ROOT, stopped, quick=True).line().endswith("waits on 03.one_f_one_b")
    rank_text = ("expected 'ok' on every rank; got:\n--- rank 0: error ---\nTraceback (most recent call last):\n"
                 "  File \"x.py\", line 1\nAssertionError: tp2, rank 0: losses differ by 3.1e-02\n"
                 "--- rank 1: error ---\nRuntimeError: later")
    wrong = {node: {"status": "failed", "line": "AssertionError: expected 'ok' on every rank; got:", "text": rank_text}}
    line = grader.verdict(ex, ROOT, wrong, quick=True).line()
    assert line.endswith("wrong: test_pp_schedules.py::test_executor_message_plan_matches_and_never_deadlocks: "
                         "AssertionError: tp2, rank 0: losses differ by 3.1e-02"), line
    # as pytest writes it ("E   " before each line), and a bare assert: its source line is the message
    bare = "E   AssertionError: expected 'ok' on every rank; got:\nE   --- rank 0: error ---\nE   Traceback (most recent call last):\n" \
           "E     File \"t.py\", line 54, in check\nE       assert torch.equal(x.grad, want)\nE   AssertionError\n"
    assert grader.first_failure({"line": "AssertionError: expected 'ok' on every rank; got:", "text": bare}) == \
        "AssertionError: assert torch.equal(x.grad, want)"
    carets = bare.replace("want)\n", "want)\nE              ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n")   # Python 3.11's markers
    assert grader.first_failure({"line": "AssertionError: expected 'ok' on every rank; got:", "text": carets}) == \
        "AssertionError: assert torch.equal(x.grad, want)"
    # a job that raised on a rank: the later jobs show "not run: … with <its traceback>"; its exception is shown
    skipped = "E   AssertionError: not run: this rank stopped at job 0 (train:main) with\nE   Traceback (most recent " \
              "call last):\nE     File \"d.py\", line 9, in sync\nE   RuntimeError: bucket 0 saw 0 gradients\n"
    assert grader.first_failure({"line": "AssertionError: not run: this rank stopped at job 0 (train:main) with",
                                 "text": skipped}) == "RuntimeError: bucket 0 saw 0 gradients"
    # 02.f_g's own test passes, the layout run it shares with 02.row_parallel fails: the wrong one is blamed
    f_g, row = catalog.BY_ID["02.f_g"], catalog.BY_ID["02.row_parallel"]
    shared = {f_g.units[0]: {"status": "passed", "line": "", "text": ""}, f_g.layout: wrong[node]}
    assert grader.verdict(f_g, ROOT, shared, False, {row.id}).line().endswith("waits on 02.row_parallel")
    assert grader.verdict(f_g, ROOT, shared, False).line().split()[1] == "wrong:"
    # where the failing line tells where to look, one hint follows it
    merge = catalog.BY_ID["06.merge"]
    at_cp1 = {n: {"status": "failed", "line": "AssertionError: cp 1 ring contiguous float32 MHA: relative errors",
                  "text": ""} for n in merge.node_ids()}
    assert grader.verdict(merge, ROOT, at_cp1, False).line().endswith(
        "(hint: fails already at cp 1: the local math, not the ring)")


def test_every_exercise_lists_three_wrong_answers_planted_inside_its_own_lines():
    """Each listed wrong answer is one edit of the reference inside the exercise's marked lines (so a student
    could write it), that still compiles; `wrong --check` grades them all."""
    from common.exercises.wrong_answers_key import WRONG_EDITS
    for ex in catalog.EXERCISES:
        assert len(ex.wrong) >= 3 and [name for name, _ in ex.wrong] == list(WRONG_EDITS[ex.id]), ex.id
        text = (ROOT / ex.file).read_text()
        lines = text.splitlines(keepends=True)
        body = "".join("".join(lines[first:stop]) for ex_id, first, stop in catalog.regions(text) if ex_id == ex.id)
        for name, _ in ex.wrong:
            old, new = WRONG_EDITS[ex.id][name]
            assert old in body and old != new, f"{ex.id}.{name}: its edit is not inside the exercise's lines"
            compile(wrong_answers.planted_text(ex, name, text), ex.file, "exec")


def _run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    """A student copy of every chapter (make --chapter all)."""
    out = tmp_path_factory.mktemp("student") / "course"
    assert exercises_main(["make", "--chapter", "all", "--out", str(out)]) == 0
    return out


def test_make_gives_a_copy_that_compiles_and_raises(student):
    for ex in catalog.EXERCISES:
        text = (student / ex.file).read_text()
        ast.parse(text)
        assert student_copy.unsolved(student, ex) and not student_copy.unsolved(ROOT, ex), ex.id
    # the copy imports, and a marked body raises, naming its exercise and where to read
    proc = _run("-c", "from importlib import import_module\n"
                      "s = import_module('03_pipeline_parallel.pipeline_schedules')\n"
                      "import_module('06_context_parallel.ring_attention')\n"
                      "s.one_f_one_b(2, 4)", cwd=student)
    assert proc.returncode == 1 and ("NotImplementedError: exercise 03.one_f_one_b: " in proc.stderr), proc.stderr
    assert "read 03_pipeline_parallel/README.md, section 'The bubble, step by step" in proc.stderr, proc.stderr


def test_grade_reference_fresh_copy_and_one_solved(student, tmp_path):
    n = len(catalog.for_chapter("03"))
    ref = _run("-m", "common.exercises", "grade", "--chapter", "03", "--quick")
    assert ref.returncode == 0 and f"{n} of {n} done" in ref.stdout, ref.stdout + ref.stderr

    fresh = _run("-m", "common.exercises", "grade", "--chapter", "03", "--quick", "--repo", str(student))
    assert fresh.returncode == 1, fresh.stdout + fresh.stderr
    assert re.search(r"^03\.one_f_one_b +not done$", fresh.stdout, re.M), fresh.stdout
    assert re.search(r"^03\.receive_order +not done$", fresh.stdout, re.M), fresh.stdout
    assert f"0 of {n} done" in fresh.stdout

    student_copy.restore(student, catalog.BY_ID["03.one_f_one_b"])      # the student writes one of the two
    one = _run("-m", "common.exercises", "grade", "--chapter", "03", "--quick", "--repo", str(student))
    assert one.returncode == 1, one.stdout + one.stderr
    assert re.search(r"^03\.one_f_one_b +done$", one.stdout, re.M), one.stdout
    assert re.search(r"^03\.receive_order +not done$", one.stdout, re.M), one.stdout
    assert f"1 of {n} done" in one.stdout


def test_the_copy_holds_no_answer(student):
    """No LAB_ANSWERS.md, no lab_answers.py, no museum key or wrong answers' key: only the public catalog."""
    assert answer_keys.answers_in(student) == []
    assert not list(student.glob("0*/LAB_ANSWERS.md")) and list(student.glob("0*/LAB.md"))


# A cheap few of the listed wrong answers (unit tests in one process); `make wrong-answers` plants them all.
PLANTED = ("06.merge.no_max", "03.one_f_one_b.warmup_off_by_one")


def test_planted_wrong_answers_are_graded_wrong(tmp_path):
    """In a copy of the reference (every other exercise right), each wrong answer written in its file."""
    copy = repo_copy.copy_repo(tmp_path / "course")
    chosen = [wrong_answers.ALL[wid][:2] for wid in PLANTED]
    for ex, name in chosen:
        (copy / ex.file).write_text(wrong_answers.planted_text(ex, name, (ROOT / ex.file).read_text()))
    verdicts = grader.grade([ex for ex, _ in chosen], copy, quick=True, log=lambda *a, **k: None)
    for wid, v in zip(PLANTED, verdicts):
        assert v.status == "wrong", f"{wid}: {v.line()}"
    assert "not finite" in verdicts[0].detail, verdicts[0].detail      # the merge test says why


def _as_pytest_shows(err: AssertionError) -> dict:
    """A failed test's record as the grader's plugin keeps it: the first line, and pytest's "E   " lines."""
    text = "\n".join(f"E   {line}" for line in f"AssertionError: {err}".splitlines())
    return {"status": "failed", "line": text.splitlines()[0][4:], "text": text}


def _rank_failure(raised: BaseException) -> dict:
    """The record of a layout test whose rank raised `raised` (its traceback as the harness reports it)."""
    try:
        raise raised
    except BaseException:
        tb = traceback.format_exc()
    with pytest.raises(AssertionError) as err:
        raise_rank_errors([("error", tb), ("ok", None)], expected="ok")
    return _as_pytest_shows(err.value)


def test_the_failure_line_is_the_exception_raised_with_its_message():
    """A chained traceback (a KeyError caught and turned into the course's ConfigError) ends with the exception
    that was raised: that one, with its message, is the line, not the first one printed."""
    ex = catalog.BY_ID["03.receive_order"]
    node = ex.node_ids(quick=True)[0]
    said = "unknown schedule 'zb'; choose one of gpipe, 1f1b"
    for chain in ("context", "cause"):
        try:
            try:
                {}["zb"]
            except KeyError as key:
                if chain == "cause":
                    raise ConfigError(said) from key
                raise ConfigError(said)
        except ConfigError as err:
            record = _rank_failure(err)
        line = grader.verdict(ex, ROOT, {node: record}, quick=True).line()
        assert line.endswith(f"ConfigError: {said}"), (chain, line)


def _same_run_failure(loss_off: bool, norm_off: bool) -> dict:
    """The record of a layout test whose run differs from one device's in its losses and/or gradient norms, as
    the harness's comparison (assert_same_run) words it."""
    reference = [{"step": s, "loss": 2.0, "grad_norm": 1.0} for s in (1, 2)]
    run = [{"step": r["step"], "loss": r["loss"] * (1 + 1e-3 * loss_off), "grad_norm": r["grad_norm"] * (1 + 1e-3 * norm_off)}
           for r in reference]
    with pytest.raises(AssertionError) as err:
        assert_same_run([("ok", run)], reference, "tp2")
    return _as_pytest_shows(err.value)


def test_the_hint_sends_the_student_to_the_half_that_failed():
    """Losses equal and gradient norms not: the forward is right, look at the backward. Losses off (whatever
    the norms): no word that the forward is right."""
    ex = catalog.BY_ID["02.f_g"]
    backward = "forward is right; look at backward"
    for loss_off, norm_off in ((False, True), (True, False), (True, True)):
        record = _same_run_failure(loss_off, norm_off)
        line = grader.verdict(ex, ROOT, {n: record for n in ex.node_ids()}, quick=False).line()
        assert "wrong:" in line and "losses differ" in line, line
        assert (backward in line) == (not loss_off), (loss_off, norm_off, line)


def test_a_body_that_calls_the_course_s_own_answer_is_wrong(tmp_path):
    """03.zbv's tests compare with PyTorch's order (torch_order.py): a body that returns it is borrowed."""
    ex = catalog.BY_ID["03.zbv"]
    text = (ROOT / ex.file).read_text()
    (tmp_path / ex.file).parent.mkdir(parents=True)
    (tmp_path / ex.file).write_text(wrong_answers.planted_text(ex, "torch_reference", text))
    passed = {node: {"status": "passed", "line": "", "text": ""} for node in ex.node_ids()}
    line = grader.verdict(ex, tmp_path, passed, quick=False).line()
    assert line.endswith("wrong: its body calls torch_order, the course's own answer that its tests compare with; "
                         "write it yourself"), line
    assert grader.verdict(ex, ROOT, passed, quick=False).status == "done"      # the reference body: its own


def test_a_later_exercise_waits_on_an_earlier_one_whose_own_tests_fail():
    """07.refusal written wrong makes the planner's rows wrong: the correct 07.ranking waits on it."""
    refusal, ranking = catalog.BY_ID["07.refusal"], catalog.BY_ID["07.ranking"]
    failed = {node: {"status": "failed", "line": "common.errors.ConfigError: --seq-len 4096 exceeds …", "text": ""}
              for node in ranking.node_ids()}
    assert grader.verdict(ranking, ROOT, failed, False, {refusal.id}).line().endswith("waits on 07.refusal")
    assert grader.verdict(ranking, ROOT, failed, False).status == "wrong"
    assert grader.verdict(refusal, ROOT, failed | {n: failed[ranking.units[0]] for n in refusal.node_ids()},
                          False, {ranking.id}).status == "wrong"              # a later one is never waited on
    merge, one_f_one_b = catalog.BY_ID["06.merge"], catalog.BY_ID["03.one_f_one_b"]
    assert grader.verdict(merge, ROOT, {n: failed[ranking.units[0]] for n in merge.node_ids()}, False,
                          {one_f_one_b.id}).status == "wrong"                 # another chapter's answer: its own
