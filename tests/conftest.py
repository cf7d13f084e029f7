import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # `common` and the chapters (`importlib.import_module("02_tensor_parallel.x")`)
sys.path.insert(0, str(ROOT / "tests"))
# The test workers share the machine's cores: every rank they start (spawned, launched, in a notebook's
# run) takes one thread, not the cores ÷ its ranks that a run alone takes (common/distributed.set_cpu_threads).
os.environ.setdefault("THREADS_PER_RANK", "1")
# Every process a test starts (its spawned ranks, torchrun with its log folder per launch) keeps its temporary
# files in one folder of this test process's, removed when it exits: a suite run leaves nothing in /tmp.
TMP = tempfile.mkdtemp(prefix="pfs-tests-")
os.environ["TMPDIR"] = TMP
atexit.register(shutil.rmtree, TMP, ignore_errors=True)

# One chapter's tests: `make test CHAPTER=03` (pytest --chapter 03). Each test file belongs to the chapter whose
# code it checks; `common` holds common/'s own tests and those that span every chapter (flags, launches,
# checkpoints, bf16, --compile, --recompute, one GPU, the exercises, the museum, the links). A file not listed
# is `common`. The notebooks go by their own name: NN_*.py is chapter NN's (pipeline_bubbles.py, chapter 03's).
CHAPTER_FILES = {
    "01": ("test_dp", "test_dp_cli", "test_zero"),
    "02": ("test_tp", "test_tp_ops", "test_tp_overlap"),
    "03": ("test_pp", "test_pp_bubble", "test_pp_schedules", "test_zero_bubble", "test_timeline"),
    "04": ("test_3d",),
    "05": ("test_4d", "test_moe", "test_moe_ep"),
    "06": ("test_cp", "test_ring_attention", "test_compose"),
    "07": ("test_choose_layout", "test_known_to_fit", "test_runnable", "test_layout_memory", "test_layout_time",
           "test_schedule_costs", "test_gpu_efficiency", "test_device_model", "test_megatron_gpt", "test_planner_output",
           "test_planner_runs", "test_layout_object", "test_torchtitan_memory", "test_pipeline_time", "test_caching_allocator"),
}
CHAPTERS = (*CHAPTER_FILES, "common")
NOTEBOOK_CHAPTERS = {"pipeline_bubbles": "03"}


def chapter_of_file(stem: str) -> str:
    return next((chapter for chapter, files in CHAPTER_FILES.items() if stem in files), "common")


def chapter_of_notebook(stem: str) -> str:
    return stem[:2] if stem[:2].isdigit() else NOTEBOOK_CHAPTERS.get(stem, "common")


def pytest_addoption(parser):
    parser.addoption("--chapter", default=None, choices=CHAPTERS,
                     help="only this chapter's tests (tests/conftest.py's CHAPTER_FILES; notebooks by their name)")


def pytest_ignore_collect(collection_path, config):
    """Under --chapter, a test file of another chapter is not even imported (the notebooks' files are split by
    notebook below)."""
    wanted, name = config.getoption("--chapter"), collection_path.name
    if wanted and name.startswith("test_") and name.endswith(".py") and not name.startswith("test_notebooks"):
        return chapter_of_file(collection_path.stem) != wanted or None
    return None


# The longest test files first. `make test` hands whole files to its workers in the order they are collected,
# each to the first worker free: alphabetically, a long file that starts late keeps one worker busy after the
# others finish (a fresh clone's run on 2 cores: 531 s alphabetically, 471 s in this order with the cuts that
# came with it). The order is the worker seconds of each file in a fresh clone's `make test` (pytest
# --junitxml), longest first; the rest follow alphabetically.
LONGEST_FIRST = ("test_notebooks_3", "test_notebooks_1", "test_3d", "test_compose", "test_launch", "test_dp_cli",
                 "test_notebooks_2", "test_cli_runs", "test_pp", "test_cp", "test_planner_runs", "test_tp_overlap",
                 "test_moe_ep", "test_recompute", "test_compile", "test_zero", "test_runnable", "test_choose_layout",
                 "test_4d", "test_tp", "test_exercises", "test_checkpoint_safety", "test_dp", "test_museum",
                 "test_one_gpu", "test_exercises_cli", "test_pp_registry", "test_compare_metrics")


def file_order(item) -> int:
    stem = item.path.stem
    return LONGEST_FIRST.index(stem) if stem in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    """The longest files first (LONGEST_FIRST; a stable sort keeps each file's tests in their order); under
    --chapter, the notebooks of other chapters are deselected."""
    items.sort(key=file_order)
    wanted = config.getoption("--chapter")
    if not wanted:
        return
    other = [item for item in items if hasattr(item, "callspec") and item.path.name.startswith("test_notebooks")
             and chapter_of_notebook(Path(item.callspec.params["path"]).stem) != wanted]
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = [item for item in items if item not in other]
