"""common/compare_metrics.py: per-step relative differences, the first step above the tolerance,
and the exit status a lab relies on (0 equal, 1 different, 2 unusable input)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.compare_metrics import compare, main, relative_difference, summary


def write(path, losses, first_step=1, **extra):
    path.write_text("".join(json.dumps({"step": first_step + i, "loss": x, **extra}) + "\n"
                            for i, x in enumerate(losses)))
    return path


def test_relative_difference_and_summary():
    assert abs(relative_difference(2.0 * (1 + 3e-6), 2.0) - 3e-6) < 1e-12
    assert relative_difference(0.5, 0.0) == 0.5                          # nothing to scale by: absolute
    assert relative_difference(float("nan"), 1.0) == float("inf")
    assert relative_difference(float("nan"), float("nan")) == float("inf")   # a NaN equals nothing
    s = summary({1: 1e-7, 2: 2e-5, 3: 4e-5, 4: 1e-6}, tol=1e-5)
    assert (s["max"], s["max_step"], s["first_above_tol"], s["steps"]) == (4e-5, 3, 2, 4)


def test_equal_within_tolerance_exits_0(tmp_path, capsys):
    a = write(tmp_path / "a.jsonl", [5.5, 4.0, 3.0])
    b = write(tmp_path / "b.jsonl", [5.5, 4.0 * (1 + 2e-7), 3.0 * (1 - 4e-7)])
    assert main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "max 4.00e-07 at step 3 over 3 steps" in out and "first step above 1e-05: none" in out


def test_divergence_names_its_first_step_and_exits_1(tmp_path, capsys):
    a = write(tmp_path / "a.jsonl", [5.5, 4.0, 3.0, 2.5])
    same = write(tmp_path / "same.jsonl", [5.5, 4.0, 3.0, 2.5])
    bad = write(tmp_path / "bad.jsonl", [5.5, 4.0, 3.3, 2.5])
    assert main([str(a), str(same), str(bad), "--tol", "1e-6"]) == 1
    out = capsys.readouterr().out
    assert "same.jsonl: max 0.00e+00" in out
    assert "bad.jsonl: max 1.00e-01 at step 3" in out and "first step above 1e-06: step 3" in out


def test_steps_are_matched_by_number_and_any_key_works(tmp_path):
    full = write(tmp_path / "full.jsonl", [5.0, 4.0, 3.0, 2.0], grad_norm=1.0)
    resumed = write(tmp_path / "resumed.jsonl", [3.0, 2.0], first_step=3, grad_norm=1.0)
    result = compare([full, resumed])
    assert result["diffs"][str(resumed)] == {3: 0.0, 4: 0.0}
    assert main([str(full), str(resumed), "--key", "grad_norm"]) == 0


def test_unusable_input_exits_2(tmp_path, capsys):
    a = write(tmp_path / "a.jsonl", [5.0, 4.0])
    late = write(tmp_path / "late.jsonl", [1.0], first_step=9)
    assert main([str(a), str(late)]) == 2
    assert main([str(a), str(a), "--key", "bubble"]) == 2
    assert main([str(a), str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "no step in common" in err and "has no `bubble` values; its keys: loss, step" in err


def refused(capsys, *argv) -> str:
    """Run the tool on bad input: exit status 2 and one line on stderr, no traceback, nothing on stdout."""
    assert main([str(a) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize("content, says", [
    (b'{"step": 1, "loss": 5.0}\nnot json\n', "bad.jsonl, line 2: not JSON"),
    (b"\xff\xfe{", "bad.jsonl is not UTF-8 text (invalid byte at offset 0)"),
    (b'{"step": 1}\x00\n', "bad.jsonl holds NUL bytes (the first at byte 11): a binary file, not text"),
    (b'{"step": 1, "loss": 5.0}\n[1, 2]\n', "bad.jsonl, line 2: a JSON array, not an object"),
    (b"\n3\n", "bad.jsonl, line 2: a JSON number, not an object"),
    (b'{"loss": 5.0}\n', "bad.jsonl, line 1: the object has no `step`"),
    (b'{"step": 0, "loss": 5.0}\n', "bad.jsonl, line 1: `step` must be a whole number ≥ 1"),
    (b'{"step": 1.5, "loss": 5.0}\n', "bad.jsonl, line 1: `step` must be a whole number ≥ 1"),
    (b"", "bad.jsonl is empty (no rows); a metrics file holds one JSON object per line"),
    (b"\n  \n", "bad.jsonl is empty (no rows)"),
], ids=["not-json", "not-utf8", "nul-bytes", "array-row", "number-row", "no-step", "step-0", "step-1.5", "empty", "blank"])
def test_a_file_that_is_not_a_metrics_file_is_refused_in_one_line(tmp_path, capsys, content, says):
    good = write(tmp_path / "good.jsonl", [5.0])
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    assert says in refused(capsys, good, bad)
    assert says in refused(capsys, bad, good)          # the reference is checked the same way


def test_a_missing_file_or_a_directory_is_refused_in_one_line(tmp_path, capsys):
    good = write(tmp_path / "good.jsonl", [5.0])
    assert "missing.jsonl does not exist" in refused(capsys, good, tmp_path / "missing.jsonl")
    assert f"{tmp_path} is a directory, not a metrics file" in refused(capsys, good, tmp_path)


@pytest.mark.parametrize("tol", ["nan", "inf", "-1", "abc"])
def test_a_tolerance_that_is_not_a_finite_number_at_least_0_is_refused(tmp_path, capsys, tol):
    a = write(tmp_path / "a.jsonl", [5.0, 4.0])
    b = write(tmp_path / "b.jsonl", [5.0, 9.0])
    assert f"--tol must be a finite number ≥ 0, got {tol}" in refused(capsys, a, b, "--tol", tol)


def test_bad_input_from_the_command_line_is_one_line_and_exit_2(tmp_path):
    """The same through `python -m` (the way a lab runs it): the exit status and the one line."""
    a = write(tmp_path / "a.jsonl", [5.0])
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xff\xfe\x00{")
    for argv in ([a, bad], [a, a, "--tol", "nan"]):
        run = subprocess.run([sys.executable, "-m", "common.compare_metrics", *map(str, argv)], capture_output=True,
                             text=True, cwd=Path(__file__).resolve().parents[1])
        assert run.returncode == 2 and run.stdout == "" and "Traceback" not in run.stderr
        assert len(run.stderr.splitlines()) == 1 and ("bad.jsonl" in run.stderr or "--tol" in run.stderr)


def test_a_nan_in_a_file_counts_as_above_the_tolerance(tmp_path, capsys):
    nan = float("nan")
    ref = write(tmp_path / "ref.jsonl", [5.0, 4.0, 3.0])
    diverged = write(tmp_path / "diverged.jsonl", [5.0, nan, 3.0])
    also = write(tmp_path / "also.jsonl", [5.0, nan, 3.0])
    assert main([str(ref), str(diverged), "--tol", "1"]) == 1        # no tolerance lets a NaN through
    out, err = capsys.readouterr()
    assert err == "" and "first step above 1: step 2" in out
    assert "diverged.jsonl: loss is NaN at step 2 in diverged.jsonl; a NaN equals nothing" in out
    assert main([str(diverged), str(also)]) == 1                    # two NaNs are not equal either
    out = capsys.readouterr().out
    assert "first step above 1e-05: step 2" in out
    assert "also.jsonl: loss is NaN at step 2 in also.jsonl and at step 2 in diverged.jsonl" in out
