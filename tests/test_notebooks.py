"""Every notebook executes through a real Jupyter kernel (nbclient, the engine of `jupyter nbconvert
--execute`), in its quick mode (NOTEBOOK_QUICK=1: few steps, few ranks), one kernel per notebook.
Each plot it shows inline must also be saved as a PNG (NOTEBOOK_FIGURES points to a temporary folder).
Notebooks are found by glob, so a new chapter's notebook is tested as soon as it exists."""
import jupytext
import pytest
from nbclient import NotebookClient

from harness import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.py"))


def images_shown(nb) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells if cell.cell_type == "code"
               for out in cell.outputs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_in_a_kernel(path, tmp_path, monkeypatch):
    figures = tmp_path / "figures"
    for name, value in {"NOTEBOOK_QUICK": "1", "NOTEBOOK_FIGURES": str(figures), "TMPDIR": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)                     # the kernel inherits this environment
    monkeypatch.delenv("MPLBACKEND", raising=False)         # the kernel's own inline backend, not Agg
    nb = jupytext.read(path)
    NotebookClient(nb, kernel_name="python3", timeout=240, resources={"metadata": {"path": str(ROOT)}}).execute()
    saved = sorted(figures.glob("*.png"))
    assert saved, f"{path.name} saved no plot under NOTEBOOK_FIGURES"
    assert images_shown(nb) == len(saved), (f"{path.name}: {images_shown(nb)} plots shown inline, "
                                            f"{len(saved)} saved: {[p.name for p in saved]}")
