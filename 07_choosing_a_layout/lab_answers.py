"""Lab 07's answer key: runs every command of LAB.md and writes LAB_ANSWERS.md from what they print.

    python 07_choosing_a_layout/lab_answers.py          # runs every command of LAB.md (about 3 minutes)
"""
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters
from common.lab_key import Edit, Key  # noqa: E402

CH = "07_choosing_a_layout"
lab_layout = import_module("07_choosing_a_layout.lab_layout")
# L4: the planner keeps every candidate, without the chapters' verdict
SKIP = Edit(f"{CH}/planner.py",
            "kept = [c for c in every if runnable.refusal(c, model, cfg, global_batch, seq_len, dtype) is None]",
            "kept = every")
# L5: freed blocks no longer merge with their free neighbours
NO_MERGE = Edit(f"{CH}/caching_allocator.py", "for other in (block.after, block.before):", "for other in ():")


def main() -> None:
    key = Key(CH, "Chapter 07 lab — choosing a layout")
    key.names(f"{CH}/runnable.py", "def refusal", "def command")
    key.names(f"{CH}/planner.py", "def candidates", "def ranking")
    lab_layout.bytes_section(key)
    lab_layout.scale_section(key)
    lab_layout.refusals_section(key)
    lab_layout.broken_section(key, SKIP)
    lab_layout.allocator_section(key, NO_MERGE)
    key.write()


if __name__ == "__main__":
    main()
