"""The course's tools, refused in one line: without their dependencies (`make gpu-check` or `make gpu-efficiency`
before `make setup`: a Python without PyTorch), at a place the system refuses (exercise mode's --out under /proc), and with a
value outside a field's domain (the planner's --explain). Each runs in this process (no training starts)."""
import sys
from importlib import import_module

import pytest

from common.errors import ConfigError
from common.exercises.__main__ import main as exercises_main


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def test_gpu_check_without_pytorch_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)                 # `import torch` fails as it would there
    assert import_module("common.gpu_check").main(["--quick"]) == 1
    out = capsys.readouterr()
    said = one_line(out.out + out.err)
    assert said.startswith("gpu-check: this Python") and "has no PyTorch" in said and "make setup" in said, said


def test_gpu_efficiency_without_pytorch_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)
    assert import_module("07_choosing_a_layout.gpu_efficiency").main([]) == 1
    out = capsys.readouterr()
    said = one_line(out.out + out.err)
    assert said.startswith("gpu-efficiency: this Python") and "has no PyTorch" in said and "make setup" in said, said


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc: a place Linux refuses to create in")
def test_a_copy_where_the_system_refuses_is_one_line_and_exit_2(capsys):
    assert exercises_main(["make", "--chapter", "07", "--out", "/proc/course_copy"]) == 2
    out = capsys.readouterr()
    said = one_line(out.out + out.err)
    assert said == "error: --out /proc/course_copy: cannot create it (No such file or directory); name a directory you can write", said


@pytest.mark.parametrize("field, message", [
    ("zero=5", "--explain zero=5: zero=5 is not one of 0, 1, 2, 3; e.g. zero=1"),
    ("dp=2,recompute=most", "--explain dp=2,recompute=most: recompute=most is not one of none, selective, full"),
    ("tp=0", "--explain tp=0: tp=0 is not a whole number ≥ 1; e.g. tp=2"),
    ("pp=2,schedule=zb-w", "--explain pp=2,schedule=zb-w: schedule=zb-w is not one of gpipe, 1f1b, interleaved, zb-h1, "
                           "zb-v, dualpipev"),
    ("zero", "--explain zero: 'zero' is not a layout field"),
])
def test_an_explain_field_outside_its_domain_is_refused_naming_it(field, message):
    """Refused as the flag is parsed (a ConfigError: the planner's one line, exit 2), before any planning;
    zero=0 (no ZeRO) is a stage like the others."""
    choose_layout = import_module("07_choosing_a_layout.choose_layout")
    with pytest.raises(ConfigError) as refused:
        choose_layout.parse_args(["--model", "tiny", "--explain", field])
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value), str(refused.value)
    assert choose_layout.parse_args(["--model", "tiny", "--explain", "zero=0,dp=8,schedule=zb-v"]).explain == \
        {"zero_stage": 0, "dp": 8, "schedule": "zb-v"}
