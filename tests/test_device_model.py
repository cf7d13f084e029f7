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
from common.mfu import matmul_params
from common.model import count_parameters

ROOT = Path(__file__).resolve().parents[1]
block_time = import_module("07_choosing_a_layout.block_time")
choose_layout = import_module("07_choosing_a_layout.choose_layout")
device_files = import_module("07_choosing_a_layout.device_files")
framework_flags = import_module("07_choosing_a_layout.framework_flags")
layout_costs = import_module("07_choosing_a_layout.layout_costs")
layout_inputs = import_module("07_choosing_a_layout.layout_inputs")
model_files = import_module("07_choosing_a_layout.model_files")
published = import_module("07_choosing_a_layout.published")
runnable = import_module("07_choosing_a_layout.runnable")

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


def test_a_whole_block_recomputation_reruns_the_down_projection_too():
    """--full-recompute whole-block (Megatron-LM's): each recomputed block's whole forward again, exactly what
    the course's early stop leaves out (the down projection and the last residual) more."""
    dev = device_files.load("a100", "bf16")
    s = block_time.Shape(2048, 2048, 8, False, 1, 2, "unfused")
    fwd = block_time.block_forward(GPT3, s)
    assert block_time.rerun(fwd, "whole-block") == fwd
    early, whole = (block_time.seconds(block_time.microbatch_ops(GPT3, s, 4, 3, mode, False, False), dev)
                    for mode in ("full", "whole-block"))
    left_out = [op for op in fwd if op.name in ("mlp down", "residual 2")]
    assert whole - early == pytest.approx(3 * block_time.seconds(left_out, dev)) and whole > early
    args = choose_layout.parse_args(["--model", "gpt3-175b", "--world", "64", "--device", "a100", "--dtype", "bf16",
                                     "--global-batch", "64", "--seq-len", "2048", "--full-recompute", "whole-block"])
    run = layout_costs.Run(GPT3, 64, 2048, "bf16", "flash", args.full_recompute)
    c = layout_costs.Candidate(tp=8, pp=8, recompute="full", schedule="interleaved", virtual_stages=3, microbatches=64)
    dev64 = layout_inputs.device_for("a100", "bf16", 64)
    steps = {r.full_recompute: layout_costs.predict(r, c, dev64, 8)["step_time_s"]
             for r in (run, replace(run, full_recompute="early-stop"))}
    assert steps["whole-block"] > steps["early-stop"]
    none = layout_costs.predict(run, replace(c, recompute="none"), dev64, 8)["step_time_s"]
    assert layout_costs.predict(run, replace(c, recompute="selective"), dev64, 8)["step_time_s"] < steps["whole-block"]
    assert none < steps["early-stop"]


def test_a_published_mfu_is_compared_as_its_authors_count_it():
    """Llama 3's MFU is PaLM's (attention's whole square): the same step, the model's FLOPs with 12·L·S·D of
    attention instead of the course's causal 6·L·S·D; a run counted as the course counts is left as it is."""
    cfg, row = layout_inputs.model_for("llama3-405b"), {"mfu": 0.30}
    run = published.BY_NAME["llama3-405b-131k"]
    n = 6 * matmul_params(cfg)
    square = 12 * cfg.n_layers * 131072 * cfg.dim
    assert published.mfu_as_published(run, row, cfg, 131072) == pytest.approx(0.30 * (n + square) / (n + square / 2))
    assert published.mfu_as_published(published.BY_NAME["gpt3-175b-full"], row, GPT3, 2048) == 0.30


def test_the_all_gather_s_collectives_are_exposed_where_the_ring_hides_its_hops():
    """--cp-attention allgather on 16 H100 at 32K: fewer bytes than the ring (K/V gathered once, kept for
    backward), all of them on the critical path, and every rank's K/V among its activations."""
    cfg = layout_inputs.model_for("llama3-8b")
    run = layout_costs.Run(cfg, 16, 32768, "bf16")
    dev = layout_inputs.device_for("h100", "bf16", 16)
    ring = layout_costs.predict(run, layout_costs.Candidate(dp=2, tp=2, cp=4, zero_stage=1, microbatches=8,
                                                            sequence_parallel=True), dev, 8)
    gathered = layout_costs.predict(run, layout_costs.Candidate(dp=2, tp=2, cp=4, zero_stage=1, microbatches=8,
                                                                sequence_parallel=True, cp_attention="allgather"),
                                    dev, 8)
    assert gathered["comm_bytes"]["cp"] < ring["comm_bytes"]["cp"]
    assert ring["time_parts_s"]["comm_cp"] == 0 < gathered["time_parts_s"]["comm_cp"]
    # one micro-batch in flight (no pipeline) of 1 row, S/cp positions: bf16 K and V of the 3 other ranks per layer
    kv = 3 * 2 * 2 * cfg.kv_heads_per_rank(2) * cfg.head_dim * (32768 // 4) * cfg.n_layers
    assert gathered["memory_bytes"]["peak_activation_bytes"] - ring["memory_bytes"]["peak_activation_bytes"] == kv
    assert "--cp-attention allgather" in " ".join(runnable.flags(layout_costs.Candidate.of_row(gathered), "llama3-8b",
                                                                 cfg, 16, 32768, "bf16"))
    assert "--cp-comm-type allgather" in framework_flags.megatron(gathered, cfg, 16, 32768)
    assert "context_parallel_rotate_method allgather" in framework_flags.torchtitan(gathered, 16, 32768)


def test_a_gpu_step_takes_the_collectives_of_its_busiest_pipeline_rank():
    """Under ZB-V rank 0 holds both ends of the model and the fewest blocks: the step's compute is another
    rank's, and so are its TP and CP collectives (more than rank 0's, which the row's comm_bytes keeps: the
    metrics' rank). Under the interleaved loop the busiest is rank 0 itself."""
    cfg = layout_inputs.model_for("llama3-8b")                                  # 32 layers
    run = layout_costs.Run(cfg, 64, 8192, "bf16")
    dev = layout_inputs.device_for("h100", "bf16", 64)
    schedule_costs = import_module("07_choosing_a_layout.schedule_costs")
    step_time = import_module("07_choosing_a_layout.step_time")
    v_shape = layout_costs.Candidate(dp=2, tp=4, pp=4, cp=2, zero_stage=1, sequence_parallel=True, schedule="zb-v",
                                     virtual_stages=2, microbatches=8, cp_attention="allgather")
    busiest_of = {}
    for c in (v_shape, replace(v_shape, schedule="interleaved")):
        r = layout_costs.predict(run, c, dev, 8)
        specs = schedule_costs.specs_for(cfg, c.pp, c.virtual_stages, run.seq_len, c.schedule)
        busiest, msgs = layout_costs.rank_traffic(run, c, specs, r["busiest_pp_rank"])
        assert r["comm_bytes"] == layout_costs.rank_traffic(run, c, specs)[0]
        for g in ("tp", "cp"):
            tier = step_time.tier_of(step_time.spans(c)[g], 8, dev.spec)
            assert r["time_parts_s"][f"comm_{g}"] == step_time.link_seconds(busiest[g], msgs[g], tier), (c.schedule, g)
        busiest_of[c.schedule] = r["busiest_pp_rank"], busiest["tp"] / r["comm_bytes"]["tp"]
    assert busiest_of["interleaved"] == (0, 1.0)
    rank, more = busiest_of["zb-v"]
    assert rank != 0 and more > 1.1, busiest_of


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


def test_the_chapter_s_model_of_one_s_own_is_a_13b():
    """models/my-13b.json, the README's model of one's own (planned there on 64 H200): Llama 2 13B's shape,
    13.0B parameters as the planner counts them."""
    cfg = layout_inputs.model_for(str(ROOT / "07_choosing_a_layout" / "models" / "my-13b.json"))
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden) == (5120, 40, 40, 40, 13824)
    assert count_parameters(cfg) == pytest.approx(13.0e9, rel=0.01)


def test_the_explained_layout_as_megatron_and_torchtitan_flags():
    r = {"dp": 1, "tp": 8, "pp": 8, "cp": 1, "ep": 1, "zero_stage": 0, "recompute": "selective",
         "recompute_layers": None, "sequence_parallel": True, "schedule": "interleaved", "virtual_stages": 3,
         "microbatches": 64}
    flags = framework_flags.megatron(r, GPT3, 64, 2048)
    assert flags == ("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 "
                     "--num-layers-per-virtual-pipeline-stage 4 --sequence-parallel --recompute-granularity "
                     "selective --micro-batch-size 1 --global-batch-size 64 --seq-length 2048")
    # without SP Megatron-LM scatters and gathers its sends unless told not to: the course's whole sends say so
    full = {**r, "sequence_parallel": False, "recompute": "full"}
    no_sg = "--no-scatter-gather-tensors-in-pipeline"
    assert no_sg in framework_flags.megatron(full, GPT3, 64, 2048)
    assert no_sg not in framework_flags.megatron(full, GPT3, 64, 2048, "scatter-gather")
    assert no_sg not in flags and no_sg not in framework_flags.megatron({**full, "pp": 1}, GPT3, 64, 2048)
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
