import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # `common` and the chapters (`importlib.import_module("02_tensor_parallel.x")`)
sys.path.insert(0, str(ROOT / "tests"))
# The test workers share the machine's cores: every rank they start (spawned, launched, in a notebook's
# run) takes one thread, not the cores ÷ its ranks that a run alone takes (common/distributed.set_cpu_threads).
os.environ.setdefault("THREADS_PER_RANK", "1")



def pytest_collection_modifyitems(config, items):
    """The notebooks first (stable sort: the rest in their order). `make test` runs the files on three workers,
    each file whole on one; the notebooks' file is the longest (every notebook in a kernel, two at a time,
    about 180–210 s on 2 cores) and, left in its alphabetical place, ran alone at the end while the other
    workers idled."""
    items.sort(key=lambda item: Path(str(item.fspath)).name != "test_notebooks.py")
