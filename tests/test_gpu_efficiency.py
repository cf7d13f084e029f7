"""Chapter 07's GPU efficiency curve: a matmul's rate by size, measured on a GPU (gpu_efficiency.py), and
the planner's GPU step time following it. No GPU is needed: the curves here are written by hand."""
import json
import math
import subprocess
import sys
from dataclasses import replace
from importlib import import_module
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
gpu_efficiency = import_module("07_choosing_a_layout.gpu_efficiency")
layout_costs = import_module("07_choosing_a_layout.layout_costs")
layout_inputs = import_module("07_choosing_a_layout.layout_inputs")

CURVE = ((1e6, 0.2), (1e8, 0.6), (1e10, 0.8))


def test_the_curve_is_read_between_its_points_in_log_flops_and_clamped_beyond():
    assert gpu_efficiency.rate_at(CURVE, 1e7) == pytest.approx(0.4)          # halfway in log FLOPs
    assert gpu_efficiency.rate_at(CURVE, 1e9) == pytest.approx(0.7)
    assert gpu_efficiency.rate_at(CURVE, 1e3) == 0.2 and gpu_efficiency.rate_at(CURVE, 1e12) == 0.8
    # the stated efficiency holds for the largest matmuls and is scaled down for the smaller ones
    assert gpu_efficiency.scaled_efficiency(0.5, CURVE, 1e10) == pytest.approx(0.5)
    assert gpu_efficiency.scaled_efficiency(0.5, CURVE, 1e6) == pytest.approx(0.5 * 0.2 / 0.8)
    assert gpu_efficiency.scaled_efficiency(0.5, None, 1e6) == 0.5                   # not measured: as stated


def test_the_planner_s_gpu_compute_follows_the_measured_curve():
    """Splitting the sequence 8 ways (cp 8, one sequence per micro-batch) makes each rank's matmuls 16 times
    smaller than dp 8's (two whole sequences per rank): with a curve its
    compute takes longer by the curve's ratio at the two sizes; without one the two are the same."""
    run = layout_costs.Run(layout_inputs.model_for("llama3-8b"), 16, 8192, "bf16")
    zero = dict.fromkeys(("dp", "tp", "pp", "cp", "ep"), 0)
    whole = layout_costs.Candidate(8, 1, 1, 1, 1, 3, "selective", False, "1f1b", 1)
    split = replace(whole, dp=1, cp=8, microbatches=16)
    flops = {c: layout_costs.matmul_flops(run, c) for c in (whole, split)}
    assert flops[whole] == 2 * 2 * 8192 * 4096 * 14336 and flops[split] == pytest.approx(flops[whole] / 16)
    plain = replace(layout_inputs.device_for("h100", "bf16", 8), curve=None)     # the stated efficiency alone
    measured = replace(plain, curve=((1e9, 0.3), (1e13, 0.9)))
    compute = {(dev.curve is not None, c): layout_costs.time_parts(run, c, dev, 8, zero, zero, 0.0)["compute"]
               for dev in (plain, measured) for c in (whole, split)}
    assert compute[(False, whole)] == pytest.approx(compute[(False, split)])
    ratio = gpu_efficiency.rate_at(measured.curve, flops[whole]) / gpu_efficiency.rate_at(measured.curve, flops[split])
    assert compute[(True, split)] / compute[(True, whole)] == pytest.approx(ratio)
    assert ratio > 1.05


def test_a_measured_curve_file_reaches_the_planner_s_device(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_efficiency, "RESULTS", tmp_path)
    points = [{"tokens": t, "width": 1024, "flops": 8 * t * 1024 ** 2, "tflops": 0.0, "efficiency": e}
              for t, e in ((1024, 0.7), (128, 0.25), (16384, 0.8))]
    (tmp_path / "gpu_efficiency_h100.json").write_text(json.dumps({"device": "NVIDIA H100", "points":
                                                                   {"bf16": points, "fp32": points[:1]}}))
    dev = layout_inputs.device_for("h100", "bf16", 8)
    assert dev.curve == tuple(sorted((p["flops"], p["efficiency"]) for p in points))
    assert layout_inputs.device_for("a100", "bf16", 8).curve is None            # measured on an H100 only
    assert all(math.isfinite(f) for f, _ in dev.curve)


def test_without_cuda_the_measurement_says_so_in_one_line_and_exits_0():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: `make gpu-efficiency` measures it")
    done = subprocess.run([sys.executable, "07_choosing_a_layout/gpu_efficiency.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().count("\n") == 0 and "no CUDA device" in done.stdout
