"""Chapter 03 pipeline parallelism: every schedule reproduces the single-device run (losses and gradient
norms on every rank), 1F1B keeps the activations the README says, bad input fails fast."""
import os
import subprocess
import sys

import pytest
import torch

from harness import REFUSAL_TIMEOUT_S, ROOT, assert_same_run, every_rank, ok, run_group

STEPS = 4           # steps 2..4 use AdamW's moments; a resume at step 2 leaves two to compare
RESUME_AT = 2
BASE = ["--steps", str(STEPS), "--seq-len", "32", "--global-batch", "8", "--quiet"]
PP = "03_pipeline_parallel.train_pp:main"


def final_weights(directory):
    from common import checkpoint
    return torch.load(checkpoint.latest_path(directory), weights_only=True)["model"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ref")
    (res,) = run_group(1, [(PP, BASE + ["--checkpoint-dir", str(ckpt)])])
    return ok(res), final_weights(ckpt)


def check_weights(directory, reference, label):
    mine, ref = final_weights(directory), reference[1]
    assert set(mine) == set(ref), f"{label}: the consolidated checkpoint misses parameters"
    for name in ref:
        torch.testing.assert_close(mine[name], ref[name], rtol=1e-4, atol=1e-6, msg=f"{label}: {name}")


BAD = [  # (flags, a piece of the expected message)
    (["--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "1"], "multiple of --pp"),
    (["--schedule", "1f1b", "--virtual-stages", "2", "--microbatches", "4"], "only works with --schedule interleaved"),
    (["--schedule", "interleaved", "--virtual-stages", "8", "--microbatches", "4"], "too few for"),
    (["--microbatches", "3"], "does not split"),
    (["--pp", "3"], "does not divide the world size"),
    (["--impl", "torch", "--no-activation-meter"], "--no-activation-meter is for the course's own --impl"),
]


def test_world_2(reference, tmp_path):
    configs = {  # label -> flags
        "gpipe m=1": ["--schedule", "gpipe", "--microbatches", "1"],
        "gpipe m=4": ["--schedule", "gpipe", "--microbatches", "4"],
        "1f1b m=2": ["--schedule", "1f1b", "--microbatches", "2"],
        "1f1b m=4": ["--schedule", "1f1b", "--microbatches", "4"],
        "1f1b m=4 no meter": ["--schedule", "1f1b", "--microbatches", "4", "--no-activation-meter"],
        "interleaved v=2 m=2": ["--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "2"],
        "interleaved v=2 m=4": ["--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "4"],
        # 10 chunks for 8 layers: the first holds the embedding alone, the last the head alone (Llama 3's)
        "interleaved v=5 m=2": ["--schedule", "interleaved", "--virtual-stages", "5", "--microbatches", "2"],
        "zb-h1 m=1": ["--schedule", "zb-h1", "--microbatches", "1"],
        "zb-h1 m=4": ["--schedule", "zb-h1", "--microbatches", "4"],
        "dp=2 pp=1": ["--pp", "1", "--microbatches", "2"],
        "torch 1f1b m=2": ["--impl", "torch", "--schedule", "1f1b", "--microbatches", "2"],
        # the V at p = 2: rank 0 holds stages 0 and 3 (embedding and loss), rank 1 stages 1 and 2
        "zb-v m=4": ["--schedule", "zb-v", "--microbatches", "4"],
        "dualpipev m=4": ["--schedule", "dualpipev", "--microbatches", "4"],
        "torch dualpipev m=4": ["--impl", "torch", "--schedule", "dualpipev", "--microbatches", "4"],
    }
    ck = {label: tmp_path / label.replace(" ", "_") for label in ("interleaved v=2 m=4", "zb-h1 m=4")}
    jobs = [(PP, BASE + flags + (["--checkpoint-dir", str(ck[label])] if label in ck else []))
            for label, flags in configs.items()]
    # resume: 2 steps with pp=2, then steps 3..4 resumed as dp=2 × pp=1 (another layout)
    resume_dir = tmp_path / "resume"
    jobs += [(PP, BASE[:1] + [str(RESUME_AT)] + BASE[2:] + ["--microbatches", "2", "--checkpoint-dir", str(resume_dir)]),
             (PP, BASE + ["--pp", "1", "--microbatches", "2", "--checkpoint-dir", str(resume_dir), "--resume"])]
    jobs += [(PP, BASE + flags) for flags, _ in BAD]
    results = run_group(2, jobs)
    n = len(configs)
    for label, res in zip(configs, results[:n]):
        assert_same_run(res, reference[0], f"{label}, world 2")
    for label, directory in ck.items():
        check_weights(directory, reference, label)
    # the activation meter only counts: without it the same bits, and a peak that is null, not a number
    labels = list(configs)
    metered, unmetered = (every_rank(results[labels.index(k)]) for k in ("1f1b m=4", "1f1b m=4 no meter"))
    for with_meter, without in zip(metered, unmetered):
        assert [r["loss"] for r in with_meter] == [r["loss"] for r in without], "the meter changed the losses"
        assert with_meter[-1]["peak_activation_bytes"] and without[-1]["peak_activation_bytes"] is None
        assert without[-1]["bubble_fraction"] is not None, "the timeline stays on without the meter"
    # the stages that hold no layer: each rank's activations as the ledger predicts them
    row = ok(results[labels.index("interleaved v=5 m=2")])[-1]
    peaks, predicted = row["peak_activation_bytes"], row["activation_bytes_predicted"]
    assert all(abs(a - b) <= 0.01 * b for a, b in zip(peaks, predicted)), (peaks, predicted)
    assert_same_run(results[n], reference[0][:RESUME_AT], f"{RESUME_AT} steps at pp=2")
    assert_same_run(results[n + 1], reference[0][RESUME_AT:], "resumed as dp=2 × pp=1")
    for (flags, expected), res in zip(BAD, results[n + 2:]):
        for kind, message in res:                    # the same clear message on every rank
            assert kind == "config_error" and expected in message, (flags, kind, message)


def test_world_4(reference, tmp_path):
    configs = {
        "gpipe m=8": ["--schedule", "gpipe", "--microbatches", "8"],
        "1f1b m=1": ["--schedule", "1f1b", "--microbatches", "1"],
        "1f1b m=8": ["--schedule", "1f1b", "--microbatches", "8"],
        "interleaved v=2 m=4": ["--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "4"],
        "zb-h1 m=4": ["--schedule", "zb-h1", "--microbatches", "4"],
        "dp=2 × pp=2 1f1b m=2": ["--pp", "2", "--schedule", "1f1b", "--microbatches", "2"],
        # zero bubble under data parallelism: a stage's all-reduce must wait for its last W, not its last B
        "dp=2 × pp=2 zb-h1 m=2": ["--pp", "2", "--schedule", "zb-h1", "--microbatches", "2"],
        "torch zb-h1": ["--impl", "torch", "--schedule", "zb-h1", "--microbatches", "4"],
        "zb-v m=8": ["--schedule", "zb-v", "--microbatches", "8"],
        "dualpipev m=8": ["--schedule", "dualpipev", "--microbatches", "8"],
        "dp=2 × pp=2 zb-v m=2": ["--pp", "2", "--schedule", "zb-v", "--microbatches", "2"],     # fewer than 2p-1
        "dp=2 × pp=2 dualpipev m=4": ["--pp", "2", "--schedule", "dualpipev", "--microbatches", "4"],
        "torch zb-v m=8": ["--impl", "torch", "--schedule", "zb-v", "--microbatches", "8"],
    }
    trace, ck = tmp_path / "trace.json", tmp_path / "ck"
    extra = {"1f1b m=8": ["--timeline", str(trace), "--checkpoint-dir", str(ck)]}
    jobs = [(PP, BASE + flags + extra.get(label, [])) for label, flags in configs.items()]
    results = run_group(4, jobs)
    for label, res in zip(configs, results):
        assert_same_run(res, reference[0], f"{label}, world 4")
    check_weights(ck, reference, "1f1b m=8")
    # Activation memory: GPipe keeps all m micro-batches of a stage alive until its first backward;
    # 1F1B keeps at most p - r on rank r (stage 0: p). Every rank reports every stage's peak.
    p, m = 4, 8
    for gpipe, one_f_one_b in zip(every_rank(results[0]), every_rank(results[2])):
        for r, (g, o) in enumerate(zip(gpipe[-1]["peak_activation_bytes"], one_f_one_b[-1]["peak_activation_bytes"])):
            assert o * m == g * min(p - r, m), (r, g, o)          # per micro-batch: the same bytes
    from common.timeline import bubble_fraction, load_trace
    events, meta = load_trace(trace)
    assert meta["schedule"] == "1f1b" and {e["rank"] for e in events} == {0, 1, 2, 3}
    last = [e for e in events if e.get("step") == STEPS]
    assert sum(e["kind"] == "F" for e in last) == 4 * 8 and sum(e["kind"] == "B" for e in last) == 4 * 8
    assert 0 < bubble_fraction(last) < 1
    history = ok(results[2])
    assert len(history[-1]["peak_activation_bytes"]) == 4 and history[-1]["comm_bytes_pp"] > 0
    # The V balances the activations: every rank holds one stage near the input and one near the output,
    # so its peaks are equal within the head's share, where 1F1B's fall from p micro-batches to one; the
    # ledger (activation_bytes_predicted) predicts each rank's peak as it does for the other schedules.
    labels = list(configs)
    for label in ("zb-v m=8", "dualpipev m=8"):
        row = ok(results[labels.index(label)])[-1]
        peaks, predicted = row["peak_activation_bytes"], row["activation_bytes_predicted"]
        assert max(peaks) < 1.05 * min(peaks), (label, peaks)
        assert all(abs(a - b) <= 0.01 * b for a, b in zip(peaks, predicted)), (label, peaks, predicted)
    one_f_one_b_peaks = history[-1]["peak_activation_bytes"]
    assert max(one_f_one_b_peaks) > 3 * min(one_f_one_b_peaks)
    torch_row = ok(results[list(configs).index("torch zb-h1")])[-1]          # torch's runtime: no timeline, no activation meter
    assert torch_row["bubble_fraction"] is None and torch_row["peak_activation_bytes"] is None, \
        "a quantity torch's runtime does not measure is null, never a number"


def test_torchrun_bad_input_exits_cleanly():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "03_pipeline_parallel/train_1f1b.py",
           "--virtual-stages", "2", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=REFUSAL_TIMEOUT_S)
    assert proc.returncode != 0
    assert "error: --virtual-stages 2 only works with --schedule interleaved" in proc.stderr
    for script in ("train_1f1b.py", "train_pp.py", "pipeline_schedules.py"):     # no traceback from our ranks
        assert f'{script}", line' not in proc.stderr
