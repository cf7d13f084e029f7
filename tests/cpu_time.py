"""Where the suite's CPU time goes: a pytest plugin for a run of one test at a time.

    PYTHONPATH=tests .venv/bin/python -m pytest -q -p no:xdist -p cpu_time tests

The machine's busy CPU-seconds (every process: the test's own, the ranks and launches it starts) are read
from /proc/stat around each test, setup and teardown included, so the run must have the machine to itself and
one test at a time (no xdist). At the end it prints the total and the files that take the most; each test's
numbers go to the JSON-lines file CPU_TIME_LOG names, if set. On two cores the total halved is the least time
any schedule of the suite can take (the root README, "Tests").
"""
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

SHOWN = 12          # files listed at the end
_rows: list[dict] = []


def _busy_seconds() -> float:
    """CPU-seconds every core of the machine has spent busy since boot (/proc/stat's first line)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + ticks[4]                                      # idle, iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _busy_seconds(), time.monotonic()
    yield
    _rows.append({"test": item.nodeid, "cpu_s": round(_busy_seconds() - cpu, 2),
                  "wall_s": round(time.monotonic() - wall, 2)})


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        return
    if os.environ.get("CPU_TIME_LOG"):
        Path(os.environ["CPU_TIME_LOG"]).write_text("".join(json.dumps(r) + "\n" for r in _rows))
    by_file = defaultdict(lambda: [0.0, 0])
    for r in _rows:
        by_file[r["test"].split("::")[0]][0] += r["cpu_s"]
        by_file[r["test"].split("::")[0]][1] += 1
    total = sum(r["cpu_s"] for r in _rows)
    write = terminalreporter.write_line
    write(f"CPU time: {total:.0f} CPU-seconds in {len(_rows)} tests, "
          f"{sum(r['wall_s'] for r in _rows):.0f} s of wall time")
    for name, (cpu, n) in sorted(by_file.items(), key=lambda kv: -kv[1][0])[:SHOWN]:
        write(f"  {cpu:7.1f}  {name} ({n} tests)")
