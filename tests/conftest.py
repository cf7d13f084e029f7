import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # `common` and the chapters (`importlib.import_module("02_tensor_parallel.x")`)
sys.path.insert(0, str(ROOT / "tests"))

