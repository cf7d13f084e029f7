"""MFU: the FLOPs formula by hand for `tiny`, the CPU peak probe and its cache, `mfu` in every script's rows."""
import json
import math

import pytest
import torch
import torch.nn as nn
from harness import ok, run_single

from common import mfu
from common.metrics import RunLog, read_metrics
from common.model import PRESETS, build_model


def test_flops_per_token_by_hand_for_tiny():
    # tiny: D = 128, L = 8, 8 query heads and 4 KV heads of 16 → K/V width 64, SwiGLU 384, V = 256
    per_layer = 128 * 128 + 128 * 64 + 128 * 64 + 128 * 128 + 3 * 128 * 384      # wq wk wv wo + gate up down
    n_matmul = 8 * per_layer + 128 * 256                                          # + LM head = 1,605,632
    assert mfu.matmul_params(PRESETS["tiny"]) == n_matmul == 1_605_632
    assert mfu.flops_per_token(PRESETS["tiny"], 128) == 6 * 1_605_632 + 6 * 8 * 128 * 128
    # the same N from the model itself: every nn.Linear weight (the embedding is not one)
    model = build_model(PRESETS["tiny"], 0)
    assert sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)) == n_matmul


def test_moe_counts_active_experts_only():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class MoEConfig:                # the fields an MoE config carries (getattr defaults otherwise)
        vocab_size: int = 256
        dim: int = 128
        n_layers: int = 8
        n_kv_heads: int = 4
        head_dim: int = 16
        ffn_hidden: int = 384
        n_experts: int = 8
        top_k: int = 2
        expert_hidden: int = 192

    attn = 2 * 128 * 128 + 2 * 128 * 64
    assert mfu.matmul_params(MoEConfig()) == 8 * (attn + 128 * 8 + 2 * 3 * 128 * 192) + 128 * 256


def test_cpu_probe_is_positive_finite_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(mfu, "PROBE_SECONDS", 0.05)
    peak = mfu.peak_flops("cpu", "fp32")
    assert math.isfinite(peak) and peak > 1e8                    # any CPU does 0.1 GFLOP/s
    cached = json.loads((tmp_path / "parallelism-from-scratch" / "peak.json").read_text())
    assert list(cached.values()) == [peak / torch.get_num_threads()]   # one core's, × this process's threads
    assert "one core | fp32" in next(iter(cached))
    monkeypatch.setattr(mfu, "measure_peak_flops", lambda *a, **k: pytest.fail("measured again"))
    assert mfu.peak_flops("cpu", "fp32") == peak                  # the second time from the cache


def test_datasheet_peaks():
    assert mfu.DATASHEET[1][1]["bf16"] == 989.4e12 and dict(mfu.DATASHEET)["A100"]["fp32"] == 19.5e12


def test_metrics_rows_carry_mfu(tmp_path):
    log = RunLog(0, 2, str(tmp_path / "m.jsonl"), quiet=True)
    log.set_flops(1e6, 1e12)
    log.log_step(1, 5.0, 1e-3, 1000, 0.5)                        # 2,000 tokens/s × 1 MFLOP ÷ 1 TFLOP/s
    log.finish()
    assert read_metrics(tmp_path / "m.jsonl")[0]["mfu"] == pytest.approx(2e-3)


def test_every_script_reports_mfu():
    flags = ["--steps", "1", "--seq-len", "32", "--global-batch", "4", "--quiet"]
    scripts = ["01_data_parallel.train_dp", "01_data_parallel.train_zero", "02_tensor_parallel.train_tp",
               "04_3d_combined.train_3d"]                   # train_pp: tests/test_timeline.py
    for script, res in zip(scripts, run_single([(f"{s}:main", flags) for s in scripts])):
        history = ok([res])
        assert 0 < history[0]["mfu"] < 1, script
