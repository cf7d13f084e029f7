"""The layout planner's step time on this CPU (07_choosing_a_layout/calibrate_cpu.py): the committed
calibration is the fit of the committed measured runs, the planner's step time is that model, and it puts
the runs in their measured order (Spearman ρ ≥ 0.9) with every step time within 2× of the measured, on the
runs it was fitted on and on chapter 06's, which it never saw. These read committed tables: no timing here.
On a GPU, chapter 01's per-unit ZeRO-3 hides each unit's gather under the compute of the unit before."""
import json
from importlib import import_module

import pytest

from common.model import PRESETS

calibrate_cpu = import_module("07_choosing_a_layout.calibrate_cpu")
check_layouts = import_module("07_choosing_a_layout.check_layouts")
check_published = import_module("07_choosing_a_layout.check_published")
layout_costs = import_module("07_choosing_a_layout.layout_costs")
per_unit_zero = import_module("07_choosing_a_layout.per_unit_zero")
schedule_costs = import_module("07_choosing_a_layout.schedule_costs")
layout_inputs = import_module("07_choosing_a_layout.layout_inputs")

MODEL = json.loads(calibrate_cpu.MODEL_FILE.read_text())
COEF = (MODEL["seconds_per_flop"], MODEL["seconds_per_call"], MODEL["seconds_per_byte"])


def calibrated_cpu(world: int):
    """The planner's CPU device with the committed calibration, whatever this machine's CPU is called."""
    return layout_inputs.Device("cpu", 2 ** 34, 1 / COEF[0], 1e9, 1e9, 0.0, 0.0, cores=calibrate_cpu.CORES,
                                efficiency=1.0, call_s=COEF[1], byte_s=COEF[2])


def test_the_committed_calibration_is_the_fit_of_the_committed_runs():
    assert calibrate_cpu.fit(calibrate_cpu.bench_3d_runs()) == pytest.approx(COEF, rel=1e-9)
    assert len(calibrate_cpu.bench_3d_runs()) == 11 and len(calibrate_cpu.time_cp_runs()) == 9


def test_the_planner_step_time_is_the_calibrated_model():
    """Each run's step from the planner's own predict() equals the fitted model's, compute and messages."""
    for name, layout, _ in calibrate_cpu.bench_3d_runs() + calibrate_cpu.time_cp_runs():
        world = layout["dp"] * layout["tp"] * layout["pp"] * layout["cp"]
        run = layout_costs.Run(PRESETS[layout["model"]], layout["batch"], layout["seq"], "fp32")
        c = layout_costs.Candidate(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], cp=layout["cp"],
                                   microbatches=layout["m"])
        got = layout_costs.predict(run, c, calibrated_cpu(world), world)
        assert got["step_time_s"] == pytest.approx(calibrate_cpu.predict(COEF, layout), rel=1e-9), name
        assert got["step_time_s"] == pytest.approx(sum(got["time_parts_s"].values()), rel=1e-12), name


@pytest.mark.parametrize("runs", ["bench_3d_runs", "time_cp_runs"])
def test_order_and_every_step_within_2x(runs):
    points = [(name, calibrate_cpu.predict(COEF, layout), t) for name, layout, t in getattr(calibrate_cpu, runs)()
              if layout["dp"] * layout["tp"] * layout["pp"] * layout["cp"] > 1 or runs == "time_cp_runs"]
    rho = check_layouts.spearman([p for _, p, _ in points], [t for *_, t in points])
    assert rho >= 0.9, (runs, rho)
    for name, predicted, measured in points:
        assert 0.5 <= predicted / measured <= 2, (name, predicted, measured)


def test_only_replans_one_published_row_and_the_committed_one_is_current(tmp_path):
    """`check_layouts.py --only NAME` plans one published run again and replaces its row, no other: here a
    stale row is put back as the planner gives it today, which is the committed table's row."""
    committed = (check_layouts.RESULTS / "layouts_published.md").read_text().splitlines()
    name = "torchtitan-llama3-8b"                                   # the quickest to plan (seconds)
    mine = next(i for i, row in enumerate(committed) if row.startswith(f"| {name} ("))
    stale = committed[:mine] + [f"| {name} (h100) | stale |"] + committed[mine + 1:]
    path = tmp_path / "layouts_published.md"
    path.write_text("\n".join(stale) + "\n")
    line = check_published.replace_published_line(name, path)
    assert path.read_text().splitlines() == committed and line == committed[mine]


def test_per_unit_zero3_hides_each_gather_under_the_unit_before():
    """Data parallelism alone under ZeRO-3 (chapter 01's per-unit form) on a GPU: each unit's gather travels
    while the unit before computes, so the exposed dp time is the first unit's share, or what the compute
    cannot cover; the grid's ZeRO-3 (tp 2) hides nothing without a bubble. The step is still the sum."""
    h100 = layout_inputs.device_for("h100", "bf16", 8)
    for run in (layout_costs.Run(PRESETS["tiny"], 16, 128, "bf16"),                         # the gathers outlast it
                layout_costs.Run(layout_inputs.model_for("llama3-8b"), 16, 8192, "bf16")):  # the compute covers them
        units = len(per_unit_zero.unit_params(run.cfg))
        for c in (layout_costs.Candidate(dp=8, zero_stage=3, microbatches=2),
                  layout_costs.Candidate(dp=4, tp=2, zero_stage=3, microbatches=2)):
            r = layout_costs.predict(run, c, h100, 8)
            parts = r["time_parts_s"]
            nbytes, msgs = layout_costs.rank_traffic(run, c, schedule_costs.specs_for(run.cfg, 1, 1, run.seq_len))
            rate, latency = layout_costs.link_of("dp", c, h100, 8)
            seconds = nbytes["dp"] / rate + msgs["dp"] * latency
            want = max(seconds / units, seconds - parts["compute"] - parts["memory"]) if c.tp == 1 else seconds
            assert parts["comm_dp"] == pytest.approx(want, rel=1e-12), c
            assert r["step_time_s"] == pytest.approx(sum(parts.values()), rel=1e-12), c
