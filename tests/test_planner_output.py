"""The layout planner's printed output (07_choosing_a_layout/explain_layout.py): every line at most 80 columns
(COLUMNS=80) for the tiny model and a published run, the table's memory in the unit its rows need, the command
continued with ` \\` so that it pastes back whole, and a note that says why rows with different bubbles tie on
a CPU whose ranks outnumber its cores."""
from importlib import import_module
from types import SimpleNamespace

import pytest

choose_layout = import_module("07_choosing_a_layout.choose_layout")
explain_layout = import_module("07_choosing_a_layout.explain_layout")


@pytest.mark.parametrize("argv, unit, command", [
    (["--model", "tiny", "--world", "8", "--device", "h100", "--explain", "dp=4,pp=2,m=4"], "MiB/rank",
     "Run it: torchrun --nproc_per_node=8 04_3d_combined/train_3d.py --model tiny --dp 4 --tp 1 --pp 2 "),
    (["--explain", "torchtitan-llama3-8b", "--top", "5"], "GiB/rank",
     "Run it in miniature on this machine: torchrun --nproc_per_node=2 01_data_parallel/train_zero.py")])
def test_the_plan_reads_at_80_columns(argv, unit, command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    choose_layout.main(argv)
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80, out
    head = next(line for line in out.splitlines() if line.lstrip().startswith("dp tp pp cp"))
    assert unit in head, head
    table = out.split(head)[1].split("\n\n")[0].splitlines()
    end = head.index(unit) + len(unit)                  # the column is right-aligned under its header
    memory = [row[:end].split()[-1] for row in table if row.split() and row.split()[0].isdigit()]
    assert len(memory) >= 5 and all(float(m.rstrip("*")) >= 1 for m in memory), memory   # 3 digits show differences
    assert command in "\n".join(explain_layout.unwrapped(out)), out    # the wrapped command joins back whole


def test_rows_that_tie_say_why():
    """Two schedules of one layout, equal step times, bubbles 27.3 % and 11.1 %: on a CPU of 2 cores and 8
    ranks the note says the model charges no bubble; on a GPU (one device per rank) there is no such note."""
    row = {"dp": 2, "tp": 1, "pp": 4, "cp": 1, "ep": 1, "sequence_parallel": False, "zero_stage": 0,
           "recompute": "none", "recompute_layers": None, "virtual_stages": 1, "microbatches": 8,
           "memory_bytes": {"total": 19_818_496}, "step_time_s": 0.2708, "fits": True}
    rows = [dict(row, schedule="1f1b", bubble=0.273), dict(row, schedule="zb-h1", bubble=0.111)]
    cpu, gpu = SimpleNamespace(cores=2, memory=2**31, headroom=0), SimpleNamespace(cores=None, memory=2**31, headroom=0)
    said = "\n".join(explain_layout.unwrapped("\n".join(explain_layout.table(rows, cpu, 8))))
    assert "the model charges no bubble when ranks outnumber cores" in said and "8 ranks share 2 cores" in said
    assert "MiB/rank" in said and "18.9" in said                   # 19,818,496 bytes: MiB, 3 digits
    assert "no bubble" not in "\n".join(explain_layout.table(rows, gpu, 8))
    assert "no bubble" not in "\n".join(explain_layout.table(rows, cpu, 2))      # ranks ≤ cores: the bubble counts
