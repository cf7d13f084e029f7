"""common/lab_key.py, the answer keys' ground: it runs only what a LAB.md prints, applies only the
edits a LAB.md prints (to a copy, and only if the code still has the text), and reads a failure the
way a student sees it. A fake chapter in a temporary repository, no training."""
import pytest

from common import lab_key

LAB = """# Lab 99
Run `echo hello  world` and then
    python -c "print('error: bad flag; use --good')"; exit 2
In `99_fake/code.py`, replace `x = 1` by `x = 2`.
"""


@pytest.fixture
def key(tmp_path, monkeypatch):
    (tmp_path / "99_fake").mkdir()
    (tmp_path / "99_fake" / "LAB.md").write_text(LAB)
    (tmp_path / "99_fake" / "code.py").write_text("x = 1\n")
    monkeypatch.setattr(lab_key, "ROOT", tmp_path)
    return lab_key.Key("99_fake", "Lab 99")


def test_runs_only_printed_commands(key):
    assert key.run("echo hello world").out.strip() == "hello world"      # whitespace aside
    with pytest.raises(AssertionError, match="does not print"):
        key.run("echo something else")


def test_failures_table_reads_the_error_line(key):
    text = key.failures(["""python -c "print('error: bad flag; use --good')"; exit 2"""], "python")
    assert "| 2 | - | error: bad flag; use --good |" in text


def test_edits_apply_to_a_copy_only_if_printed_and_present(key, tmp_path):
    with key.broken(lab_key.Edit("99_fake/code.py", "x = 1", "x = 2")) as root:
        assert (root / "99_fake" / "code.py").read_text() == "x = 2\n"
    assert (tmp_path / "99_fake" / "code.py").read_text() == "x = 1\n"      # the repository is untouched
    with pytest.raises(AssertionError, match="does not print the edit"):
        with key.broken(lab_key.Edit("99_fake/code.py", "x = 1", "x = 3")):
            pass
    (tmp_path / "99_fake" / "code.py").write_text("y = 1\n")                 # the code moved on
    with pytest.raises(AssertionError, match="occurs 0 times"):
        with key.broken(lab_key.Edit("99_fake/code.py", "x = 1", "x = 2")):
            pass


def test_names_and_write(key, tmp_path):
    key.names("99_fake/code.py", "x = ")
    with pytest.raises(AssertionError, match="no longer has"):
        key.names("99_fake/code.py", "def gone")
    key.section("1. First", "answer")
    text = key.write().read_text()
    assert text.startswith("# Lab 99 — answer key") and "## 1. First\n\nanswer" in text


def _edits_in(key_script):
    """Every Edit(file, old, new) in a chapter's lab_answers.py, its arguments evaluated with the module's
    own constants (the chapter's folder is `CH`) and nothing run."""
    import ast
    names = {"CH": key_script.parent.name}
    for node in ast.walk(ast.parse(key_script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Edit":
            yield lab_key.Edit(*(eval(compile(ast.Expression(arg), str(key_script), "eval"), names)
                                 for arg in node.args))


@pytest.mark.parametrize("chapter", sorted(p.parent.name for p in lab_key.ROOT.glob("0*/lab_answers.py")))
def test_every_lab_edit_still_finds_its_code(chapter):
    """The real keys, without running them: each "break it" edit is printed in its LAB.md and its text is
    still in the code exactly once (else `make lab-answers` stops at it, and the lab names a line the
    student cannot find)."""
    root = lab_key.ROOT
    lab = lab_key.squeeze((root / chapter / "LAB.md").read_text())
    edits = list(_edits_in(root / chapter / "lab_answers.py"))
    assert edits, f"{chapter}/lab_answers.py has no edit"
    for e in edits:
        assert lab_key.squeeze(e.old) in lab and lab_key.squeeze(e.new) in lab, f"{chapter}/LAB.md does not print {e}"
        count = (root / e.file).read_text().count(e.old)
        assert count == 1, f"{e.file}: the text of {chapter}'s edit occurs {count} times: {e.old!r}"
