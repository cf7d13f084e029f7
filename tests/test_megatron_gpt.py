"""GPT-3 as Megatron-LM built it, in chapter 07's time model: a whole-block recomputation's collectives, the
pipeline's scatter-gather sends, a GPT's biases, dropout and tied head, the optimizer's other passes, and the
published runs' quick predictions against the committed table."""
import json
from dataclasses import replace
from importlib import import_module

import pytest

from common.comm import collective_bytes
from common.errors import ConfigError
from common.model import PRESETS

block_time = import_module("07_choosing_a_layout.block_time")
check_layouts = import_module("07_choosing_a_layout.check_layouts")
device_files = import_module("07_choosing_a_layout.device_files")
layout_costs = import_module("07_choosing_a_layout.layout_costs")
layout_inputs = import_module("07_choosing_a_layout.layout_inputs")
pipeline_stages = import_module("03_pipeline_parallel.pipeline_stages")
predict_published = import_module("07_choosing_a_layout.predict_published")
published = import_module("07_choosing_a_layout.published")
schedule_costs = import_module("07_choosing_a_layout.schedule_costs")
step_time = import_module("07_choosing_a_layout.step_time")
tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")

GPT3 = layout_inputs.model_for("gpt3-175b")


def tp_bytes(cfg, sp: bool, mode: str, recomputed=None, n=4, tp=2) -> int:
    """One middle stage's TP bytes of one micro-batch of 2 rows × 64 positions over `n` blocks."""
    return layout_costs.stage_tp_traffic(cfg, 2, 64, tp, sp, n, False, False, 2, True, mode, 1, recomputed)[0]


@pytest.mark.parametrize("sp", [False, True])
def test_a_whole_block_recomputation_reruns_every_collective_of_the_forward(sp):
    """Megatron-LM's full recomputation reruns each block's whole forward, the MLP's g with it; the course's
    checkpoint stops before it. Counted by hand: a dense block's forward is two regions (without SP an
    all-reduce each, with SP an all-gather and a reduce-scatter each)."""
    cfg, tp = PRESETS["tiny"], 2
    act = 2 * 64 * cfg.dim * 2
    region = (collective_bytes("all_gather", act, tp) + collective_bytes("reduce_scatter", act, tp) if sp
              else collective_bytes("all_reduce", act, tp))
    regather = collective_bytes("all_gather", act, tp) if sp else 0
    none = tp_bytes(cfg, sp, "none")
    assert tp_bytes(cfg, sp, "whole-block") - none == 4 * 2 * region
    assert tp_bytes(cfg, sp, "whole-block", recomputed=1) - none == 2 * region
    assert tp_bytes(cfg, sp, "full") - none == 4 * (region + regather)      # the course's early stop
    moe = PRESETS["tiny-moe"]                                               # its experts talk in no TP region
    counts = collective_bytes("all_reduce", 2 * moe.n_experts * 8, tp) if sp else 0
    assert tp_bytes(moe, sp, "whole-block") - tp_bytes(moe, sp, "none") == 4 * (region * moe.dim // cfg.dim + counts)


def test_the_published_full_run_reruns_its_whole_forward_collectives():
    """The GPT-3 run under --full-recompute whole-block: its busiest rank's TP bytes are the course's early stop's
    plus one MLP all-reduce per block and micro-batch."""
    r = published.BY_NAME["gpt3-175b-full"]
    c = layout_costs.Candidate(**r.layout)
    run = layout_costs.Run(GPT3, 64, 2048, "bf16", "unfused", "whole-block")
    specs = schedule_costs.specs_for(GPT3, c.pp, c.virtual_stages, 2048, c.schedule)
    whole = layout_costs.rank_traffic(run, c, specs, 3)[0]["tp"]
    early = layout_costs.rank_traffic(replace(run, full_recompute="early-stop"), c, specs, 3)[0]["tp"]
    blocks = sum(len(s.layers) for s in pipeline_stages.rank_stages(specs, c.pp, 3))
    assert whole - early == 64 * blocks * collective_bytes("all_reduce", 2048 * GPT3.dim * 2, 8)


def test_scatter_gather_sends_a_tp_share_and_gathers_it_at_the_next_stage():
    """--pp-sends scatter-gather (Megatron-LM's): without SP each TP rank sends 1/tp of the activation, and every
    message received is all-gathered over TP; under SP (already split) and without TP nothing changes."""
    cfg = layout_inputs.model_for("llama3-8b")
    run = layout_costs.Run(cfg, 16, 4096, "bf16")
    gathered = replace(run, pp_sends="scatter-gather")
    c = layout_costs.Candidate(tp=4, pp=4, schedule="1f1b", microbatches=8)
    specs = schedule_costs.specs_for(cfg, c.pp, 1, 4096)
    (b0, m0), (b1, m1) = (layout_costs.rank_traffic(r, c, specs, 1) for r in (run, gathered))
    act = 2 * 4096 * cfg.dim * 2                     # two rows a micro-batch, bf16
    assert b0["pp"] == m0["pp"] * act and b1["pp"] == b0["pp"] // 4 and m1["pp"] == m0["pp"]
    received = m0["pp"] // 2
    assert b1["tp"] - b0["tp"] == received * collective_bytes("all_gather", act, 4) and m1["tp"] - m0["tp"] == received
    for same in (replace(c, sequence_parallel=True), replace(c, tp=1)):
        assert layout_costs.rank_traffic(run, same, specs, 1) == layout_costs.rank_traffic(gathered, same, specs, 1)
    dev = layout_inputs.device_for("h100", "bf16", 32)
    wide = replace(c, dp=2)                           # pp spans 16 ranks: its sends cross nodes, the gathers do not
    steps = [layout_costs.predict(r, wide, dev, 8)["time_parts_s"] for r in (run, gathered)]
    assert steps[1]["comm_pp"] < steps[0]["comm_pp"] / 3 and steps[1]["comm_tp"] > steps[0]["comm_tp"]


def test_a_gpts_biases_dropout_and_tied_head_cost_what_they_move():
    """GPT-3's biases: each weight gradient reads its output's gradient again (bias·e bytes); its dropout: a
    one-byte mask beside each residual add; its tied head: one all-reduce of the embedding's fp32 gradient
    between the two ends of a pipeline, none without a pipeline or a tie, or where a V puts both ends on one
    rank. A Llama has none of them."""
    assert GPT3.bias and GPT3.dropout and GPT3.tied_embeddings
    plain = replace(GPT3, bias=False, dropout=False, tied_embeddings=False)
    s = block_time.Shape(2048, 2048, 8, False, 1, 2, "unfused")
    gpt, bare = ({op.name: op for op in block_time.block_backward(block_time.block_forward(m, s))}
                 for m in (GPT3, plain))
    F = GPT3.gelu_hidden // 8
    assert gpt["mlp up weight gradient"].nbytes - bare["mlp up weight gradient"].nbytes == 2048 * F * 2
    assert gpt["mlp down weight gradient"].nbytes - bare["mlp down weight gradient"].nbytes == 2048 * GPT3.dim * 2
    assert gpt["qkv input gradient"].nbytes == bare["qkv input gradient"].nbytes
    g, b = ({op.name: op for op in block_time.block_forward(m, s)} for m in (GPT3, plain))
    assert g["residual 1"].nbytes - b["residual 1"].nbytes == 2048 * GPT3.dim             # without SP: every token
    llama = layout_inputs.model_for("llama3-8b")
    assert not any(block_time.gpt_piece(llama, piece) for piece in ("bias", "dropout", "tied_embeddings"))
    dev = layout_inputs.device_for("a100", "bf16", 64)
    run = layout_costs.Run(GPT3, 64, 2048, "bf16")
    c = layout_costs.Candidate(tp=8, pp=8, microbatches=64)
    tied = step_time.tied_seconds(run, c, dev, 64, 8)
    nbytes = 2 * (GPT3.vocab_size // 8) * GPT3.dim * 4
    assert tied == pytest.approx(nbytes / 2 / dev.spec.tiers[1].rate + dev.spec.tiers[1].latency)
    assert step_time.tied_seconds(run, replace(c, pp=1), dev, 1, 8) == 0
    v_shape = replace(c, schedule="zb-v", virtual_stages=2)                    # both ends on rank 0
    assert step_time.tied_seconds(run, v_shape, dev, 64, 8) == 0
    assert step_time.tied_seconds(run, replace(c, schedule="interleaved", virtual_stages=3), dev, 64, 8) == tied
    assert step_time.tied_seconds(replace(run, cfg=plain), c, dev, 64, 8) == 0


def test_the_optimizer_reads_the_gradients_for_the_clip_and_zeroes_them():
    """AdamW's pass (30 bytes a parameter of the shard), the clip's norm (the shard's fp32 gradients) and zeroing
    every gradient the rank holds (the full buffers under ZeRO-1 and 2 until their reduce-scatter)."""
    dev = layout_inputs.device_for("h100", "bf16", 8)
    run = layout_costs.Run(layout_inputs.model_for("llama3-8b"), 16, 4096, "bf16")
    op = dev.spec.op_seconds
    for zero, shard in ((0, 1000.0), (1, 125.0), (2, 125.0)):
        c = layout_costs.Candidate(dp=8, zero_stage=zero)
        want = op("vector", 10 * shard, 30 * shard) + op("vector", 2 * shard, 4 * shard) + op("vector", 0, 4 * 1000)
        assert step_time.optimizer_seconds(run, c, dev, 1000, 0) == pytest.approx(want), zero


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_gpt_piece_of_a_model_file_must_be_true_or_false(tmp_path, value):
    path = tmp_path / "gpt.json"
    small = {"vocab_size": 1024, "dim": 512, "n_layers": 4, "n_heads": 8, "ffn_hidden": 1536, "max_seq_len": 1024}
    path.write_text(json.dumps({**small, "bias": True, "dropout": value}))
    with pytest.raises(ConfigError, match=f"field dropout must be true or false, got {value!r}"):
        layout_inputs.model_for(str(path))
    path.write_text(json.dumps({**small, "mlp": "gelu", "bias": True, "tied_embeddings": True}))
    mine = layout_inputs.model_for(str(path))
    assert mine.bias and mine.tied_embeddings and not mine.dropout


def test_the_quick_predictions_are_the_committed_tables():
    """predict_published.py's forms (stated by hand, for seconds instead of minutes) are the ones the committed
    published table ranks best: the same prediction, to the table's digits."""
    rows = {line.split(" (")[0][2:]: line.split(" | ")
            for line in (check_layouts.RESULTS / "layouts_published.md").read_text().splitlines()
            if line.startswith("| ") and " (" in line}
    for name in predict_published.FORMS:
        r, args = predict_published.predict(name)
        run = published.BY_NAME[name]
        if "mfu" in run.measured:
            said = f"{published.mfu_as_published(run, r, layout_inputs.model_for(args.model), args.seq_len):.1%}"
        else:
            said = f"{r['step_time_s']:.2f} s"
        assert rows[name][3] == said, (name, rows[name][3], said)
