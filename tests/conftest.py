import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # `common` and the chapters (`importlib.import_module("02_tensor_parallel.x")`)
sys.path.insert(0, str(ROOT / "tests"))
# The test workers share the machine's cores: every rank they start (spawned, launched, in a notebook's
# run) takes one thread, not the cores ÷ its ranks that a run alone takes (common/distributed.set_cpu_threads).
os.environ.setdefault("THREADS_PER_RANK", "1")

# The longest test files first (whole minutes each on 2 cores, `pytest --durations=0` summed per file): the
# workers take files in collection order, each a whole file (--dist loadfile), so a long file collected last
# would run alone at the end while the other workers wait. The rest keep their order.
LONGEST_FIRST = ("test_notebooks_3.py", "test_moe_ep.py", "test_notebooks_1.py", "test_compose.py",
                 "test_notebooks_2.py", "test_cli_runs.py", "test_cp.py", "test_3d.py", "test_dp_cli.py",
                 "test_dp.py", "test_4d.py", "test_exercises.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)                   # (a stable sort: each file's tests keep their order)
