"""What a framework is known to fit (07_choosing_a_layout/check_published.py): the course's count of the
memory a published run held in the form its source says it ran, taken as a yardstick. Llama 3 ran its 8K
layout without activation checkpointing (§3.3.2), which the course's code would need 156 GiB a GPU for: every
Llama 3 run is ranked again among the layouts that fit by the planner's count or hold no more than that."""
from importlib import import_module
from types import SimpleNamespace

choose_layout = import_module("07_choosing_a_layout.choose_layout")
planner = import_module("07_choosing_a_layout.planner")
published = import_module("07_choosing_a_layout.published")
check_published = import_module("07_choosing_a_layout.check_published")

GIB = 2**30


def stated_form(run) -> dict:
    """The fastest row of `run`'s layout in the form its source states (then the least memory)."""
    forms = planner.plan(choose_layout.parse_args(list(run.argv)), {**run.layout, **run.ran}).rows
    assert forms and all(r["recompute"] == "none" for r in forms)
    return min(forms, key=lambda r: (round(r["step_time_s"], 4), r["memory_bytes"]["total"]))


def test_llama3_is_known_to_fit_what_its_8k_run_held_without_checkpointing():
    """The yardstick of every Llama 3 run is the most either 8K run held as it ran (no recomputation), more
    than an H100's 80 GiB by the course's count; runs whose sources say nothing of the kind have none."""
    eight_k = [published.BY_NAME[n] for n in ("llama3-405b-8k-8192gpu", "llama3-405b-8k-16384gpu")]
    held = {run.name: stated_form(run)["memory_bytes"]["total"] for run in eight_k}
    most = max(held.values())
    assert most > 80 * GIB and min(held.values()) < most              # the larger of two different forms
    for name in ("llama3-405b-8k-8192gpu", "llama3-405b-8k-16384gpu", "llama3-405b-131k"):
        assert check_published.known_to_fit(published.BY_NAME[name]) == (most, max(held, key=held.get)), name
    for name in ("gpt3-175b-selective", "gpt3-175b-full", "deepseek-v3", "torchtitan-llama3-8b"):
        assert check_published.known_to_fit(published.BY_NAME[name]) is None, name


def fake(name: str, fits: bool, gib: float, seconds: float, **fields) -> dict:
    layout = dict(dp=64, tp=8, pp=16, cp=1, zero_stage=2, sequence_parallel=True, schedule="interleaved",
                  virtual_stages=7, microbatches=32, ep=1, recompute="none", recompute_layers=None,
                  cp_attention="ring", tp_overlap=False)
    return {**layout, **fields, "name": name, "fits": fits, "memory_bytes": {"total": gib * GIB},
            "step_time_s": seconds, "mfu": 0.5}


def test_the_published_layout_ranked_among_the_layouts_known_to_fit():
    """A layout that does not fit by the planner's count counts when it holds no more than the yardstick (to
    the byte), not when it holds more; fastest first, equal times by memory; the published layout's cell
    names its form, the yardstick and its ratios (among all, and among its framework's schedules)."""
    run = published.BY_NAME["llama3-405b-8k-8192gpu"]
    known = (150 * GIB, "llama3-405b-8k-8192gpu")
    rows = [fake("fits, slow", True, 70, 12.0, pp=32, dp=32, recompute="full"),
            fake("published", False, 150, 10.0),
            fake("too big", False, 150.5, 9.0, tp=4, dp=128),
            fake("zb-v", False, 140, 9.5, schedule="zb-v", virtual_stages=2, pp=32, dp=32),
            fake("zb-v, more memory", False, 145, 9.5, schedule="zb-v", virtual_stages=2, pp=32, dp=32,
                 zero_stage=1)]
    kept = check_published.fits_as_known(rows, known)
    assert [r["name"] for r in kept] == ["zb-v", "zb-v, more memory", "published", "fits, slow"]
    assert [r["name"] for r in check_published.fits_as_known(rows, None)] == ["fits, slow"]
    cell = check_published.as_known(run, rows, known)
    assert "150.0 GiB by the course's count, against 150.0 GiB held by llama3-405b-8k-8192gpu as it ran" in cell
    assert cell.endswith("3 of 4, 1.05× (1.00× among 1f1b, interleaved)"), cell
    assert check_published.as_known(published.BY_NAME["gpt3-175b-full"], rows, None) == "-"


def test_on_paper_compares_the_published_forms_with_the_fastest_of_all_on_paper():
    """check_published.on_paper on a small GPU plan (Llama 3 8B on 4 H100, a stand-in published layout): the
    published layout's step is its forms' least with each bubble from its own schedule on paper, and the
    fastest's is the least of every row, both as an exhaustive search finds them."""
    pipeline_time = import_module("07_choosing_a_layout.pipeline_time")
    layout_costs = import_module("07_choosing_a_layout.layout_costs")
    argv = ("--model", "llama3-8b", "--world", "4", "--device", "h100", "--dtype", "bf16", "--global-batch", "8",
            "--seq-len", "8192")
    run = SimpleNamespace(argv=argv, layout=dict(dp=1, tp=1, pp=4, cp=1, schedule="interleaved"),
                          schedules=("1f1b", "interleaved"))
    args = choose_layout.parse_args(list(argv))
    kept = check_published.fits_as_known(planner.plan(args).rows, None)
    dev = import_module("07_choosing_a_layout.layout_inputs").device_for("h100", "bf16", 4)
    cost, seen = planner.run_of(args), {}

    def paper(r):                                   # every row on paper, no bound
        c = layout_costs.Candidate.of_row(r)
        if c.pp > 1 and c not in seen:
            seen[c] = pipeline_time.bubble(cost, c, dev)
        return pipeline_time.step_with(r, seen.get(c, 0.0))

    mine = min(paper(r) for r in kept if published.matches(r, run.layout))
    best = min(paper(r) for r in kept)
    words = check_published.on_paper(run, kept)
    assert f": {mine:.4g} s, {mine / best:.2f}× the fastest" in words and f"({best:.4g} s)" in words, words
