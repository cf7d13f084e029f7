"""The exercise tool's command line refuses bad input before any work (one `error:` line naming the flag,
exit status 2, nothing of the user's touched), ends quietly when its reader goes away, and its grader
calls "done" only a test that passed: a skipped test and a module that does not import never read "done".
All fast: no refusal here copies the course or starts a test run."""
import shutil
import subprocess
import sys
from pathlib import Path

from common.exercises import catalog, copy_suite, grader, run_tests
from harness import ROOT

CHEAPEST_BUG = "06.bug1"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "common.exercises", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def _refused(proc, *words):
    """Exit status 2 and exactly one line, `error: ...`, holding every one of `words`; no traceback."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, (proc.returncode, out)
    assert "Traceback" not in out and proc.stdout == "", out
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    assert all(w in lines[0] for w in words), (words, lines[0])
    return lines[0]


def _snapshot(path: Path) -> dict:
    """Every file under `path` (or `path` itself), with its bytes."""
    if path.is_file():
        return {".": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


def test_out_that_names_a_file_or_a_full_directory_is_refused_and_left_untouched(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_bytes(b"my notes\n")
    full = tmp_path / "mine"
    (full / "sub").mkdir(parents=True)
    (full / "a.py").write_bytes(b"print('mine')\n")
    (full / "sub" / "b.bin").write_bytes(bytes(range(256)))
    before = {p: _snapshot(p) for p in (file, full)}
    cases = [(["make", "--chapter", "02", "--out", str(file)], (f"--out {file}", "file")),
             (["make", "--chapter", "02", "--out", str(file / "copy")], (f"--out {file / 'copy'}", "not a directory")),
             (["make", "--chapter", "02", "--out", str(full)], (f"--out {full}", "not empty")),
             (["bug", CHEAPEST_BUG, "--out", str(file)], (f"--out {file}", "file")),
             (["bug", CHEAPEST_BUG, "--out", str(full)], (f"--out {full}", "not empty"))]
    for argv, words in cases:
        _refused(_cli(*argv), *words)
        assert {p: _snapshot(p) for p in (file, full)} == before, argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "notes.txt"]


def test_out_inside_the_course_checkout_is_refused():
    names = ["copy_made_by_test_exercises_cli", "common/copy_made_by_test_exercises_cli"]
    assert not any((ROOT / n).exists() for n in names)
    try:
        for argv in (["make", "--chapter", "02", "--out", "./" + names[0]], ["make", "--chapter", "02", "--out", names[1]],
                     ["bug", CHEAPEST_BUG, "--out", names[0]], ["make", "--chapter", "02", "--out", "."]):
            _refused(_cli(*argv), "--out", "inside the course's checkout", "outside it")
            assert not any((ROOT / n).exists() for n in names), argv
    finally:                            # only what this test named, should a broken check have made it
        for n in names:
            if (ROOT / n).is_dir():
                shutil.rmtree(ROOT / n)


def test_grade_refuses_a_repo_that_is_not_a_course_copy_and_unknown_names(tmp_path):
    missing, empty, file = tmp_path / "missing", tmp_path / "empty", tmp_path / "f.txt"
    empty.mkdir()
    file.write_text("x")
    for repo, why in [(missing, "no such directory"), (empty, "no common/exercises in it"), (file, "it is a file")]:
        for argv in (["grade", "--bug", CHEAPEST_BUG, "--repo", str(repo)], ["grade", "--chapter", "02", "--repo", str(repo)]):
            _refused(_cli(*argv), f"--repo {repo}: not a copy of the course ({why}")
    assert not missing.exists() and list(empty.iterdir()) == [] and file.read_text() == "x"
    _refused(_cli("grade", "--bug", "no.such_bug", "--repo", str(empty)), "no bug 'no.such_bug'", "bug list")
    _refused(_cli("grade", "--chapter", "99"), "--chapter 99", "01", "all")
    _refused(_cli("make", "--chapter", "99", "--out", str(tmp_path / "new")), "--chapter 99")
    _refused(_cli("copies", "--chapter", "99"), "--chapter 99", "01", "all")
    _refused(_cli("grade", "--bug", CHEAPEST_BUG, "--chapter", "02"), "--bug", "--chapter")
    assert not (tmp_path / "new").exists()


def test_output_into_a_closed_pipe_ends_quietly():
    """`bug list | head -1`: the reader is gone before the writer is done."""
    for argv in (["bug", "list"], ["list"]):
        proc = subprocess.Popen([sys.executable, "-m", "common.exercises", *argv], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.close()                       # the reader goes away before a line is written
        err = proc.stderr.read().decode()
        proc.wait(timeout=60)
        assert err == "" and proc.returncode != 0, (argv, proc.returncode, err)


def _exercise(units) -> catalog.Exercise:
    """An exercise whose file exists and holds no stub, graded by `units`."""
    return catalog.Exercise("02.f_g", "mod.py", "title", "section", "hint", units=tuple(units), layout=units[0])


def test_only_a_passed_test_is_done():
    """The verdict read from each kind of record, without running anything."""
    ex = _exercise(["tests/test_a.py::test_x"])
    node = ex.units[0]
    passed = {"status": "passed", "line": "", "text": ""}
    skip = {"status": "skipped", "line": "needs 4 GPUs", "text": ""}
    imp = {"status": "failed", "phase": "collect", "line": "E   SyntaxError: invalid syntax", "text": "…"}
    assert grader.verdict(ex, ROOT, {node: passed}, quick=True).line().split()[1:] == ["done"]
    assert grader.verdict(ex, ROOT, {node: skip}, quick=True).line().endswith("skipped: test_a.py::test_x: needs 4 GPUs")
    assert grader.verdict(ex, ROOT, {node: imp}, quick=True).line().endswith(
        "wrong: test_a.py::test_x does not import: SyntaxError: invalid syntax")
    # a node's parameters: one skip or one unfinished test and it is not a pass
    assert run_tests.outcome([passed, skip])["status"] == "skipped"
    assert run_tests.outcome([passed, {"status": "incomplete", "line": "", "text": ""}])["status"] == "failed"
    assert run_tests.outcome([passed, passed])["status"] == "passed"


def test_a_copy_s_failure_is_an_open_exercise_s_only_where_its_stub_shows():
    """`make copies`' verdict on each record: a failure whose text holds an open exercise's stub is that
    exercise's; any other failure (a missing file, an exercise of another chapter) is the copy's own."""
    mine, other = catalog.for_chapter("06")[0], catalog.for_chapter("02")[0]
    failed = lambda text: {"status": "failed", "line": "E   AssertionError", "text": text}   # noqa: E731
    records = {"a": {"status": "passed", "line": "", "text": ""}, "b": {"status": "skipped", "line": "x", "text": ""},
               "c": failed(f"NotImplementedError: exercise {mine.id}: …"), "d": failed("FileNotFoundError: latest"),
               "e": failed(f"NotImplementedError: exercise {other.id}: …")}
    assert copy_suite.classify(records, [mine]) == {"passed": ["a"], "skipped": ["b"], "open exercise": ["c"],
                                                    "other": ["d", "e"]}


def test_run_tests_records_skips_and_import_errors_as_no_pass(tmp_path):
    """A real pytest run through the grader's plugin, in a throwaway tree that has only the plugin."""
    (tmp_path / "common" / "exercises").mkdir(parents=True)
    for init in ("common/__init__.py", "common/exercises/__init__.py"):
        (tmp_path / init).write_text("")
    shutil.copy(ROOT / "common" / "exercises" / "outcome_plugin.py", tmp_path / "common" / "exercises")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "mod.py").write_text("def f(:\n    pass\n")              # the student's file: a syntax error
    (tmp_path / "test_imports_mod.py").write_text("import mod\n\ndef test_x():\n    pass\n")
    (tmp_path / "test_other.py").write_text(
        "import pytest\n\ndef test_ok():\n    pass\n\ndef test_skip():\n    pytest.skip('needs 4 GPUs')\n\n"
        "@pytest.mark.parametrize('n', [1, 2])\ndef test_half(n):\n    if n == 2:\n        pytest.skip('two')\n\n"
        "def test_not_asked():\n    raise AssertionError('deselected: never runs')\n")
    nodes = ["test_imports_mod.py::test_x", "test_other.py::test_ok", "test_other.py::test_skip",
             "test_other.py::test_half", "test_other.py::test_renamed"]
    got = run_tests.run_tests(tmp_path, nodes, timeout_s=120)
    assert got["test_imports_mod.py::test_x"]["status"] == "failed", got
    assert got["test_imports_mod.py::test_x"].get("phase") == "collect", got
    assert "SyntaxError" in got["test_imports_mod.py::test_x"]["line"], got
    assert got["test_other.py::test_ok"]["status"] == "passed", got       # the other module still ran
    assert got["test_other.py::test_skip"] == {"status": "skipped", "line": "needs 4 GPUs", "text": ""}, got
    assert got["test_other.py::test_half"]["status"] == "skipped", got
    assert got["test_other.py::test_renamed"]["status"] == "failed", got
    lines = {n: grader.verdict(_exercise([n]), tmp_path, got, quick=True).line() for n in nodes}
    assert [n for n, line in lines.items() if line.split()[1] == "done"] == ["test_other.py::test_ok"], lines
    assert "wrong: test_imports_mod.py::test_x does not import: SyntaxError" in lines[nodes[0]], lines
    assert lines["test_other.py::test_skip"].endswith("skipped: test_other.py::test_skip: needs 4 GPUs"), lines
