"""The planner reads a long schedule off its steady part (schedule_costs.steady_microbatches): for every
schedule of chapter 03, each rank's activation peak and pipeline messages at m micro-batches equal
those of the whole schedule of m."""
from importlib import import_module

from common import activation_ledger
from common.model import PRESETS

schedule_costs = import_module("07_choosing_a_layout.schedule_costs")
pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")
pipeline_executor = import_module("03_pipeline_parallel.pipeline_executor")

S = 32


def test_a_long_schedule_has_the_peaks_and_messages_of_its_steady_part():
    cfg = PRESETS["tiny"]                        # 8 layers: up to 8 stages
    checked = 0
    for schedule, v in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2), ("dualpipev", 2)):
        for pp in (2, 3, 4):
            step = pp if schedule == "interleaved" else 1
            for m in range(4 * pp + step, 9 * pp + 1, step):
                assert schedule_costs.steady_microbatches(pp, m) < m
                plan = pipeline_schedules.build_schedule(schedule, pp, m, v)
                specs = schedule_costs.specs_for(cfg, pp, v, S, schedule)
                whole = activation_ledger.pipeline_peaks(cfg, "none", plan, specs, 1, S, dtype="fp32",
                                                         weight_casts=False)
                for r, peak in schedule_costs.activation_peaks(cfg, "none", schedule, pp, m, v, 1, S, S, 1, False):
                    assert peak == whole[r], (schedule, pp, m, r)
                n_stages = len(specs)
                for r in range(pp):
                    assert schedule_costs.rank_messages(schedule, pp, m, v, r) == pipeline_executor.message_count(
                        plan[r], n_stages, pp, pipeline_schedules.placement(plan)), (schedule, pp, m, r)
                checked += 1
    assert checked > 100
