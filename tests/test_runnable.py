"""Only the layouts the course runs (chapter 07's runnable.py): the planner's candidates are those the
training scripts' own checks accept, a refusal is the script's own message, and the first three of a plan
start and train."""
import os
from dataclasses import replace
from importlib import import_module
from unittest import mock

import pytest
import torch.distributed as dist

from common.errors import ConfigError
from common.model import PRESETS
from harness import ok, run_group

choose_layout = import_module("07_choosing_a_layout.choose_layout")
planner = import_module("07_choosing_a_layout.planner")
runnable = import_module("07_choosing_a_layout.runnable")
layout_costs = import_module("07_choosing_a_layout.layout_costs")
layout_inputs = import_module("07_choosing_a_layout.layout_inputs")


@pytest.fixture(scope="module")
def tiny_plan():
    return choose_layout.main(["--model", "tiny", "--world", "8", "--device", "h100", "--top", "3"])


def test_every_candidate_is_a_layout_the_chapters_accept():
    """The candidates the planner ranks are those the scripts' own checks (checked_layout) accept, each asked
    again; and the filter acts: the raw enumeration holds layouts the scripts refuse (more stages than
    layers, heads that do not split). (No ranking here: exercise 07.refusal is graded before 07.ranking.)"""
    cfg = PRESETS["tiny"]
    for world in (8, 16):
        kept, refused = planner.runnable_candidates(cfg, "tiny", world, 16, 128, 8)
        assert kept and refused > 0, (world, len(kept), refused)
        for c in kept:
            assert runnable.refusal(c, "tiny", cfg, 16, 128) is None, c
    refused = [c for c in planner.candidates(cfg, 16, 16, 16) if runnable.refusal(c, "tiny", cfg, 16, 128)]
    assert any(c.pp * c.virtual_stages > cfg.n_layers for c in refused) and any(c.tp == 16 for c in refused)
    # the planner asks without building every rank's actions: the answer of the run that builds them, also
    # where the schedule refuses the micro-batches (interleaved: a multiple of pp; dualpipev: at least 2·pp)
    every = list(planner.candidates(cfg, 8, 16, 8))
    every += [replace(c, microbatches=m) for c in every if c.pp > 1 and c.zero_stage == 0 for m in (2, 4)]
    answers = [(runnable.refusal(c, "tiny", cfg, 16, 128), refusal_when_built(c)) for c in every]
    differ = [(c, asked, built) for c, (asked, built) in zip(every, answers) if asked != built]
    assert not differ, differ[:1]                     # (layout, the planner's answer, the building run's)
    assert any(asked and "dualpipev needs" in asked for asked, _ in answers)
    assert any(asked and "multiple of --pp" in asked for asked, _ in answers)


class _Accepted(Exception):
    """The script got past its checks: it was about to start its process group."""


def refusal_when_built(c) -> str | None:
    """The answer of the run itself: the script's `main` with the layout's flags at its world size, which
    checks the layout and builds every rank's actions, stopped where it would start its process group."""
    script = runnable.SCRIPTS[runnable.script_of(PRESETS["tiny"], c)][1]
    argv = runnable.flags(c, "tiny", PRESETS["tiny"], 16, 128, "fp32") + ["--quiet"]
    with mock.patch.dict(os.environ, {"WORLD_SIZE": str(c.dp * c.tp * c.pp * c.cp)}), \
            mock.patch.object(dist, "init_process_group", side_effect=_Accepted):
        try:
            import_module(script).main(argv)
        except ConfigError as err:
            return str(err)
        except _Accepted:
            return None
    raise AssertionError(f"{script} returned without starting its process group")


def test_a_scatter_gather_plan_runs_it_where_a_message_splits_and_the_scripts_accept_it():
    """--pp-sends scatter-gather: each layout's command carries chapter 04's flag exactly where TP and a pipeline
    split a message without SP (elsewhere the scripts refuse it), and its script accepts that command."""
    cfg = PRESETS["tiny"]
    kept, _ = planner.runnable_candidates(cfg, "tiny", 8, 16, 128, 8)
    split = [c for c in kept if c.tp > 1 and c.pp > 1 and not c.sequence_parallel]
    assert split and len(split) < len(kept)
    for c in kept:
        extra = runnable.sends(c, "scatter-gather")
        assert (extra == ["--pp-sends", "scatter-gather"]) == (c in split) and runnable.sends(c, "whole") == [], c
        if extra:
            kind = runnable.script_of(cfg, c)
            args = runnable.parser_of(kind).parse_args(runnable.flags(c, "tiny", cfg, 16, 128, "fp32") + extra)
            import_module(runnable.SCRIPTS[kind][1]).checked_layout(args, 8, cfg, build=False)   # no ConfigError
    # a published shape's miniature (what `Run it` prints for it) keeps the lever too
    gpt3 = layout_inputs.model_for("gpt3-175b")
    full = layout_costs.Candidate(tp=8, pp=8, recompute="full", schedule="interleaved", virtual_stages=3, microbatches=64)
    assert runnable.miniature(full, gpt3, "scatter-gather")[1].endswith(" --pp-sends scatter-gather")
    assert "--pp-sends" not in runnable.miniature(full, gpt3)[1]
    c = split[0]
    argv = runnable.flags(replace(c, sequence_parallel=True), "tiny", cfg, 16, 128, "fp32") + ["--pp-sends",
                                                                                           "scatter-gather"]
    with pytest.raises(ConfigError, match="already 1/tp"):
        kind = runnable.script_of(cfg, c)
        import_module(runnable.SCRIPTS[kind][1]).checked_layout(runnable.parser_of(kind).parse_args(argv), 8, cfg,
                                                                build=False)


def test_a_refused_layout_gets_its_chapter_s_own_message():
    """The refusal is the script's message, word for word: chapter 02's for heads that do not split."""
    c = layout_costs.Candidate(tp=16)
    assert "the model's 8 query heads do not split over --tp 16" in (runnable.refusal(c, "tiny", PRESETS["tiny"], 16, 128)
                                                                      or "accepted")


def test_a_published_shape_is_asked_with_its_own_shape():
    """Llama 3 8B at 4K: 16 pipeline stages of its 32 layers, its 32 heads over tp 16, each refused for the
    tiny preset's 8 layers and 8 heads, are accepted: the script is asked about the model planned (its
    `cfg`), not about the preset its flags name to run a miniature."""
    cfg = layout_inputs.model_for("llama3-8b")
    for c in (layout_costs.Candidate(tp=16),
              layout_costs.Candidate(pp=16, microbatches=16)):
        assert runnable.refusal(c, "llama3-8b", cfg, 16, 4096) is None, c
        assert runnable.refusal(c, "tiny", PRESETS["tiny"], 16, 128), c


def test_the_first_three_start_and_train_two_steps(tiny_plan):
    """The top three of the tiny model's 8-rank plan, run as their commands say (two steps), in one group."""
    jobs = []
    for r in tiny_plan[:3]:
        script = r["command"].split()[2].removesuffix(".py").replace("/", ".")
        argv = r["command"].split()[3:] + ["--steps", "2", "--quiet", "--sample-tokens", "0", "--val-every", "0",
                                           "--val-batches", "1"]
        jobs.append((f"{script}:main", argv))
    for (path, argv), result in zip(jobs, run_group(8, jobs, timeout_s=600)):
        history = ok(result)
        assert [h["step"] for h in history] == [1, 2] and all(h["loss"] > 0 for h in history), argv
