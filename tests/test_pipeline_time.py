"""A GPU pipeline's bubble from its own schedule (07_choosing_a_layout/pipeline_time.py): chapter 03's actions run
on paper with each stage's F, B and W. With equal stages and the textbook's costs it is the textbook bubble of
the loop schedules, and of the V's once their whole backwards are split; Llama 3's uneven interleaved chunks and
ZB-V's heavier input gradient idle more; --explain prints it beside the textbook's."""
from importlib import import_module

import subprocess
import sys

import pytest

from harness import ROOT

pipeline_time = import_module("07_choosing_a_layout.pipeline_time")
layout_costs = import_module("07_choosing_a_layout.layout_costs")
layout_inputs = import_module("07_choosing_a_layout.layout_inputs")
choose_layout = import_module("07_choosing_a_layout.choose_layout")
explain_layout = import_module("07_choosing_a_layout.explain_layout")
pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")
schedule_simulator = import_module("03_pipeline_parallel.schedule_simulator")
pipeline_actions = import_module("03_pipeline_parallel.pipeline_actions")
Action, B, W, BW, units = (pipeline_actions.Action, pipeline_actions.B, pipeline_actions.W, pipeline_actions.BW,
                           pipeline_actions.units)

def bubble_of(schedule: str, p: int, m: int, v: int, costs: tuple) -> float:
    """The busiest rank's idle share of `schedule` run on paper with stage k's (F, B, W) = costs[k]."""
    makespan, busy = pipeline_time.on_paper(schedule, p, m, v, costs)
    return 1 - busy / makespan


SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1), ("zb-v", 2), ("dualpipev", 2))


@pytest.mark.parametrize("schedule, v", [(s, v) for s, v in SCHEDULES if s not in ("zb-v", "dualpipev")])
def test_equal_stages_at_the_textbook_costs_are_the_textbook_bubble(schedule, v):
    """F = 1, B = W = 1 (a whole backward 2) on every stage: the textbook bubble. A rank's busy time is every
    stage's F, B and W of every micro-batch, whether the schedule splits the backward or not."""
    for p in (2, 3, 4):
        step = p if schedule == "interleaved" else 1
        for m in range(2 * p, 7 * p + 1, step):
            costs = ((1.0, 1.0, 1.0),) * (p * v)
            want = pipeline_schedules.theory_bubble(schedule, p, m, v)
            assert bubble_of(schedule, p, m, v, costs) == pytest.approx(want, abs=1e-12), (schedule, p, m)
            assert pipeline_time.on_paper(schedule, p, m, v, ((1.0, 1.5, 0.5),) * (p * v))[1] == 3 * m * v


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev"])
def test_a_v_s_fused_backward_sends_its_input_gradient_after_its_weight_gradient(schedule):
    """The V schedules run some backwards whole (BW, PyTorch's order), as chapter 03's executor does: the input
    gradient leaves at the end of the pass, after the weight gradient the textbook moves out of its way. At
    the textbook's costs they idle more than the textbook says; with each BW split into its B and W they idle
    exactly what it says."""
    for p, m in ((3, 12), (4, 16)):
        costs = ((1.0, 1.0, 1.0),) * (2 * p)
        textbook = pipeline_schedules.theory_bubble(schedule, p, m, 2)
        assert bubble_of(schedule, p, m, 2, costs) > 1.2 * textbook
        plan = pipeline_schedules.build_schedule(schedule, p, m, 2)
        split = [[x for a in units(acts) for x in ((Action(B, a.mb, a.stage), Action(W, a.mb, a.stage))
                                                   if a.kind == BW else (a,))] for acts in plan]
        run = schedule_simulator.simulate(split, 2 * p, lambda rank, a: 1.0)
        busy = max(sum(e - s for r, _, s, e in run["events"] if r == rank) for rank in range(p))
        assert 1 - busy / run["makespan"] == pytest.approx(textbook, abs=1e-12), (schedule, p, m)


def test_uneven_stages_and_a_heavier_input_gradient_idle_more_than_the_textbook_says():
    """Llama 3 405B at 8K on 8,192 H100: 126 blocks over 16 × 7 interleaved chunks (14 of two blocks) idle about
    twice the textbook's bubble; under ZB-V a block's B (attention's five products, what selective
    recomputation reruns) outweighs its W, which the V counts on being equal."""
    cfg = layout_inputs.model_for("llama3-405b")
    run = layout_costs.Run(cfg, 2048, 8192, "bf16")
    dev = layout_inputs.device_for("h100", "bf16", 8192)
    loop = layout_costs.Candidate(dp=64, tp=8, pp=16, zero_stage=2, sequence_parallel=True, schedule="interleaved",
                                  microbatches=32, virtual_stages=7, recompute="full", recompute_layers=1)
    v_shape = layout_costs.Candidate(dp=16, tp=8, pp=32, cp=2, zero_stage=2, sequence_parallel=True, schedule="zb-v",
                                     microbatches=128, virtual_stages=2, recompute="selective",
                                     cp_attention="allgather")
    for c, more in ((loop, 1.8), (v_shape, 2.5)):
        textbook = pipeline_schedules.theory_bubble(c.schedule, c.pp, c.microbatches, c.virtual_stages)
        assert pipeline_time.bubble(run, c, dev) > more * textbook, c.schedule


def test_explain_says_the_step_on_paper_beside_the_textbooks(capsys):
    """--explain of a GPU layout with a pipeline prints its bubble on paper beside the textbook's, and the step
    with it: the planner's step with the bubble's part replaced."""
    choose_layout.main(["--model", "tiny", "--world", "8", "--device", "h100", "--explain", "dp=4,pp=2,m=4"])
    said = " ".join(capsys.readouterr().out.split())
    assert "on paper (chapter 03's schedule run with each stage's own forward, input and weight gradients" in said
    cfg = layout_inputs.model_for("llama3-405b")
    run = layout_costs.Run(cfg, 2048, 8192, "bf16")
    dev = layout_inputs.device_for("h100", "bf16", 8192)
    c = layout_costs.Candidate(dp=64, tp=8, pp=16, zero_stage=2, sequence_parallel=True, schedule="interleaved",
                               microbatches=32, virtual_stages=7, recompute="full", recompute_layers=1)
    row = layout_costs.predict(run, c, dev, 8)
    b = pipeline_time.bubble(run, c, dev)
    parts = row["time_parts_s"]
    critical = sum(parts[k] for k in ("compute", "memory", "comm_tp", "comm_ep", "comm_pp"))
    step = row["step_time_s"] - parts["bubble"] + critical * b / (1 - b)
    assert f"idles {b:.1%} of the step, where the ranking's textbook bubble says {row['bubble']:.1%}: a step of " \
           f"{step:.4g} s" in pipeline_time.words(run, row, dev)
    assert parts["bubble"] == pytest.approx(critical * row["bubble"] / (1 - row["bubble"]))


def test_the_fastest_on_paper_is_found_without_running_every_schedule():
    """pipeline_time.fastest_on_paper: rows tried in the order of their step without a bubble, stopping at the
    first that cannot beat the best found even without one; the answer is the exhaustive one, here a row the
    textbook ranks behind another (its own schedule idles less than the textbook says), and the rows past the
    bound are never run."""
    def row(name, step, bubble_s, compute):
        return {"name": name, "step_time_s": step, "time_parts_s": {"compute": compute, "bubble": bubble_s},
                "memory_bytes": {"total": 1}}

    rows = [row("past the bound", 12.0, 2.0, 10.0),       # ≥ 10.0 s even without a bubble
            row("no pipeline", 9.6, 0.0, 9.6),             # 9.6 s whatever the paper says
            row("textbook first", 8.4, 0.4, 8.0),          # on paper idles 1/9: 8.0 / (8/9) = 9.0 s
            row("textbook behind", 9.2, 0.7, 8.5),         # on paper idles 1/86: 8.5 / (85/86) = 8.6 s
            row("between", 9.0, 0.2, 8.8)]                 # on paper idles 1/89: 8.8 / (88/89) = 8.9 s
    idle = {"past the bound": 0.0, "no pipeline": 0.0, "textbook first": 1 / 9, "textbook behind": 1 / 86,
            "between": 1 / 89}
    asked = []

    def bubble_of(r):
        asked.append(r["name"])
        return idle[r["name"]]

    best, step = pipeline_time.fastest_on_paper(rows, bubble_of)
    exhaustive = min(rows, key=lambda r: pipeline_time.step_with(r, idle[r["name"]]))
    assert best is exhaustive and best["name"] == "textbook behind" and step == pytest.approx(8.6)
    assert asked == ["textbook first", "textbook behind"]       # 9.6 and 10.0 s cannot beat 8.6 s
    assert pipeline_time.fastest_on_paper([], bubble_of) is None
    asked.clear()                    # the first two: the bound is the second best's step, not the first's
    leaders = pipeline_time.leaders_on_paper(rows, bubble_of, 2)
    assert [r["name"] for r, _ in leaders] == ["textbook behind", "between"]
    assert asked == ["textbook first", "textbook behind", "between"]        # 9.6 s cannot beat 8.9 s
    assert [r["name"] for r, _ in pipeline_time.leaders_on_paper(rows, bubble_of, 3)] == \
        ["textbook behind", "between", "textbook first"]


def test_bubble_on_paper_prints_the_leaders_on_paper_and_is_refused_on_a_cpu(capsys):
    """choose_layout --bubble on-paper on a GPU: the first --top layouts that fit, on paper, the first the fastest on
    paper; on --device cpu one line and exit 2, before any plan is printed."""
    flags = ["--model", "llama3-8b", "--world", "8", "--device", "h100", "--dtype", "bf16", "--global-batch",
             "16", "--seq-len", "8192", "--top", "3", "--why", "1", "--bubble", "on-paper"]
    rows = choose_layout.main(flags)
    out = capsys.readouterr().out
    args = choose_layout.parse_args(flags)
    dev = layout_inputs.device_for("h100", "bf16", 8)
    best, step = pipeline_time.fastest_on_paper([r for r in rows if r["fits"]],
                                                pipeline_time.bubbles(choose_layout.planner.run_of(args), dev))
    lines = explain_layout.unwrapped(out[out.index("On paper"):].split("\n\n")[0])
    assert len(lines) == 4 and lines[1].strip().startswith(f"{step:.4g} s"), lines
    assert lines[1].endswith(choose_layout.describe(best)), lines
    cpu = subprocess.run([sys.executable, "07_choosing_a_layout/choose_layout.py", "--bubble", "on-paper"],
                         cwd=ROOT, capture_output=True, text=True)          # the script itself, on a CPU
    assert cpu.returncode == 2 and not cpu.stdout and cpu.stderr.count("\n") == 1, cpu.stderr
    assert cpu.stderr.startswith("error: --bubble on-paper runs a GPU's pipeline schedules on paper"), cpu.stderr
