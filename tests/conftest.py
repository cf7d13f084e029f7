import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # `common` and the chapters (`importlib.import_module("02_tensor_parallel.x")`)
sys.path.insert(0, str(ROOT / "tests"))
# The test workers share the machine's cores: every rank they start (spawned, launched, in a notebook's
# run) takes one thread, not the cores ÷ its ranks that a run alone takes (common/distributed.set_cpu_threads).
os.environ.setdefault("THREADS_PER_RANK", "1")
