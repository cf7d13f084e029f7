"""Notebooks 2, 5, 8, … of the sorted list execute in a kernel and show every plot they save
(notebook_runs.py)."""
from notebook_runs import check_notebook, share


@share(2)
def test_notebook_executes_in_a_kernel(path, tmp_path):
    check_notebook(path, tmp_path)
