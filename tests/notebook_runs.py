"""Every notebook executes through a real Jupyter kernel (nbclient, the engine of `jupyter nbconvert
--execute`), in its quick mode (NOTEBOOK_QUICK=1: few steps, few ranks), one kernel per notebook.
Each plot it saves as a PNG (NOTEBOOK_FIGURES points to a temporary folder) must also be in the executed
notebook itself, as an image output of its cell. The kernel runs with MPLBACKEND=Agg, as on a headless
server or in a container image: there matplotlib's inline backend is never used, so the plots must
reach the notebook without it, whatever the environment the tests run in.
Notebooks are found by glob, so a new chapter's notebook is tested as soon as it exists.

Each notebook is its own test, with its own time limit (pytest.ini). The notebooks are shared by three test
files (test_notebooks_1.py … _3.py, every third one each), so three test workers run them side by side:
one file would keep one worker busy for minutes after the others finished."""
import os
from pathlib import Path

import jupytext
import pytest
from nbclient import NotebookClient

from harness import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.py"))


def images_shown(nb) -> int:
    """The notebook's own inline images: image/png outputs of its code cells."""
    return sum("image/png" in out.get("data", {}) for cell in nb.cells if cell.cell_type == "code"
               for out in cell.outputs)


def execute(path: Path, tmp: Path):
    """Run one notebook in its own kernel: (the executed notebook, its figures folder)."""
    figures = tmp / "figures"
    env = {**os.environ, "MPLBACKEND": "Agg", "NOTEBOOK_QUICK": "1", "NOTEBOOK_FIGURES": str(figures),
           "TMPDIR": str(tmp)}
    nb = jupytext.read(path)
    NotebookClient(nb, kernel_name="python3", timeout=240, resources={"metadata": {"path": str(ROOT)}}).execute(env=env)
    return nb, figures


FILES = 3


def share(k: int):
    """Every notebook of the k-th test file (1 ≤ k ≤ FILES), parametrized by its name."""
    mine = NOTEBOOKS[k - 1::FILES]
    return pytest.mark.parametrize("path", mine, ids=[p.stem for p in mine])


def check_notebook(path: Path, tmp_path: Path) -> None:
    nb, figures = execute(path, tmp_path)
    saved = sorted(figures.glob("*.png"))
    assert saved, f"{path.name} saved no plot under NOTEBOOK_FIGURES"
    assert images_shown(nb) >= 1, f"{path.name} plots, but the executed notebook holds no image (MPLBACKEND=Agg)"
    assert images_shown(nb) == len(saved), (f"{path.name}: {images_shown(nb)} plots shown inline, "
                                            f"{len(saved)} saved: {[p.name for p in saved]}")
