"""Chapter 03 — pipeline parallelism with the 1F1B schedule (one forward, one backward).

    torchrun --nproc_per_node=4 03_pipeline_parallel/train_1f1b.py
    torchrun --nproc_per_node=4 03_pipeline_parallel/train_1f1b.py --microbatches 8 --timeline runs/1f1b.json
    python 03_pipeline_parallel/train_1f1b.py --pp 4 --microbatches 8 --print-schedule

The same script as train_pp.py with --schedule fixed to 1f1b; every other flag is train_pp.py's.
"""
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters

from common.errors import run_main

train_pp = import_module("03_pipeline_parallel.train_pp")


def main(argv=None) -> list[dict]:
    return train_pp.main(argv, schedule="1f1b")


if __name__ == "__main__":
    run_main(main)
