"""common/compare_metrics.py: per-step relative differences, the first step above the tolerance,
and the exit status a lab relies on (0 equal, 1 different, 2 unusable input)."""
import json

from common.compare_metrics import compare, main, relative_difference, summary


def write(path, losses, first_step=1, **extra):
    path.write_text("".join(json.dumps({"step": first_step + i, "loss": x, **extra}) + "\n"
                            for i, x in enumerate(losses)))
    return path


def test_relative_difference_and_summary():
    assert abs(relative_difference(2.0 * (1 + 3e-6), 2.0) - 3e-6) < 1e-12
    assert relative_difference(0.5, 0.0) == 0.5                          # nothing to scale by: absolute
    assert relative_difference(float("nan"), 1.0) == float("inf")
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
