"""Every notebook runs headless as a plain script (few steps: NOTEBOOK_QUICK=1) and exits 0."""
import os
import subprocess
import sys

import pytest

from harness import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.py"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_as_a_script(path, tmp_path):
    env = {**os.environ, "NOTEBOOK_QUICK": "1", "MPLBACKEND": "Agg", "TMPDIR": str(tmp_path)}
    env.pop("DISPLAY", None)
    proc = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
