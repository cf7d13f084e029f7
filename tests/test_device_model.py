"""Chapter 07's GPU step time from operations (block_time.py, step_time.py), a model of one's own (--model
PATH.json, model_files.py) and the explained layout as Megatron-LM and torchtitan flags. No GPU needed."""
import json
import subprocess
import sys
from dataclasses import replace
from importlib import import_module
from pathlib import Path

import pytest

from common.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
block_time = import_module("07_choosing_a_layout.block_time")
choose_layout = import_module("07_choosing_a_layout.choose_layout")
device_files = import_module("07_choosing_a_layout.device_files")
framework_flags = import_module("07_choosing_a_layout.framework_flags")
layout_costs = import_module("07_choosing_a_layout.layout_costs")
layout_inputs = import_module("07_choosing_a_layout.layout_inputs")
model_files = import_module("07_choosing_a_layout.model_files")

GPT3 = layout_inputs.model_for("gpt3-175b")
SMALL = {"vocab_size": 1024, "dim": 512, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 1536,
         "max_seq_len": 1024}


def test_recomputation_adds_exactly_the_operations_it_reruns():
    """One micro-batch through 4 blocks: full recomputation adds each block's forward but the down projection
    and the last residual, selective its norms and activation (and, unfused, the attention core)."""
    dev = device_files.load("a100", "bf16")
    for attention in ("flash", "unfused"):
        s = block_time.Shape(2048, 2048, 8, True, 1, 2, attention)
        fwd = block_time.block_forward(GPT3, s)
        base = block_time.seconds(block_time.microbatch_ops(GPT3, s, 4, 0, "none", False, False), dev)
        for mode, kept in (("full", lambda op: op.name not in ("mlp down", "residual 2")),
                           ("selective", lambda op: op.name in ("norm 1", "norm 2", "activation")
                            or attention == "unfused" and op.name in block_time.ATTENTION)):
            more = block_time.seconds(block_time.microbatch_ops(GPT3, s, 4, 3, mode, False, False), dev) - base
            assert more == pytest.approx(3 * block_time.seconds([op for op in fwd if kept(op)], dev)), (mode, attention)


def test_a_gelu_model_runs_two_matrices_of_its_width_and_holds_a_swiglus_weights():
    """GPT-3's MLP: up and down of 49,152 (over TP 8: 6,144) in the time; in the memory the weights of a SwiGLU
    of 32,768, the same 2·d·4d."""
    assert GPT3.mlp == "gelu" and GPT3.gelu_hidden == 49152 and 3 * GPT3.ffn_hidden == 2 * 49152
    ops = {op.name: op for op in block_time.block_forward(GPT3, block_time.Shape(2048, 2048, 8, False, 1, 2))}
    assert ops["mlp up"].flops == ops["mlp down"].flops == 2 * 2048 * 12288 * 6144
    swiglu = replace(GPT3, mlp="swiglu")
    up = {op.name: op for op in block_time.block_forward(swiglu, block_time.Shape(2048, 2048, 8, False, 1, 2))}
    assert up["mlp up"].flops + up["mlp down"].flops == ops["mlp up"].flops + ops["mlp down"].flops


def test_a_gpu_step_is_the_sum_of_its_parts_and_every_json_row_carries_mfu_and_them(tmp_path):
    """A model of one's own (a small JSON file) on 8 H200: every row's step is its parts' sum, its MFU the model's
    FLOPs over the peak; the file's GELU reaches the plan; the explained row prints as Megatron-LM and
    torchtitan flags."""
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**SMALL, "mlp": "gelu"}))
    out = tmp_path / "rows.json"
    rows = choose_layout.main(["--model", str(path), "--world", "8", "--device", "h200", "--dtype", "bf16",
                               "--global-batch", "16", "--seq-len", "1024", "--json", str(out),
                               "--explain", "tp=2,pp=2,m=4"])
    assert layout_inputs.model_for(str(path)).gelu_hidden == 1536
    written = json.loads(out.read_text())
    assert len(written) == len(rows) > 100 and all("mfu" in r and "time_parts_s" in r for r in written)
    for r in rows:
        parts = r["time_parts_s"]
        assert r["step_time_s"] == pytest.approx(sum(parts.values()), rel=1e-12)
        assert {"compute", "memory", "optimizer", "bubble", "comm_tp"} <= set(parts)


def test_the_explained_layout_as_megatron_and_torchtitan_flags():
    r = {"dp": 1, "tp": 8, "pp": 8, "cp": 1, "ep": 1, "zero_stage": 0, "recompute": "selective",
         "recompute_layers": None, "sequence_parallel": True, "schedule": "interleaved", "virtual_stages": 3,
         "microbatches": 64}
    flags = framework_flags.megatron(r, GPT3, 64, 2048)
    assert flags == ("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 "
                     "--num-layers-per-virtual-pipeline-stage 4 --sequence-parallel --recompute-granularity "
                     "selective --micro-batch-size 1 --global-batch-size 64 --seq-length 2048")
    titan = framework_flags.torchtitan({**r, "dp": 8, "zero_stage": 3, "tp": 1, "pp": 1, "microbatches": 2}, 16, 8192)
    assert "--parallelism.data_parallel_shard_degree 8" in titan and "--training.local_batch_size 2" in titan
    assert "reshard" not in titan and "pipeline_parallel_schedule" not in titan


@pytest.mark.parametrize("content, message", [
    ({**SMALL, "mlp": "relu"}, "field mlp must be one of swiglu, gelu, got 'relu'"),
    ({**SMALL, "dims": 512}, "unknown field 'dims'"),
    ({k: v for k, v in SMALL.items() if k != "n_layers"}, "field n_layers is missing"),
    ({**SMALL, "n_heads": 7}, r"field n_heads \(7\) must divide dim \(512\)"),
    ({**SMALL, "ffn_hidden": 1.5}, "field ffn_hidden must be a whole number ≥ 1, got 1.5"),
])
def test_a_bad_model_file_is_refused_naming_its_field(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=message):
        layout_inputs.model_for(str(path))


def test_bad_files_exit_2_with_one_line(tmp_path):
    """A bad model or device file on the command line: one line that names the field, exit 2."""
    model, device = tmp_path / "model.json", tmp_path / "gpu.json"
    model.write_text(json.dumps({**SMALL, "mlp": "relu"}))
    raw = json.loads(device_files.path_of("h200").read_text())
    raw["hbm"]["gbps"] = "fast"
    device.write_text(json.dumps(raw))
    for argv, field in ((["--model", str(model), "--device", "h200"], "field mlp"),
                        (["--device", str(device)], "field hbm.gbps")):
        done = subprocess.run([sys.executable, "07_choosing_a_layout/choose_layout.py", *argv], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        said = (done.stdout + done.stderr).strip()
        assert done.returncode == 2 and said.count("\n") == 0 and field in said, said
