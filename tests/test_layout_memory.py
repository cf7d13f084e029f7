"""The planner's memory against every tensor a run holds (07_choosing_a_layout/calibrate_memory.py): the
committed working set is the fit of the committed runs, each of those runs' rank 0 is predicted within 5 %,
and a run it never saw (one device, measured here now) too; a layout fits a GPU only within its headroom."""
import json
from dataclasses import replace
from importlib import import_module

import pytest

from common.model import PRESETS
from harness import ok, run_group

calibrate_memory = import_module("07_choosing_a_layout.calibrate_memory")
layout_costs = import_module("07_choosing_a_layout.layout_costs")
layout_inputs = import_module("07_choosing_a_layout.layout_inputs")
working_set = import_module("07_choosing_a_layout.working_set")

COMMITTED = json.loads(working_set.COEF_FILE.read_text())


def test_the_committed_working_set_is_the_fit_of_the_committed_runs():
    assert len(COMMITTED["runs"]) == 14 and len(COMMITTED["head_runs"]) == 2
    fitted = (*calibrate_memory.fit(COMMITTED["runs"]), calibrate_memory.fit_head(COMMITTED["head_runs"]))
    assert fitted == pytest.approx(working_set.load(), rel=1e-9)


def test_every_calibration_run_is_predicted_within_5_percent():
    a, b, h = working_set.load()
    for r in COMMITTED["runs"]:
        predicted = calibrate_memory.predicted(r["layout"], (a, b))
        assert predicted == pytest.approx(r["live_peak_bytes"], rel=0.05), calibrate_memory.name(r["layout"])
    for r in COMMITTED["head_runs"]:
        assert calibrate_memory.predicted_head(r["shape"], h) == pytest.approx(r["live_peak_bytes"], rel=0.05)


def test_recomputation_and_zero_which_the_fit_never_saw():
    """Selective and full recomputation (the block rebuilt for its backward), ZeRO-1, 2 and 3 on the grid
    (their full buffers emptied between steps and filled again, their shards kept beside them), each within
    3 % (measured: 2.8 % at most; ZeRO-3 was 4.6 % short while its two shards went uncounted)."""
    a, b, _ = working_set.load()
    assert len(COMMITTED["held_out"]) == 5
    for r in COMMITTED["held_out"]:
        predicted = calibrate_memory.predicted(r["layout"], (a, b))
        assert predicted == pytest.approx(r["live_peak_bytes"], rel=0.03), calibrate_memory.name(r["layout"])
    # what ZeRO-2 and 3 save against the same layout without ZeRO (a fitted run), measured and predicted, within
    # 10 % of the saving (measured: 2.3 % and 4.0 %; a shard left out of the count is 17–20 % off)
    plain = next(r for r in COMMITTED["runs"] if r["layout"] == dict(dp=4, tp=2, pp=1, m=2))
    for r in COMMITTED["held_out"]:
        if r["layout"].get("zero", 0) >= 2:
            saved = plain["live_peak_bytes"] - r["live_peak_bytes"]
            predicted = calibrate_memory.predicted(plain["layout"], (a, b)) - calibrate_memory.predicted(r["layout"], (a, b))
            assert predicted == pytest.approx(saved, rel=0.10), calibrate_memory.name(r["layout"])


def test_a_wide_vocabulary_measured_now_is_the_committed_run():
    """The head's runs are one process each: measured again here, to the byte (no thread, no message)."""
    r = COMMITTED["head_runs"][0]
    assert calibrate_memory.measure_head(r["shape"]) == r["live_peak_bytes"]


def test_one_device_measured_now_is_predicted_within_5_percent():
    """World size 1 (rank 0 holds every weight and the head), a layout the fit never saw."""
    argv = ["--model", "tiny", "--global-batch", "16", "--seq-len", "128", "--microbatches", "2", "--steps", "2",
            "--quiet", "--sample-tokens", "0", "--val-every", "0", "--measure-memory"]
    (res,) = run_group(1, [("04_3d_combined.train_3d:main", argv)])
    measured = ok(res)[-1]["live_peak_bytes"]
    run = layout_costs.Run(PRESETS["tiny"], 16, 128, "fp32")
    c = layout_costs.Candidate(microbatches=2)
    cpu = replace(layout_inputs.device_for("h100", "fp32", 1), cores=2)          # any device whose ranks use gloo
    predicted = layout_costs.predict(run, c, cpu, 1)["memory_bytes"]
    assert predicted["working"] > 0 and predicted["total"] == pytest.approx(measured, rel=0.05)


def test_a_gpu_layout_fits_within_its_headroom():
    run = layout_costs.Run(PRESETS["tiny"], 16, 128, "fp32")
    c = layout_costs.Candidate(microbatches=2)
    total = layout_costs.predict(run, c, layout_inputs.device_for("h100", "fp32", 1), 1)["memory_bytes"]["total"]
    h100 = layout_inputs.device_for("h100", "fp32", 1)
    assert h100.headroom == working_set.HEADROOM > 0
    fits = [layout_costs.predict(run, c, replace(h100, memory=m), 1)["fits"]
            for m in (total / (1 - h100.headroom) * 1.001, total * 1.01)]
    assert fits == [True, False]           # the whole total plus 1 % is not enough: the headroom is kept free
