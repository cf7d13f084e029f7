"""The published runs' step by part on their devices, without planning the whole cluster again.

    python -m 07_choosing_a_layout.predict_published

Each run of published.py in the form results/layouts_published.md ranks best, the levers its paper leaves to
the planner filled in as that table has them, predicted by layout_costs.predict (a GPU: step_time.py's parts).
check_layouts.py --published plans every layout of each cluster; this prints only the published ones (seconds).
"""
import sys
from importlib import import_module
from pathlib import Path

if __package__ in (None, ""):          # run as `python 07_choosing_a_layout/predict_published.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

choose_layout = import_module("07_choosing_a_layout.choose_layout")        # this chapter: the planner's flags
layout_costs = import_module("07_choosing_a_layout.layout_costs")          # this chapter: one layout's costs
layout_inputs = import_module("07_choosing_a_layout.layout_inputs")        # this chapter: models and devices
planner = import_module("07_choosing_a_layout.planner")                    # this chapter: a run's flags
published = import_module("07_choosing_a_layout.published")                # this chapter: the published runs

# The levers each published run's paper leaves to the planner, as results/layouts_published.md has them (its
# best-ranked form of the published layout; tests/test_megatron_gpt.py checks the two agree)
FORMS = {"llama3-405b-8k-8192gpu": dict(recompute="full", virtual_stages=8, microbatches=32),
         "llama3-405b-8k-16384gpu": dict(recompute="full", virtual_stages=8, microbatches=16),
         "llama3-405b-131k": dict(recompute="full", virtual_stages=8, microbatches=16),
         "gpt3-175b-selective": {}, "gpt3-175b-full": {}}


def predict(name: str) -> tuple[dict, dict]:
    """(layout_costs.predict's row, the run's flags) of published run `name` in its form of FORMS."""
    run = published.BY_NAME[name]
    args = choose_layout.parse_args(list(run.argv))
    c = layout_costs.Candidate(**{**run.layout, **FORMS[name]})     # the rest: the Candidate's defaults
    r = layout_costs.predict(planner.run_of(args), c, layout_inputs.device_for(args.device, args.dtype, args.world),
                             args.gpus_per_node)
    return r, args


def main() -> None:
    for name in FORMS:
        run = published.BY_NAME[name]
        r, args = predict(name)
        said = ", ".join(f"{k} {v:.3g}" for k, v in r["time_parts_s"].items() if v)
        theirs = published.mfu_as_published(run, r, layout_inputs.model_for(args.model), args.seq_len)
        counted = f", {theirs:.1%} as the authors count it" if run.mfu_attention != "causal" else ""
        print(f"{name}: {choose_layout.describe(r)}: step {r['step_time_s']:.2f} s, MFU {r['mfu']:.1%}{counted} "
              f"(published {run.measured}); {said}")


if __name__ == "__main__":
    main()
