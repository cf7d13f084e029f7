"""The layout planner (06_context_parallel/choose_layout.py): its JSON schema, its bytes against the
formulas the chapters assert and the bytes runs measured, the published configurations' sanity cases,
and bad input. One process, no ranks: every prediction is arithmetic."""
import json
import subprocess
import sys
from importlib import import_module

import pytest

from common.cli import Domain
from common.errors import ConfigError
from common.model import PRESETS
from harness import ROOT

choose_layout = import_module("06_context_parallel.choose_layout")
layout_costs = import_module("06_context_parallel.layout_costs")
layout_inputs = import_module("06_context_parallel.layout_inputs")
attention_bookkeeping = import_module("06_context_parallel.attention_bookkeeping")

TINY = layout_costs.Run(PRESETS["tiny"], 16, 128, "fp32")
H100 = layout_inputs.device_for("h100", "fp32", 8)
L, D, S, M = 8, 128, 128, 1_640_576 * 4           # tiny: layers, width; the sequence; its parameters' bytes


def row(run, dp, tp, pp, cp=1, ep=1, m=1, sp=False, zero=0, mode="none", schedule="1f1b", v=1, dev=H100):
    return layout_costs.predict(run, layout_costs.Candidate(dp, tp, pp, cp, ep, zero, mode, sp, schedule, m, v), dev, 8)


def test_json_schema(tmp_path):
    out = tmp_path / "runs" / "rows.json"                                # a folder not there yet
    choose_layout.main(["--model", "tiny", "--world", "8", "--device", "h100", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert len(rows) > 100 and all(list(r) == list(choose_layout.SCHEMA) for r in rows)
    for r in rows:
        assert set(r["memory_bytes"]) == {"params", "grads", "optim_bytes", "peak_activation_bytes", "total"}
        assert set(r["comm_bytes"]) == {"dp", "tp", "pp", "ep", "cp"}
        assert r["dp"] * r["tp"] * r["pp"] * r["cp"] == 8 and isinstance(r["fits"], bool) and r["step_time_s"] > 0
        assert r["memory_bytes"]["total"] >= sum(v for k, v in r["memory_bytes"].items() if k != "total") - 4
    fitting = [r["step_time_s"] for r in rows if r["fits"]]
    assert fitting == sorted(fitting)                                   # fastest first


def test_bytes_equal_what_runs_measured():
    """Chapter 04's main run (results/main_run_metrics.jsonl: dp 2 × tp 2 × pp 2, m 4, 16 × 128) and every
    row of its bench table (results/3d_bench.md, MiB to two decimals)."""
    measured = json.loads((ROOT / "04_3d_combined/results/main_run_metrics.jsonl").read_text().splitlines()[0])
    r = row(TINY, 2, 2, 2, m=4)
    assert [r["comm_bytes"][g] for g in ("dp", "tp", "pp")] == [measured[f"comm_bytes_{g}"] for g in ("dp", "tp", "pp")]
    assert r["memory_bytes"]["optim_bytes"] >= measured["optim_bytes"]    # the fullest rank; rank 0 below
    bench = (ROOT / "04_3d_combined/results/3d_bench.md").read_text()
    check_layouts = import_module("06_context_parallel.check_layouts")
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
    assert row(TINY, 4, 2, 1, sp=True)["comm_bytes"]["tp"] == 4 * (2 - 1) / 2 * 4 * (floats + (2 * L + 1) * D)
    assert row(TINY, 2, 1, 4, m=8)["comm_bytes"]["pp"] == 2 * 8 * (16 // 2 // 8) * S * D * 4
    cp = row(TINY, 2, 1, 1, cp=4, m=2)["comm_bytes"]["cp"]
    assert cp == L * 2 * attention_bookkeeping.cp_bytes("ring", 4, S, 4, 4, 16, 4)
    moe = layout_costs.Run(PRESETS["tiny-moe"], 16, 64, "fp32")
    T = 16 // 4 * 64                                                   # tokens per rank
    assert row(moe, 4, 1, 1, ep=4)["comm_bytes"]["ep"] == int(L * (8 * 3 / 4 * T * 2 * D * 4 + 16 * 3 * 8 // 4))


def test_memory_follows_the_zero_formulas_and_the_ledger():
    plain = row(TINY, 4, 1, 1, m=2)["memory_bytes"]
    assert (plain["params"], plain["grads"], plain["optim_bytes"]) == (M, M, 2 * M)            # M(1 + 1 + α)
    for stage, (params, grads, optim) in {1: (M, M, 2 * M / 4), 2: (M, M / 4, 2 * M / 4),
                                          3: (M / 4, M / 4, 2 * M / 4)}.items():       # what each stage shards
        mem = row(TINY, 4, 1, 1, m=2, zero=stage)["memory_bytes"]
        assert [mem["params"], mem["grads"], mem["optim_bytes"]] == [int(params), int(grads), int(optim)], stage
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
    assert not published["none"]["fits"] and published["full"]["fits"]
    assert published["full"]["bubble"] == pytest.approx(15 / (2 * 16 + 15))


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt5"], "--model gpt5: unknown model; choose one of tiny"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
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


def planner(*argv):
    return subprocess.run([sys.executable, "06_context_parallel/choose_layout.py", *argv], cwd=ROOT,
                          capture_output=True, text=True)


@pytest.mark.parametrize("argv, message", [
    (["--world", "0"], "error: --world must be a whole number ≥ 1 and ≤ 1048576, got 0; e.g. --world 8 (the default)"),
    (["--world", "1000000000"], "error: --world must be a whole number ≥ 1 and ≤ 1048576, got 1000000000"),
    (["--global-batch", "-3"], "error: --global-batch must be a whole number ≥ 1, got -3; e.g. --global-batch 16"),
    (["--seq-len", "x"], "error: --seq-len must be a whole number ≥ 1, got x; e.g. --seq-len 128"),
    (["--json", "/proc/x.json"], "error: --json /proc/x.json: cannot be created: '/proc' refuses new files"),
    (["--model", "gpt5"], "error: --model gpt5: unknown model; choose one of tiny"),
])
def test_command_line_names_the_bad_flag_in_one_line(argv, message):
    """Exit code 2 and one line that names the flag and what it accepts, as every training script says it."""
    proc = planner("--device", "h100", *argv)
    assert proc.returncode == 2 and proc.stderr.startswith(message), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and not proc.stdout


def test_nothing_fits_exits_1_after_writing_the_rows(tmp_path):
    """405B parameters on one 80 GiB GPU: every layout is printed and written, none fits, exit code 1."""
    out = tmp_path / "rows.json"
    proc = planner("--model", "llama3-405b", "--world", "1", "--device", "h100", "--json", str(out))
    assert proc.returncode == 1 and proc.stderr.startswith(
        "error: no layout of 1 h100 rank fits: the smallest, dp 1 × tp 1 × pp 1 × cp 1, recompute full, m=16, "
        "still holds 6,048.82 GiB per rank against 80.00 GiB; use more ranks (--world)"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and "(does not fit)" in proc.stdout
    rows = json.loads(out.read_text())
    assert rows and not any(r["fits"] for r in rows)
