"""Speed on one device: per-preset training defaults, the GPU's peak memory in every metrics row, the
overhead benchmark's plain loop, and `make gpu-check` on a machine without CUDA. All in this process
(the GPU paths are stood in for: this suite runs on CPUs)."""
import runpy
from argparse import Namespace
from importlib import import_module
from unittest import mock

import pytest
import torch

from common import bench_overhead, gpu_check, preset_training
from common.metrics import RunLog
from common.model import PRESETS
from common.optim import build_adamw


def test_every_preset_has_training_defaults_and_tiny_keeps_its_rate():
    assert set(preset_training.DEFAULTS) == set(PRESETS)
    assert preset_training.training_defaults("tiny") == (3e-3, 10)      # every committed result used it
    rates = [preset_training.training_defaults(n)[0] for n in ("tiny", "medium", "large", "xl")]
    assert rates == sorted(rates, reverse=True) and rates[-1] <= 3e-4  # larger models, smaller steps


def test_lr_and_warmup_left_out_take_the_presets_and_given_ones_win():
    parse_args = import_module("01_data_parallel.train_dp").parse_args
    assert (parse_args([]).lr, parse_args([]).warmup) == (3e-3, 10)
    xl = parse_args(["--model", "xl"])
    assert (xl.lr, xl.warmup) == preset_training.training_defaults("xl")
    given = parse_args(["--model", "xl", "--lr", "0.01", "--warmup", "0"])
    assert (given.lr, given.warmup) == (0.01, 0)


def test_metrics_rows_hold_the_gpus_peak_memory_and_null_without_one(tmp_path):
    log = RunLog(0, 2, str(tmp_path / "m.jsonl"), quiet=True)
    assert log.log_step(1, 5.0, 1e-3, 100, 0.1)["peak_memory_bytes"] is None       # a CPU run: not measured
    with mock.patch.object(torch.cuda, "is_initialized", return_value=True), \
            mock.patch.object(torch.cuda, "max_memory_allocated", return_value=123) as peak, \
            mock.patch.object(torch.cuda, "reset_peak_memory_stats") as reset:
        assert log.log_step(2, 4.0, 1e-3, 100, 0.1)["peak_memory_bytes"] == 123
    assert peak.called and reset.called                     # each row: the peak since the previous one


def test_adamw_is_fused_on_a_gpu_and_the_plain_loop_on_a_cpu():
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    assert build_adamw([("w", weight)], 1e-3, 0.1).defaults["fused"] is False
    with mock.patch.object(torch.Tensor, "is_cuda", new=True):
        assert build_adamw([("w", weight)], 1e-3, 0.1).defaults["fused"] is True


def test_the_plain_loop_reaches_the_scripts_losses():
    """The benchmark's ten-line loop trains what train_dp.py trains: the same losses, step by step."""
    args = Namespace(device="cpu", seed=1337, compile="none", seq_len=32, global_batch=2, steps=2, dtype="fp32",
                     clock=bench_overhead.time.perf_counter)
    losses, step_times = bench_overhead.plain_loop(args, "tiny")
    history = import_module("01_data_parallel.train_dp").main(
        ["--steps", "2", "--seq-len", "32", "--global-batch", "2", "--quiet"])
    assert losses == pytest.approx([r["loss"] for r in history], rel=1e-6)
    assert len(step_times) == 1                             # step 1 (warm-up) is not timed


def test_every_benchmarked_script_trains_the_plain_loops_losses_with_and_without_the_meter():
    """What `make overhead` compares: each script at world size 1 (ZeRO-3 with its shard as the whole
    unit, the pipeline with one stage, ...) reaches the plain loop's losses, with the activation meter and
    with `--no-activation-meter`, which leaves peak_activation_bytes null and nothing else changed. The
    metered runs take two micro-batches where the benchmark's flags leave the count free (the gradients
    accumulate: ZeRO-3's shard gradient at world size 1 too)."""
    args = Namespace(device="cpu", seed=1337, compile="none", seq_len=32, global_batch=2, steps=3, dtype="fp32",
                     clock=bench_overhead.time.perf_counter)
    plain = {m: bench_overhead.plain_loop(args, m)[0] for m in ("tiny", "tiny-moe")}
    for name, (path, flags) in bench_overhead.SCRIPTS.items():
        main = runpy.run_path(str(bench_overhead.ROOT / path))["main"]
        two = [] if "--microbatches" in flags else ["--microbatches", "2"]
        runs = [main(["--steps", "3", "--seq-len", "32", "--global-batch", "2", "--quiet", *flags, *more])
                for more in (two, ["--no-activation-meter"])]
        expected = plain["tiny-moe" if "tiny-moe" in flags else "tiny"]
        for rows in runs:
            assert [r["loss"] for r in rows] == pytest.approx(expected, rel=1e-6), name
        peaks = [_listed(r.get("peak_activation_bytes")) for r in runs[0] + runs[1]]
        assert all(p is None for row in peaks[len(runs[0]):] for p in row), name       # (a pipeline: per stage)
        assert "zero" in path or all(p > 0 for row in peaks[:len(runs[0])] for p in row), name


def _listed(value) -> list:
    return value if isinstance(value, list) else [value]


def test_gpu_check_without_cuda_says_so_in_one_line_and_exits_0(capsys, tmp_path):
    with mock.patch.object(torch.cuda, "is_available", return_value=False):
        assert gpu_check.main(["--out", str(tmp_path / "gpu_check.md")]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA device" in out and not (tmp_path / "gpu_check.md").exists()


def test_gpu_check_rows_say_what_failed():
    assert gpu_check.row("`x.py`", "bf16", {"ok": False, "error": "boom"}) == "| `x.py` | bf16 | no: boom | - | - | - |"
    ok = {"ok": True, "loss": 4.6532541, "tokens_per_s": 12345.6, "peak": 3 * 2**30}
    assert gpu_check.row("`x.py`", "fp32", ok) == "| `x.py` | fp32 | yes | 4.653254 | 12,346 | 3.00 GiB |"
    assert {"01_data_parallel/train_dp.py", "06_context_parallel/train_cp.py"} <= set(gpu_check.SCRIPTS)


def test_the_overhead_benchmark_refuses_too_few_steps_to_time():
    """Each run's first and last steps are not timed: two steps would leave nothing to compare."""
    from common.errors import ConfigError
    with pytest.raises(ConfigError, match="--steps must be a whole number ≥ 3, got 2"):
        bench_overhead.main(["--steps", "2"])
