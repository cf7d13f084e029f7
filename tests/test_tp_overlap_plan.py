"""Chapter 07's --tp-overlap (chapter 02's rings under the chunk matmuls): the GPU model's exposed TP time ring by
ring (tp_rings.py), the row that carries it, --explain's `tpo` field and the command that runs it. One process."""
import json
from dataclasses import replace
from importlib import import_module

import pytest

from common.errors import ConfigError

block_time = import_module("07_choosing_a_layout.block_time")
choose_layout = import_module("07_choosing_a_layout.choose_layout")
layout_costs = import_module("07_choosing_a_layout.layout_costs")
layout_inputs = import_module("07_choosing_a_layout.layout_inputs")
runnable = import_module("07_choosing_a_layout.runnable")
step_time = import_module("07_choosing_a_layout.step_time")


def test_overlap_hides_the_rings_under_their_chunks_as_the_formula_says():
    """llama3-8b on 8 H100, tp 8 with SP, one stage, one micro-batch: the overlapped TP part is below the plain
    one, and equals it less the 10 rings of each block and the head's 3 collectives, plus (N − 1)·max(0, t_hop −
    t_chunk) of each ring, written out here from block_time's matmuls and step_time.link_seconds."""
    cfg, dev = layout_inputs.model_for("llama3-8b"), layout_inputs.device_for("h100", "bf16", 8, None)
    run = layout_costs.Run(cfg, 8, 8192, "bf16")
    c = layout_costs.Candidate(dp=1, tp=8, sequence_parallel=True, microbatches=1)
    plain = layout_costs.predict(run, c, dev, 8)
    overlapped = layout_costs.predict(run, replace(c, tp_overlap=True), dev, 8)
    n, tier = 8, dev.spec.tiers[0]
    s = block_time.Shape(8 * 8192, 8192, n, True, 1, 2)
    act = s.tokens * cfg.dim * 2
    secs = {op.name: block_time.op_seconds(op, dev.spec) for op in block_time.block_forward(cfg, s)
            + block_time.head_forward(cfg, s)}
    back = {op.name: block_time.op_seconds(op, dev.spec) for op in
            block_time.block_backward(block_time.block_forward(cfg, s) + block_time.head_forward(cfg, s)[:-1])}
    grads = {k: back[f"{k} input gradient"] + back[f"{k} weight gradient"] for k in ("qkv", "out", "mlp up", "mlp down", "lm head")}
    hop1 = step_time.link_seconds(2 * act / n, 1, tier)          # one chunk, sent and received
    hop2 = step_time.link_seconds(4 * act / n, 2, tier)          # the entrance's backward: two chunks a hop
    ring = lambda hop, matmul: (n - 1) * max(0.0, hop - matmul / n)
    block = (sum(ring(hop1, secs[k]) for k in ("qkv", "out", "mlp up", "mlp down"))
             + ring(hop2, grads["qkv"]) + ring(hop2, grads["mlp up"]) + ring(hop1, grads["out"]) + ring(hop1, grads["mlp down"]))
    head = ring(hop1, secs["lm head"]) + ring(hop2, grads["lm head"])
    one_collective = step_time.link_seconds(2 * int((n - 1) / n * act), 1, tier)
    expected = plain["time_parts_s"]["comm_tp"] - (10 * cfg.n_layers + 3) * one_collective + cfg.n_layers * block + head
    assert overlapped["time_parts_s"]["comm_tp"] == pytest.approx(expected, rel=1e-9)
    assert overlapped["time_parts_s"]["comm_tp"] < plain["time_parts_s"]["comm_tp"]
    assert overlapped["tp_overlap"] and not plain["tp_overlap"]
    assert overlapped["comm_bytes"] == plain["comm_bytes"] and overlapped["time_parts_s"]["compute"] == plain["time_parts_s"]["compute"]


def test_the_cpu_model_charges_overlap_as_plain():
    """On the calibrated CPU (gloo shares the cores: chapter 02 measured no gain) overlap changes nothing."""
    run = layout_costs.Run(layout_inputs.model_for("tiny"), 16, 128, "fp32")
    dev = layout_inputs.device_for("cpu", "fp32", 4, None)
    c = layout_costs.Candidate(dp=2, tp=2, sequence_parallel=True, microbatches=2)
    assert layout_costs.predict(run, replace(c, tp_overlap=True), dev, 8)["time_parts_s"] == \
        layout_costs.predict(run, c, dev, 8)["time_parts_s"]


def test_explain_tpo_plans_the_overlapped_twin_its_row_and_command_carry_it(tmp_path, capsys):
    out = tmp_path / "rows.json"
    choose_layout.main(["--model", "tiny", "--world", "4", "--device", "h100", "--dtype", "bf16", "--top", "1",
                        "--why", "1", "--json", str(out), "--explain", "dp=2,tp=2,sp,tpo,m=2"])
    text = capsys.readouterr().out
    assert "+SP (overlapped)" in text and "--sequence-parallel --tp-overlap" in text
    assert "--tp-comm-overlap" in text and "enable_async_tensor_parallel" in text
    rows = json.loads(out.read_text())
    twins = [r for r in rows if r["tp_overlap"]]
    assert twins and all(r["sequence_parallel"] for r in twins) and all("tp_overlap" in r for r in rows)
    c = layout_costs.Candidate.of_row(twins[0])
    assert c.tp_overlap and "--tp-overlap" in runnable.command(c, "tiny", layout_inputs.model_for("tiny"), 16, 128)
    # the scripts are asked with the flag: without SP they refuse it, in their own words
    assert "add --sequence-parallel" in runnable.refusal(replace(c, sequence_parallel=False), "tiny",
                                                          layout_inputs.model_for("tiny"), 16, 128)


@pytest.mark.parametrize("field", ["tp=2,tpo", "tpo"])
def test_tpo_without_sp_is_refused_in_one_line_naming_it(field):
    with pytest.raises(ConfigError, match=r"--explain.*tpo without sp.*write sp,tpo"):
        choose_layout.parse_args(["--explain", field])
