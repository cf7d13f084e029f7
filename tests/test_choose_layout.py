"""The layout planner (07_choosing_a_layout/planner.py, choose_layout.py): only layouts the chapters' scripts accept (and
the first three of the tiny model's plan start and train), its JSON schema and ranking, its bytes against
the formulas the chapters assert and the bytes runs measured, its memory as the grid's trainers hold it,
the step time as the sum of its parts, --explain, the published configurations' sanity cases and their table
cells (a published memory against the planner's GiB), and bad input."""
import json
import subprocess
import sys
from importlib import import_module

import pytest

from common.domains import Domain
from common.errors import ConfigError
from common.model import PRESETS
from harness import ROOT

choose_layout = import_module("07_choosing_a_layout.choose_layout")
planner = import_module("07_choosing_a_layout.planner")
runnable = import_module("07_choosing_a_layout.runnable")
layout_costs = import_module("07_choosing_a_layout.layout_costs")
layout_memory = import_module("07_choosing_a_layout.layout_memory")
schedule_costs = import_module("07_choosing_a_layout.schedule_costs")
partial_recompute = import_module("07_choosing_a_layout.partial_recompute")
layout_inputs = import_module("07_choosing_a_layout.layout_inputs")
explain_layout = import_module("07_choosing_a_layout.explain_layout")
attention_bookkeeping = import_module("06_context_parallel.attention_bookkeeping")

TINY = layout_costs.Run(PRESETS["tiny"], 16, 128, "fp32")
H100 = layout_inputs.device_for("h100", "fp32", 8)
L, D, S, M = 8, 128, 128, 1_640_576 * 4           # tiny: layers, width; the sequence; its parameters' bytes


def row(run, dp, tp, pp, cp=1, ep=1, m=1, sp=False, zero=0, mode="none", schedule="1f1b", v=1, dev=H100):
    c = layout_costs.Candidate(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero_stage=zero, recompute=mode, sequence_parallel=sp,
                               schedule=schedule, microbatches=m, virtual_stages=v)
    return layout_costs.predict(run, c, dev, 8)


def test_json_schema(tmp_path):
    out = tmp_path / "runs" / "rows.json"                                # a folder not there yet
    choose_layout.main(["--model", "tiny", "--world", "8", "--device", "h100", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert len(rows) > 100 and all(list(r) == list(choose_layout.SCHEMA) for r in rows)
    for r in rows:
        assert set(r["memory_bytes"]) == {"params", "grads", "optim_bytes", "peak_activation_bytes", "working",
                                          "gradient_copy", "total", "held_between_steps"}
        assert set(r["comm_bytes"]) == {"dp", "tp", "pp", "ep", "cp"}
        assert r["dp"] * r["tp"] * r["pp"] * r["cp"] == 8 and isinstance(r["fits"], bool) and r["step_time_s"] > 0
        m = r["memory_bytes"]          # the larger of the backward's moment and the gradient sync's
        backward = max(m["peak_activation_bytes"] + m["working"], m["gradient_copy"])
        assert m["total"] == pytest.approx(m["params"] + m["grads"] + m["optim_bytes"] + backward, abs=5)
    assert [planner.ranking(r) for r in rows] == sorted(planner.ranking(r) for r in rows)
    fitting = [r for r in rows if r["fits"]]                            # fastest first, equal times by memory
    assert all(float(f"{a['step_time_s']:.4g}") < float(f"{b['step_time_s']:.4g}") or
               a["memory_bytes"]["total"] <= b["memory_bytes"]["total"] for a, b in zip(fitting, fitting[1:]))
    # one row per distinct layout: no ZeRO stage where there is nothing to shard
    keys = [tuple(r[k] for k in choose_layout.SCHEMA[:14]) for r in rows]       # the layout: dp ... microbatches
    assert len(keys) == len(set(keys)) and not any(r["zero_stage"] and r["dp"] * r["cp"] == 1 for r in rows)


def test_ranking_puts_what_fits_first_fastest_then_the_rest_smallest_first():
    """Llama 3 8B on 8 H100s at 8K: some layouts fit, some do not. Checked without the planner's own sort
    key: every fitting row before every other, the fitting ones by step time (ties by memory), the rest by
    memory."""
    rows = choose_layout.main(["--model", "llama3-8b", "--world", "8", "--device", "h100", "--dtype", "bf16",
                               "--global-batch", "16", "--seq-len", "8192", "--top", "1"])
    fits = [r["fits"] for r in rows]
    assert any(fits) and not all(fits) and fits == sorted(fits, reverse=True)
    fitting, rest = [r for r in rows if r["fits"]], [r for r in rows if not r["fits"]]
    times = [float(f"{r['step_time_s']:.4g}") for r in fitting]
    assert times == sorted(times)
    assert all(a["memory_bytes"]["total"] <= b["memory_bytes"]["total"]
               for a, b, ta, tb in zip(fitting, fitting[1:], times, times[1:]) if ta == tb)
    assert [r["memory_bytes"]["total"] for r in rest] == sorted(r["memory_bytes"]["total"] for r in rest)


def test_bytes_equal_what_runs_measured():
    """Chapter 04's main run (results/main_run_metrics.jsonl: dp 2 × tp 2 × pp 2, m 4, 16 × 128) and every
    row of its bench table (results/3d_bench.md, MiB to two decimals)."""
    measured = json.loads((ROOT / "04_3d_combined/results/main_run_metrics.jsonl").read_text().splitlines()[0])
    r = row(TINY, 2, 2, 2, m=4)
    assert [r["comm_bytes"][g] for g in ("dp", "tp", "pp")] == [measured[f"comm_bytes_{g}"] for g in ("dp", "tp", "pp")]
    assert r["memory_bytes"]["optim_bytes"] >= measured["optim_bytes"]    # the fullest rank; rank 0 below
    bench = (ROOT / "04_3d_combined/results/3d_bench.md").read_text()
    check_layouts = import_module("07_choosing_a_layout.check_layouts")
    for line in bench.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 7 and cells[1] == "8":
            dp, tp, pp = (int(x) for x in cells[0].split(" × "))
            pred, _, _ = check_layouts.predicted_here(cells[0], H100)
            mib = [float(x) for x in cells[6].split(" / ")]
            assert [round(pred["comm_bytes"][g] / 2**20, 2) for g in ("dp", "tp", "pp")] == mib, cells[0]


def test_bytes_equal_the_chapters_formulas():
    """The README formulas, written out: DP's all-reduce 2·2(N-1)/N·M (sent + received), TP's 4L + 2
    activation all-reduces plus the loss's 3 (test_tp), 1F1B's 2m messages on the first stage, the ring's
    cp_bytes per layer and micro-batch, the expected all-to-all of chapter 05."""
    assert row(TINY, 8, 1, 1, m=2)["comm_bytes"]["dp"] == 2 * 2 * 7 / 8 * M
    b = 16 // 4
    floats = (4 * L + 2) * b * S * D + 3 * b * S
    assert row(TINY, 4, 2, 1)["comm_bytes"]["tp"] == 4 * (2 - 1) / 2 * 4 * floats
    # SP: each all-reduce becomes a reduce-scatter and an all-gather, the norm gains' gradients are summed, and
    # each column-parallel entrance (2 per block, the head) all-gathers its shard again in backward
    regather = (2 * L + 1) * b * S * D
    assert row(TINY, 4, 2, 1, sp=True)["comm_bytes"]["tp"] == \
        4 * (2 - 1) / 2 * 4 * (floats + (2 * L + 1) * D) + 2 * (2 - 1) / 2 * 4 * regather
    assert row(TINY, 2, 1, 4, m=8)["comm_bytes"]["pp"] == 2 * 8 * (16 // 2 // 8) * S * D * 4
    cp = row(TINY, 2, 1, 1, cp=4, m=2)["comm_bytes"]["cp"]
    assert cp == L * 2 * attention_bookkeeping.cp_bytes("ring", 4, S, 4, 4, 16, 4)
    moe = layout_costs.Run(PRESETS["tiny-moe"], 16, 64, "fp32")
    T = 16 // 4 * 64                                                   # tokens per rank
    assert row(moe, 4, 1, 1, ep=4)["comm_bytes"]["ep"] == int(L * (8 * 3 / 4 * T * 2 * D * 4 + 16 * 3 * 8 // 4))


def test_memory_is_what_the_grid_trainers_hold():
    """At the peak of a step the grid's trainers hold the weights whole (ZeRO-3 gathers them once per step)
    and the full gradients (stages 2-3 reduce-scatter after the schedule), and beside them the shards that stay
    through the step (the gradient shard from stage 2, the weight shard at stage 3); AdamW's moments are
    sharded from stage 1. Between steps, chapter 01's formula per stage (the runs' memory_formula). Data parallelism
    alone under ZeRO-3 runs as chapter 01's, a unit at a time: the shards, two units' weights and two
    units' gradients (test_zero.py checks them against its runs)."""
    plain = row(TINY, 4, 1, 1, m=2)["memory_bytes"]
    assert (plain["params"], plain["grads"], plain["optim_bytes"]) == (M, M, 2 * M)            # M(1 + 1 + α)
    held = {1: M + M + 2 * M / 4, 2: M + M / 4 + 2 * M / 4, 3: M / 4 + M / 4 + 2 * M / 4}
    for stage, tp in ((1, 1), (2, 1), (3, 2)):          # tp 2: ZeRO-3 on chapter 04's grid
        mem = row(TINY, 4, tp, 1, m=2, zero=stage)["memory_bytes"]
        whole = 2 * mem["optim_bytes"]                   # two moments of a quarter: this rank's weights (tp 2: its TP shard)
        assert whole == M or tp == 2, stage
        assert [mem["params"], mem["grads"]] == [whole + (whole / 4 if stage == 3 else 0),
                                                 whole + (whole / 4 if stage >= 2 else 0)], stage
        if tp == 1:
            assert mem["held_between_steps"] == int(held[stage]), stage
    assert runnable.script_of(TINY.cfg, layout_costs.Candidate(dp=4, zero_stage=3, microbatches=2)) == "zero"
    unit = 4 * (2 * D * D + 2 * D * 64 + 2 * D + 3 * D * 384)                  # a block of tiny (the largest unit)
    mem = row(TINY, 4, 1, 1, m=2, zero=3)["memory_bytes"]
    assert [mem["params"], mem["grads"], mem["optim_bytes"]] == [M / 4 + 2 * unit, M / 4 + 2 * unit, 2 * M / 4]
    assert mem["held_between_steps"] == int(held[3])
    # each pipeline rank its own weights and its own activations: the last holds the head, the first the most
    # micro-batches; the fullest is the larger of the two sums, not one rank's weights plus another's peak
    r = row(TINY, 1, 1, 4, m=8)
    specs = schedule_costs.specs_for(TINY.cfg, 4, 1, S)
    ranks = dict(schedule_costs.activation_peaks(TINY.cfg, "none", "1f1b", 4, 8, 1, 2, S, S, 1, False))
    totals = {k: layout_memory.rank_memory(TINY, layout_costs.Candidate(pp=4, microbatches=8),
                                          specs, k, peak, gloo=False)["total"] for k, peak in ranks.items()}
    assert r["memory_bytes"]["total"] == int(max(totals.values())) and r["fullest_pp_rank"] == max(totals, key=totals.get)
    acts = [row(TINY, 8, 1, 1, m=2, mode=mode)["memory_bytes"]["peak_activation_bytes"]
            for mode in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2]
    # a pipeline keeps more micro-batches in flight on its first rank under GPipe than under 1F1B
    gpipe = row(TINY, 1, 1, 4, m=16, schedule="gpipe")["memory_bytes"]["peak_activation_bytes"]
    assert gpipe > row(TINY, 1, 1, 4, m=16)["memory_bytes"]["peak_activation_bytes"]


def test_published_sanity():
    """Llama 3 405B on 16K H100s at 8K: plain DP cannot hold it; the published TP 8 × PP 16 can, once its
    activations are recomputed (16 micro-batches of 8K tokens in flight on the first stage need 145 GiB)."""
    cfg = layout_inputs.model_for("llama3-405b")
    dev = layout_inputs.device_for("h100", "bf16", 16384)
    plain = row(layout_costs.Run(cfg, 16384, 8192, "bf16"), 16384, 1, 1, dev=dev)
    assert not plain["fits"] and plain["memory_bytes"]["total"] > 16 * 405e9
    published = {mode: row(layout_costs.Run(cfg, 2048, 8192, "bf16"), 128, 8, 16, m=16, sp=True, zero=2, mode=mode,
                           schedule="interleaved", v=2, dev=dev) for mode in ("none", "full")}
    assert published["full"]["fits"] and published["full"]["memory_bytes"]["total"] < \
        published["none"]["memory_bytes"]["total"]
    assert published["full"]["bubble"] == pytest.approx(15 / (2 * 16 + 15))


def test_a_published_memory_is_checked_against_the_fullest_rank_s_total():
    """check_layouts' table: a published memory per GPU (torchtitan-llama3-8b's 82.4 GiB) stands against the
    planner's total for the layout, in GiB, and torchtitan's code's (torchtitan_memory.py: its tensors counted
    and traced, and the allocator's reserve for them); MFU and step-time targets keep their own cells. No plan
    is made and no step traced here (each takes a while): the cells of a row and torchtitan's numbers written
    by hand. Llama 3's MFU is compared as its authors count it (published.mfu_as_published)."""
    check_published = import_module("07_choosing_a_layout.check_published")
    published = import_module("07_choosing_a_layout.published")
    run = published.BY_NAME["torchtitan-llama3-8b"]
    args = choose_layout.parse_args(["--explain", run.name])                  # its flags plan its cluster and batch
    assert (args.model, args.world, args.global_batch, args.seq_len, args.dtype) == ("llama3-8b", 8, 16, 8192, "bf16")
    r = {"memory_bytes": {"total": 3 * 2**29}, "mfu": 0.4321, "step_time_s": 1.234}    # 1.5 GiB
    assert check_published.predicted_value(run, r, "memory_gib") == 1.5
    gib = {"count": 68.63, "tensors": 69.94, "expandable": 80.41, "segments": 82.1}
    theirs = ("torchtitan's code: 68.6 GiB of tensors (torchtitan_memory.py; 69.9 GiB as its step runs on fake "
              "tensors), **80.4 GiB reserved** by the caching allocator with expandable segments as torchtitan "
              "launches (82.1 GiB by default: caching_allocator.py)")      # the same run as torchtitan's code holds it
    assert check_published.measured_cells(run, r, gib) == ("memory 82.4 GiB", f"1.5 GiB (the course's code); {theirs}")
    assert check_published.measured_cells(run, None, gib) == ("memory 82.4 GiB", f"- (the course's code); {theirs}")
    assert check_published.measured_cells(published.BY_NAME["llama3-405b-8k-8192gpu"], r) == \
        ("MFU 43.0%", "44.9%")                      # the row's 43.21 % counted as Llama 3 counts (attention's square)
    assert check_published.measured_cells(published.BY_NAME["gpt3-175b-full"], r) == \
        ("step 18.13 s", "1.23 s")
    assert check_published.measured_cells(published.BY_NAME["deepseek-v3"], r) == ("-", "43.2% MFU")


def test_step_time_is_the_sum_of_its_parts_and_the_bubble_is_chapter_03s():
    """step = compute + memory + bubble + exposed communication + optimizer, and the bubble part is the
    critical path's time (compute, memory, TP, EP and PP traffic) · b/(1 − b) with chapter 03's theory_bubble
    (a GPU: every rank its own device; step_time.py)."""
    pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")
    for schedule, v, m in (("1f1b", 1, 8), ("interleaved", 2, 8), ("zb-h1", 1, 4)):
        r = row(TINY, 2, 1, 4, m=m, schedule=schedule, v=v)
        parts = r["time_parts_s"]
        assert r["step_time_s"] == pytest.approx(sum(parts.values()), rel=1e-12), schedule
        b = pipeline_schedules.theory_bubble(schedule, 4, m, v)
        busy = sum(parts[k] for k in ("compute", "memory", "comm_tp", "comm_ep", "comm_pp"))
        assert r["bubble"] == b and parts["bubble"] == pytest.approx(busy * b / (1 - b)), schedule


def test_partial_recomputation_is_the_fewest_blocks_per_stage_that_fit():
    """--recompute-layers as a lever: on a device too small for --recompute none but large enough for full,
    the planner's k is the least that fits (k − 1 does not), and costs between none and full in memory
    and time; the planner's rows then hold it, with its command. Where none fits, there is no such row."""
    from dataclasses import replace
    c = layout_costs.Candidate(dp=4, pp=2, recompute="full", microbatches=4)          # 4 layers per stage
    none, full = row(TINY, 4, 1, 2, m=4), row(TINY, 4, 1, 2, m=4, mode="full")
    small = replace(H100, memory=(none["memory_bytes"]["total"] + full["memory_bytes"]["total"]) // 2)
    k = partial_recompute.least_recompute_layers(TINY, c, small)
    assert k in (1, 2, 3), k
    at = {j: layout_costs.predict(TINY, replace(c, recompute_layers=j), small, 8) for j in (k - 1, k)}
    assert at[k]["fits"] and (k == 1 or not at[k - 1]["fits"])
    if k == 1:
        assert not none["memory_bytes"]["total"] <= small.memory
    assert full["step_time_s"] > at[k]["step_time_s"] > none["step_time_s"]
    assert full["memory_bytes"]["total"] < at[k]["memory_bytes"]["total"] < none["memory_bytes"]["total"]
    assert partial_recompute.least_recompute_layers(TINY, c, H100) is None                # none fits: no lever needed
    assert "--recompute full --recompute-layers" in runnable.command(replace(c, recompute_layers=k), "tiny",
                                                                     PRESETS["tiny"], 16, 128)


def test_explain_a_layout_and_a_published_run(capsys):
    choose_layout.main(["--model", "tiny", "--world", "8", "--device", "h100", "--explain", "dp=4,pp=2,m=4"])
    out = "\n".join(explain_layout.unwrapped(capsys.readouterr().out))
    assert "dp 4 × tp 1 × pp 2 × cp 1" in out and "of the" in out and "memory, its fullest pipeline rank" in out
    assert "Run it: torchrun --nproc_per_node=8 04_3d_combined/train_3d.py --model tiny --dp 4 --tp 1 --pp 2" in out
    # a published shape has no preset to run at full size: its miniature is what runs here
    choose_layout.main(["--model", "llama3-8b", "--world", "8", "--device", "h100", "--seq-len", "1024",
                        "--explain", "dp=2,tp=4"])
    out = "\n".join(explain_layout.unwrapped(capsys.readouterr().out))
    assert "Run it in miniature on this machine: torchrun --nproc_per_node=4 04_3d_combined/train_3d.py " \
           "--model tiny --dp 2 --tp 2" in out and "--model llama3-8b" not in out.split("Run it")[-1], out
    choose_layout.main(["--model", "tiny", "--world", "16", "--gpus-per-node", "16", "--device", "h100", "--explain",
                        "tp=16", "--top", "1"])
    # the refusal is chapter 02's own message, word for word
    out = "\n".join(explain_layout.unwrapped(capsys.readouterr().out))
    assert "the chapters refuse it: the model's 8 query heads do not split over --tp 16" in out, out.splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt5"], "--model gpt5: unknown model; choose one of tiny"),
    (["--device", "tpu"], "--device tpu: unknown device; choose one of cpu, a100, h100"),
    (["--world", "13"], "no layout of --world 13"),
    (["--seq-len", "4096"], "--seq-len 4096 is longer than --model tiny's 256 positions"),
    (["--efficiency", "2"], "--efficiency must be a finite number > 0 and ≤ 1, got 2"),
])
def test_bad_input(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        choose_layout.main(["--device", "h100", *argv] if "--device" not in argv else argv)


def test_every_flag_declares_a_domain_and_help_shows_it(capsys):
    """The training scripts' parser: a Domain or choices on every flag, the rule and default in --help."""
    parser = choose_layout.parser()
    untyped = [a.dest for a in parser._actions
               if a.dest != "help" and not isinstance(a.type, Domain) and a.choices is None]
    assert not untyped
    with pytest.raises(SystemExit) as stop:
        choose_layout.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert stop.value.code == 0 and "ranks (GPUs) in all (a whole number ≥ 1 and ≤ 1048576; default: 8)" in help_text


def run_planner(*argv):
    return subprocess.run([sys.executable, "07_choosing_a_layout/choose_layout.py", *argv], cwd=ROOT,
                          capture_output=True, text=True)


BAD_FLAGS = [
    (["--world", "0"], "--world must be a whole number ≥ 1 and ≤ 1048576, got 0; e.g. --world 8 (the default)"),
    (["--world", "1000000000"], "--world must be a whole number ≥ 1 and ≤ 1048576, got 1000000000"),
    (["--global-batch", "-3"], "--global-batch must be a whole number ≥ 1, got -3; e.g. --global-batch 16"),
    (["--seq-len", "x"], "--seq-len must be a whole number ≥ 1, got x; e.g. --seq-len 128"),
    (["--json", "/proc/x.json"], "--json /proc/x.json: cannot be created: '/proc' refuses new files"),
    (["--model", "gpt5"], "--model gpt5: unknown model; choose one of tiny"),
    (["--cp-attention", "ulysses"], "argument --cp-attention: invalid choice: 'ulysses' (choose from 'ring', "
                                    "'allgather')"),
    (["--full-recompute", "all"], "argument --full-recompute: invalid choice: 'all' (choose from 'early-stop', "
                                  "'whole-block')"),
    (["--pp-sends", "split"], "argument --pp-sends: invalid choice: 'split' (choose from 'whole', 'scatter-gather')"),
]


@pytest.mark.parametrize("argv, message", BAD_FLAGS)
def test_each_bad_flag_is_named_with_what_it_accepts(argv, message):
    """The refusal (a ConfigError, which the script prints as its one line) names the flag and what it
    accepts, as every training script says it; before any planning."""
    with pytest.raises(ConfigError) as refused:
        choose_layout.main(["--device", "h100", *argv])
    assert str(refused.value).startswith(message)


def test_command_line_names_the_bad_flag_in_one_line():
    """The script itself: exit code 2 and that one line, `error: ` first, no traceback, nothing on stdout
    (one bad flag launched for real; the others' messages are checked in this process, above)."""
    argv, message = BAD_FLAGS[4]
    proc = run_planner("--device", "h100", *argv)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {message}"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and not proc.stdout


def test_nothing_fits_exits_1_after_writing_the_rows(tmp_path):
    """405B parameters on one 80 GiB GPU: every layout is printed and written, none fits, exit code 1."""
    out = tmp_path / "rows.json"
    proc = run_planner("--model", "llama3-405b", "--world", "1", "--device", "h100", "--json", str(out))
    assert proc.returncode == 1 and proc.stderr.startswith(
        "error: no layout of 1 h100 rank fits: the smallest, dp 1 × tp 1 × pp 1 × cp 1, recompute full, m=16, "
        "still holds 6,049.10 GiB per rank against 80.00 GiB less its 5% headroom; use more ranks (--world)"), \
        proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and "* does not fit" in proc.stdout
    rows = json.loads(out.read_text())
    assert rows and not any(r["fits"] for r in rows)
