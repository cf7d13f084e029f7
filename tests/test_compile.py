"""`--compile` (common/compile.py): the same losses as eager mode, on layouts whose blocks hold collectives.

The backend is aot_eager: it traces and differentiates each block exactly as inductor does (graph
breaks, the compiled backward) but runs PyTorch's own kernels, so it compiles in seconds, where
inductor's C++ code generation takes a minute on a cold CPU. One group of two ranks runs
tensor parallelism (f and g inside every block) and ring attention (the ring inside every attention),
each eager and compiled, and tensor parallelism once more with its first block recomputed in full (the
block's body compiled inside its recomputation). The refusals run in this process, stopped before any
process group exists; a fresh process checks that importing the course's layers leaves the compiler
unloaded (what runs eagerly is marked, and the mark reaches for the compiler only while it traces).
"""
import subprocess
import sys
from importlib import import_module
from unittest import mock

import pytest
import torch.distributed as dist

from common.errors import ConfigError
from common.model import PRESETS, build_model
from harness import ROOT, every_rank, losses, run_group

RUN = ["--steps", "2", "--quiet", "--global-batch", "2", "--seq-len", "32"]
LAYOUTS = {"02_tensor_parallel.train_tp": ["--tp", "2"], "06_context_parallel.train_cp": ["--cp", "2"]}


def run_counting_graphs(script: str, argv: list) -> tuple[list[dict], int]:
    """(metrics rows, graphs the compiler built in this process so far): a job for the spawned ranks."""
    import torch._dynamo
    history = import_module(script).main(argv)
    return history, torch._dynamo.utils.counters["stats"]["unique_graphs"]


# Full recomputation of the first block only: that block's body compiled inside its recomputation, the
# others compiled whole (common/compile.py), in one run.
RECOMPUTED = ["--recompute", "full", "--recompute-layers", "1"]


@pytest.fixture(scope="module")
def group():
    jobs = []
    for script, layout in LAYOUTS.items():
        jobs += [("test_compile:run_counting_graphs", script, RUN + layout),
                 ("test_compile:run_counting_graphs", script, RUN + layout + ["--compile", "aot_eager"])]
    jobs.append(("test_compile:run_counting_graphs", "02_tensor_parallel.train_tp",
                 RUN + LAYOUTS["02_tensor_parallel.train_tp"] + ["--compile", "aot_eager"] + RECOMPUTED))
    return [every_rank(result) for result in run_group(2, jobs)]


@pytest.fixture(scope="module")
def runs(group):
    return {script: (group[2 * i], group[2 * i + 1]) for i, script in enumerate(LAYOUTS)}


@pytest.mark.parametrize("script", LAYOUTS)
def test_compiled_blocks_give_the_eager_losses(runs, script):
    eager, compiled = runs[script]
    for (rows, graphs_before), (compiled_rows, graphs_after) in zip(eager, compiled):
        assert losses(compiled_rows) == pytest.approx(losses(rows), rel=1e-6)
        # The blocks were compiled (the eager run builds no graph), cut around their collectives into a few
        # pieces (a TP block: 9, counting each frame's pieces), and not traced again at step 2.
        assert 1 <= graphs_after - graphs_before <= 12, graphs_after - graphs_before


def test_full_recomputation_compiles_inside_the_rerun(group):
    """TP 2, block 0 recomputed in full: the eager losses, and block 0's activations no longer kept."""
    eager, compiled, recomputed = group[0], group[1], group[-1]
    for (rows, _), (compiled_rows, _), (recomputed_rows, _) in zip(eager, compiled, recomputed):
        assert losses(recomputed_rows) == pytest.approx(losses(rows), rel=1e-6)
        kept, all_kept = recomputed_rows[-1]["peak_activation_bytes"], compiled_rows[-1]["peak_activation_bytes"]
        assert kept < all_kept, (kept, all_kept)


def test_a_recomputed_block_compiles_its_body_and_reruns_it_eagerly():
    """Block 0 (full recomputation): its forward stays eager (the recomputation's checkpoint, as written) and
    its body is compiled; block 1 (no recomputation) is compiled whole."""
    model = build_model(PRESETS["tiny"], 0, "cpu", "full", "aot_eager", recompute_layers=1)
    recomputed, kept = model.layers[0], model.layers[1]
    assert recomputed._compiled_call_impl is None and hasattr(recomputed.body, "_torchdynamo_orig_callable")
    assert kept._compiled_call_impl is not None and not hasattr(kept.body, "_torchdynamo_orig_callable")


def test_a_process_that_never_compiles_does_not_import_the_compiler():
    """The marks of what runs eagerly ask for the compiler only while it traces (common/compile.py's `eager`), and
    the course's AdamW has no compiler guard to trip (common/optim.py): a run that refuses its flags, the planner,
    a notebook's kernel or a rank that trains imports every chapter's layers and script, steps the optimizer, and
    imports neither the compiler (torch._dynamo, about 1 s of CPU in every such process) nor, unless --impl torch
    asks for them, PyTorch's DTensor and pipeline runtimes (torch.distributed.tensor, .pipelining: ~0.8 s)."""
    code = ("import sys, importlib, torch\n"
            "for m in ('common.comm', 'common.model', '05_moe_expert_parallel.expert_parallel',\n"
            "          '06_context_parallel.context_parallel', '01_data_parallel.train_dp', '01_data_parallel.train_zero',\n"
            "          '02_tensor_parallel.train_tp', '03_pipeline_parallel.train_pp', '04_3d_combined.train_3d',\n"
            "          '05_moe_expert_parallel.train_moe', '06_context_parallel.train_cp'):\n"
            "    importlib.import_module(m)\n"
            "from common.optim import build_adamw\n"
            "w = torch.nn.Parameter(torch.ones(2)); w.grad = torch.ones(2)\n"
            "build_adamw([('w.weight', w)], 1e-3, 0.1).step()\n"
            "print([m for m in ('torch._dynamo', 'torch.distributed.tensor', 'torch.distributed.pipelining')\n"
            "       if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_spawned_ranks_start_with_what_they_would_import_preloaded():
    """The other side: the tests' ranks fork from a server that has already imported the training scripts and
    the compiler (tests/rank_preload.py), so a rank that recomputes or pipelines pays neither at its start."""
    from rank_preload import MODULES
    (loaded,) = run_group(1, [("harness:modules_loaded", MODULES)])
    assert every_rank(loaded) == [MODULES], loaded


def refusal(script: str, argv: list) -> str:
    """The one-line ConfigError `script` raises for argv, before it would create the process group."""
    with mock.patch.object(dist, "init_process_group", side_effect=AssertionError("reached training")), \
            pytest.raises(ConfigError) as err:
        import_module(script).main(argv + ["--quiet"])
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("script, argv, says", [
    ("03_pipeline_parallel.train_pp", ["--compile", "--schedule", "zb-h1"], "use --schedule 1f1b"),
    ("01_data_parallel.train_dp", ["--compile", "aot_eager", "--recompute", "selective"], "use --recompute full"),
    ("02_tensor_parallel.train_tp", ["--compile", "--impl", "torch"], "use --impl ours"),
    ("04_3d_combined.train_3d", ["--compile", "aot_eager", "--measure-memory"], "measure memory without --compile"),
])
def test_what_cannot_compile_is_refused_in_one_line(script, argv, says):
    assert says in refusal(script, argv)


def test_under_the_memory_meter_nothing_compiles():
    """Why --measure-memory refuses --compile: a compiled function builds its graph, the same function called
    first under chapter 04's meter builds none (it runs eagerly)."""
    import torch
    import torch._dynamo
    from common.live_memory import LiveTensors
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    torch.compile(lambda x: (x.sin() * 2).cos(), backend="aot_eager")(torch.randn(8))
    assert graphs["unique_graphs"] == before + 1
    metered = torch.compile(lambda x: (x.sin() * 3).cos(), backend="aot_eager")
    with LiveTensors():
        metered(torch.randn(8))
    assert graphs["unique_graphs"] == before + 1


def test_compile_alone_means_inductor():
    parse_args = import_module("01_data_parallel.train_dp").parse_args
    assert parse_args(["--compile"]).compile == "inductor"
    assert parse_args([]).compile == "none"


def _one_at_a_time(actions):
    """A rank's actions, a pair issued together (DualPipeV's overlapped forward and backward) as its two."""
    for a in actions:
        yield from (a.forward, a.backward) if hasattr(a, "forward") else (a,)


def test_every_schedule_that_splits_the_backward_is_refused_and_only_those():
    """Read from the schedules themselves: one with a W action (zero bubble's weight-gradient half, run apart
    from its B) cannot run a compiled block's one backward, so `--compile` refuses it, naming it; the others
    reach training. Every schedule the scripts accept, built at p = 2, m = 4."""
    schedules = import_module("03_pipeline_parallel.pipeline_schedules")
    names = list(schedules.SCHEDULES)
    split = {name: any(a.kind == "W" for actions in schedules.build_schedule(
        name, 2, 4, schedules.stages_per_rank(name, 2 if name == "interleaved" else 1))
        for a in _one_at_a_time(actions)) for name in names}
    assert any(split.values()) and not all(split.values()), split
    for name, splits in split.items():
        argv = ["--compile", "aot_eager", "--schedule", name, "--microbatches", "4"]
        if splits:
            said = refusal("03_pipeline_parallel.train_pp", argv)
            assert f"--schedule {name}" in said and "use --schedule 1f1b" in said, said
        else:
            with pytest.raises(AssertionError, match="reached training"):
                refusal("03_pipeline_parallel.train_pp", argv)
