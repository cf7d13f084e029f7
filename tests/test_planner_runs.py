"""The planner's numbers (07_choosing_a_layout/choose_layout.py) against runs of chapter 06's 5D script where
chapter 04's calibration runs never go: context parallelism (cp 2 and 4) and experts under every ZeRO stage.
One group of four ranks runs them all; each run's last step is read against the planner's row for its layout:

  - AdamW's bytes and what a rank holds between steps, to the byte: dense state sharded over dp × cp, the
    experts' over edp × cp (dp 2 = edp 1 × ep 2, cp 2; ZeRO-1, 2, 3);
  - the working set beyond the ledger (what every tensor of rank 0 holds at the peak, less its weights,
    gradients, AdamW and measured activations) at cp 2, where a micro-batch holds S/cp positions, and the
    peak of a dense run under ZeRO-0, which is the gradient sync's (the gradients' all-reduce copy);
  - each group's bytes, and the ring's messages: one per tensor a ring hop carries (the forward's K and V,
    the backward's K and V and the partial sums of their gradients), counted on rank 0 (planner_runs.py);
  - the all-gather variant (--cp-attention allgather): its bytes, its collectives, and the activations its
    gathered K/V add, against the ring's;
  - the bf16 ledger where the dimensions meet: TP 2 with SP under CP 2, a 2-stage pipeline under CP 2, and all
    three at once (a group of eight ranks of its own)."""
from dataclasses import fields
from importlib import import_module

import pytest

from common import activation_ledger
from common.model import PRESETS
from harness import ok, run_group

choose_layout = import_module("07_choosing_a_layout.choose_layout")
planner = import_module("07_choosing_a_layout.planner")
layout_costs = import_module("07_choosing_a_layout.layout_costs")
schedule_costs = import_module("07_choosing_a_layout.schedule_costs")
explain_layout = import_module("07_choosing_a_layout.explain_layout")

FIVE = "planner_runs:run_counting_messages"
BATCH, SEQ = 8, 64
RUN = ["--global-batch", str(BATCH), "--seq-len", str(SEQ), "--steps", "2", "--microbatches", "2", "--pp", "1",
       "--tp", "1", "--quiet", "--sample-tokens", "0", "--val-every", "0"]
EXPERTS = ["--model", "tiny-moe", "--dp", "2", "--ep", "2", "--cp", "2"]
# name -> (model, layout fields the planner's row must have, flags, every tensor counted)
RUNS = {**{f"experts ZeRO-{z}": ("tiny-moe", dict(dp=2, ep=2, cp=2, zero_stage=z), EXPERTS + ["--zero-stage", str(z)],
                                 z == 1) for z in (1, 2, 3)},
        "cp 2": ("tiny", dict(dp=2, ep=1, cp=2, zero_stage=0), ["--model", "tiny", "--dp", "2", "--cp", "2"], True),
        "cp 4": ("tiny", dict(dp=1, ep=1, cp=4, zero_stage=0), ["--model", "tiny", "--dp", "1", "--cp", "4"], False),
        "cp 2 allgather": ("tiny", dict(dp=2, ep=1, cp=2, zero_stage=0, cp_attention="allgather"),
                           ["--model", "tiny", "--dp", "2", "--cp", "2", "--cp-attention", "allgather"], True),
        "bf16 tp 2 +SP × cp 2": ("tiny", dict(tp=2, cp=2), ["--model", "tiny", "--dp", "1", "--tp", "2", "--cp", "2",
                                                          "--sequence-parallel", "--dtype", "bf16"], False),
        "bf16 pp 2 × cp 2": ("tiny", dict(pp=2, cp=2), ["--model", "tiny", "--dp", "1", "--pp", "2", "--cp", "2",
                                                      "--dtype", "bf16"], False)}


@pytest.fixture(scope="module")
def runs():
    jobs = [(FIVE, "06_context_parallel.train_5d", RUN + flags, measure) for _, _, flags, measure in RUNS.values()]
    return {name: ok(result) for name, result in zip(RUNS, run_group(4, jobs, timeout_s=900))}


def planner_row(model: str, layout: dict) -> dict:
    """The planner's row for `layout` on 4 CPU ranks (one stage, 1F1B, 2 micro-batches, no recomputation)."""
    rows = planner.plan(choose_layout.parse_args(["--model", model, "--world", "4", "--device", "cpu",
                                                  "--global-batch", str(BATCH), "--seq-len", str(SEQ),
                                                  "--cp-attention", layout.get("cp_attention", "ring")])).rows
    want = dict(layout, tp=1, pp=1, microbatches=2, recompute="none", recompute_layers=None, sequence_parallel=False)
    (row,) = [r for r in rows if all(r[k] == v for k, v in want.items())]
    return row


def planner_messages(model: str, row: dict) -> dict:
    """{group: messages} the planner counts on rank 0 for `row` in one step (what its step time charges)."""
    c = layout_costs.Candidate(**{f.name: row[f.name] for f in fields(layout_costs.Candidate)})
    run = layout_costs.Run(PRESETS[model], BATCH, SEQ, "fp32")
    return layout_costs.rank_traffic(run, c, schedule_costs.specs_for(run.cfg, c.pp, c.virtual_stages, SEQ))[1]


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_experts_state_under_each_zero_stage_is_the_runs(runs, stage):
    """AdamW's moments: dense over dp × cp = 4 ranks, experts over edp × cp = 2; held between steps per stage."""
    model, layout, _, _ = RUNS[f"experts ZeRO-{stage}"]
    rows, _ = runs[f"experts ZeRO-{stage}"]
    last, mem = rows[-1], planner_row(model, layout)["memory_bytes"]
    assert mem["optim_bytes"] == last["optim_bytes"]
    assert mem["held_between_steps"] == last["param_bytes"] + last["grad_bytes"] + last["optim_bytes"]


def measured_working_set(runs: dict, name: str) -> tuple[float, float]:
    """(the planner's working set, the run's): every tensor of rank 0 at the step's peak, less what the
    planner predicts apart (weights, gradients, AdamW) and the activations the run measured."""
    model, layout, _, _ = RUNS[name]
    rows, _ = runs[name]
    last = rows[-1]
    beyond = last["live_peak_bytes"] - last["param_bytes"] - last["grad_bytes"] - last["optim_bytes"] \
        - max(last["peak_activation_bytes"])
    return planner_row(model, layout)["memory_bytes"]["working"], beyond


def test_the_working_set_at_cp_2_is_the_runs(runs):
    """Experts at cp 2: a micro-batch's S/cp positions, within 20 %; ZeRO-1 copies no gradient (its flat
    buffers are the gradients), so the backward is the peak: the total within 6 %."""
    predicted, measured = measured_working_set(runs, "experts ZeRO-1")
    assert predicted == pytest.approx(measured, rel=0.2), (predicted, measured)
    model, layout, _, _ = RUNS["experts ZeRO-1"]
    mem = planner_row(model, layout)["memory_bytes"]
    assert mem["gradient_copy"] == 0 and "gradient sync" not in explain_layout.memory_words(mem)
    assert mem["total"] == pytest.approx(runs["experts ZeRO-1"][0][-1]["live_peak_bytes"], rel=0.06)


def test_a_dense_ring_peaks_at_the_gradient_sync_as_the_planner_says(runs):
    """Dense at cp 2, ZeRO-0: after the last backward the replicated optimizer copies every gradient into its
    all-reduce bucket (the activations freed by then), and that copy is the step's peak, larger than the
    backward's activations and working set: the planner's total within 1 % of the run's, the copy its larger
    moment, and the copy the run's gradient bytes exactly."""
    model, layout, _, _ = RUNS["cp 2"]
    rows, _ = runs["cp 2"]
    last, mem = rows[-1], planner_row(model, layout)["memory_bytes"]
    assert mem["gradient_copy"] == last["grad_bytes"]
    assert mem["gradient_copy"] > mem["peak_activation_bytes"] + mem["working"]
    assert "the peak is the gradient sync's" in explain_layout.memory_words(mem)          # what --explain says
    assert mem["total"] == pytest.approx(last["live_peak_bytes"], rel=0.01), (mem["total"], last["live_peak_bytes"])


@pytest.mark.parametrize("name", ("cp 2", "cp 4"))
def test_each_group_s_bytes_and_the_ring_s_messages_grow_with_cp_as_the_runs(runs, name):
    """Bytes to the byte. Messages: 3 (cp − 1) per layer and micro-batch in a run (the forward's K/V, the
    backward's K/V and the partial sums going on); the planner's count must grow with cp as the run's does."""
    model, layout, _, _ = RUNS[name]
    rows, messages = runs[name]
    row = planner_row(model, layout)
    for group in ("dp", "tp", "pp", "ep", "cp"):
        assert row["comm_bytes"][group] == rows[-1].get(f"comm_bytes_{group}", rows[-1].get(f"comm_bytes_{group}_cp", 0)), group
    cp, hops = layout["cp"], {n: RUNS[n][1]["cp"] - 1 for n in ("cp 2", "cp 4")}
    per_hop = {n: runs[n][1]["cp"] / hops[n] for n in hops}
    predicted = {n: planner_messages(RUNS[n][0], planner_row(RUNS[n][0], RUNS[n][1]))["cp"] / hops[n] for n in hops}
    assert per_hop["cp 2"] == per_hop["cp 4"] == 3 * 2 * PRESETS[model].n_layers, per_hop      # 3 per hop per block, m 2
    assert predicted["cp 2"] == predicted["cp 4"], predicted
    assert messages["cp"] == 3 * (cp - 1) * 2 * PRESETS[model].n_layers


def test_the_planner_counts_the_ring_s_messages_of_a_run(runs):
    """3 (cp − 1) per layer and micro-batch, as the run at cp 4 sends them."""
    model, layout, _, _ = RUNS["cp 4"]
    assert planner_messages(model, planner_row(model, layout))["cp"] == runs["cp 4"][1]["cp"]


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_the_planner_counts_the_messages_of_experts_runs(runs, stage):
    """dp: ZeRO's two collectives per unit of each kind's state a step; ep: per layer and micro-batch the
    forward's counts, dispatch and combine, the backward's dispatch and combine; cp: the ring's and each
    router's all-reduce of its expert counts over cp (messages and bytes)."""
    model, layout, _, _ = RUNS[f"experts ZeRO-{stage}"]
    rows, messages = runs[f"experts ZeRO-{stage}"]
    row = planner_row(model, layout)
    predicted = planner_messages(model, row)
    assert {g: predicted[g] for g in ("dp", "ep", "cp")} == {g: messages.get(g, 0) for g in ("dp", "ep", "cp")}
    assert row["comm_bytes"]["cp"] == rows[-1].get("comm_bytes_cp", 0)


def test_the_all_gather_variant_is_planned_as_it_runs(runs):
    """--cp-attention allgather at cp 2: every group's bytes to the byte; per layer and micro-batch one
    all-gather of K/V and one reduce-scatter of their gradients; each micro-batch's activations as the run
    measured them (both variants: the all-gather keeps every rank's K/V for backward, the ring its own)."""
    activations = {}
    for name in ("cp 2", "cp 2 allgather"):
        model, layout, _, _ = RUNS[name]
        rows, messages = runs[name]
        row = planner_row(model, layout)
        for group in ("dp", "tp", "pp", "ep", "cp"):
            assert row["comm_bytes"][group] == rows[-1].get(f"comm_bytes_{group}",
                                                            rows[-1].get(f"comm_bytes_{group}_cp", 0)), (name, group)
        assert planner_messages(model, row)["cp"] == messages["cp"], name
        activations[name] = row["memory_bytes"]["peak_activation_bytes"], max(rows[-1]["peak_activation_bytes"])
        assert activations[name][0] == pytest.approx(activations[name][1], rel=1e-3), (name, activations[name])
    (ring, ring_run), (gathered, gathered_run) = activations.values()
    assert gathered - ring == gathered_run - ring_run > 0                   # the other rank's K/V, to the byte
    assert runs["cp 2 allgather"][1]["cp"] == 2 * 2 * PRESETS["tiny"].n_layers       # 2 per layer, m 2


def bf16_pipeline_peaks(**layout) -> list[int]:
    """The bf16 ledger's activation peak of each stage of a 2-stage 1F1B run of tiny (2 micro-batches of 4
    sequences, SEQ // cp positions a rank), each micro-batch with its own weight casts, as the meter sees them."""
    cfg = PRESETS["tiny"]
    specs = import_module("03_pipeline_parallel.pipeline_stages").stage_specs(cfg, 2, 1, SEQ)
    plan = import_module("03_pipeline_parallel.pipeline_schedules").build_schedule("1f1b", 2, 2, 1)
    return activation_ledger.pipeline_peaks(cfg, "none", plan, specs, 4, SEQ // layout.get("cp", 1), dtype="bf16",
                                            **layout)


def test_the_bf16_ledger_holds_where_tp_sp_cp_and_a_pipeline_meet(runs):
    """Each rank's measured activation peak against common/activation_ledger's bf16 terms (the planner's own,
    with each micro-batch's weight casts, which the meter sees): TP 2 with SP under CP 2 to the byte, each
    stage of a 1F1B pipeline under CP 2 within 1 KiB (measured: the first exact, the second 1,024 bytes apart,
    CP's 512 per micro-batch as in fp32). 2 micro-batches of 4 sequences, 32 of the 64 positions a CP rank."""
    cfg = PRESETS["tiny"]
    rows, _ = runs["bf16 tp 2 +SP × cp 2"]
    predicted = activation_ledger.microbatch_bytes(cfg, "none", 4, SEQ // 2, cfg.n_layers, tp=2,
                                                   sequence_parallel=True, cp=2, dtype="bf16")
    assert max(rows[-1]["peak_activation_bytes"]) == predicted
    rows, _ = runs["bf16 pp 2 × cp 2"]
    predicted = bf16_pipeline_peaks(cp=2)
    measured = rows[-1]["peak_activation_bytes"]                       # each stage's, as rank 0 gathered them
    assert all(abs(m - p) <= 1024 for m, p in zip(measured, predicted)) and len(measured) == 2, (measured, predicted)


def test_the_bf16_ledger_holds_with_tp_sp_cp_and_a_pipeline_at_once():
    """TP 2 with SP × CP 2 × a 2-stage 1F1B pipeline, bf16, on eight ranks: each stage's activation peak is the
    ledger's to the byte (measured: exact)."""
    argv = RUN + ["--model", "tiny", "--dp", "1", "--tp", "2", "--pp", "2", "--cp", "2", "--sequence-parallel",
                  "--dtype", "bf16"]
    rows, _ = ok(run_group(8, [(FIVE, "06_context_parallel.train_5d", argv, False)])[0])
    assert rows[-1]["peak_activation_bytes"] == bf16_pipeline_peaks(tp=2, sequence_parallel=True, cp=2)
