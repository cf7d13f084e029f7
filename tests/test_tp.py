"""Chapter 02 tensor parallelism: every layout reproduces the single-device losses and gradient norms,
and every rank holds and sends the bytes the README's formulas say.

One spawned group per world size (2 and 4) runs the operator and layer checks of test_tp_ops.py (at 2
ranks, test_tp_ops.py runs most of them in a group of its own),
the training runs (TP, TP + sequence parallelism, TP × DP, DTensor, resume in another --tp) and
the bad-input runs, in order; check_activation_collectives below runs in those groups too."""
import os
import subprocess
import sys
from collections import Counter
from importlib import import_module

import pytest

from common.comm import collective_bytes
from common.model import PRESETS
from harness import REFUSAL_TIMEOUT_S, ROOT, assert_same_run, every_rank, ok, run_group

TP = import_module("02_tensor_parallel.tensor_parallel")

STEPS = 4           # steps 2..4 use AdamW's moments; the resume at step 2 leaves two to compare
BASE = ["--steps", str(STEPS), "--seq-len", "32", "--global-batch", "8", "--quiet"]
TRAIN = "02_tensor_parallel.train_tp:main"
PIECES = {2: [("test_tp_ops:check_partial_stage", True), ("test_tp:check_activation_collectives", False)],
          4: [("test_tp_ops:check_operators",), ("test_tp_ops:check_gather_then_column_linears",),
              ("test_tp_ops:check_layers", False),
              ("test_tp_ops:check_layers", True), ("test_tp_ops:check_vocab_parallel_loss",),
              ("test_tp_ops:check_kv_replicated",), ("test_tp:check_activation_collectives", True)]}
L, D, B, S = 8, 128, 8, 32                        # tiny preset; the runs' global batch and sequence length
FULL_BYTES, NORM_BYTES = 1_640_576 * 4, (2 * L + 1) * D * 4     # all parameters; the replicated norm gains
# name -> (extra flags, None for a training run | a piece of the message a bad input must get)
RUNS = {
    2: {"tp2": (["--tp", "2"], None),
        "tp2+sp": (["--tp", "2", "--sequence-parallel"], None),
        "torch tp2": (["--impl", "torch"], None),
        "bad tp": (["--tp", "3"], "does not divide the world size 2")},
    4: {"tp4": ([], None),
        "tp4+sp": (["--sequence-parallel"], None),
        "tp2×dp2+sp": (["--tp", "2", "--sequence-parallel"], None),
        "bad tp": (["--tp", "3"], "does not divide the world size 4"),
        "bad seq": (["--sequence-parallel", "--seq-len", "30"], "--seq-len 30 is not a multiple of 4")},
}


@pytest.fixture(scope="module")
def reference():
    (res,) = run_group(1, [(TRAIN, BASE)])
    return ok(res)


def check_bytes(history: list[dict], label: str) -> None:
    """One rank's parameter bytes and TP traffic per step against the README's formulas: every
    matrix split N ways, the norm gains whole (≈ 1/N of the model); per step 4L + 2 activation
    all-reduces of B·S·D floats each, 3 of B·S for the vocab-parallel loss, and with sequence
    parallelism 2L + 1 of D floats for the norm gains (an all-reduce counts 2·2(N-1)/N of its bytes,
    sent + received; SP's reduce-scatter + all-gather pair moves the same) and 2L + 1 all-gathers of
    B·S·D floats more, 2(N-1)/N each: every column-parallel entrance gathers its input again in backward."""
    row = history[-1]
    tp, dp, sp = row["tp"], row["dp"], row["sequence_parallel"]
    assert row["param_bytes"] == (FULL_BYTES - NORM_BYTES) / tp + NORM_BYTES, (label, row["param_bytes"])
    b = B // dp
    floats = (4 * L + 2) * b * S * D + 3 * b * S + sp * (2 * L + 1) * D
    regathered = sp * (2 * L + 1) * b * S * D
    assert row["comm_bytes_tp"] == 4 * (tp - 1) / tp * 4 * floats + 2 * (tp - 1) / tp * 4 * regathered, \
        (label, row["comm_bytes_tp"])
    # the same bytes, collective by collective, as the layout planner predicts them
    collectives = (TP.tp_collectives(PRESETS["tiny"], b, S, tp, sp, L) +
                   TP.tp_gradient_collectives(PRESETS["tiny"], tp, sp, L))
    assert row["comm_bytes_tp"] == sum(collective_bytes(kind, n, tp) for kind, n in collectives), label


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tp_ckpt"))


def _group(world, ckpt_dir):
    jobs = list(PIECES[world])
    for flags, _ in RUNS[world].values():
        jobs.append((TRAIN, BASE + flags))
    if world == 2:       # save at tp=2 (step 2), resume from step 2 at tp=1 × dp=2
        jobs.append((TRAIN, BASE + ["--tp", "2", "--checkpoint-dir", ckpt_dir, "--checkpoint-every", "2",
                                    "--steps", "2"]))
        jobs.append((TRAIN, BASE + ["--tp", "1", "--checkpoint-dir", ckpt_dir, "--resume"]))
    return jobs, run_group(world, jobs)


def check_activation_collectives(sp: bool):
    """One forward + backward of the tiny model, every TP collective logged on this rank: 4L + 2
    activation collectives of one B·S·D tensor each (with SP, each all-reduce becomes a reduce-scatter
    and an all-gather, and 2L + 1 all-gathers more in backward: the column-parallel entrances gather
    their input again), each counted at the ring formula's bytes; everything else is small."""
    import torch
    import torch.distributed as dist
    from common import comm
    from common.model import PRESETS, build_model
    tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")
    group, N = dist.group.WORLD, dist.get_world_size()
    cfg, B, S = PRESETS["tiny"], 2, 16
    calls, originals = [], {n: getattr(comm, n) for n in ("all_reduce", "all_gather_into", "reduce_scatter_into")}

    def logged(name):
        def call(*args, **kwargs):
            full = args[1] if name == "reduce_scatter_into" else args[0]       # the full-size tensor
            before = comm.COUNTER.total("tp")
            out = originals[name](*args, **kwargs)
            calls.append((name, full.numel(), comm.COUNTER.total("tp") - before))
            return out
        return call
    for name in originals:
        setattr(comm, name, logged(name))
    try:
        model = tensor_parallel.parallelize_model(build_model(cfg, 1), group, sp)
        tokens = torch.randint(0, 256, (B, S + 1), generator=torch.Generator().manual_seed(0))
        h = model.embed(tokens[:, :-1])
        for layer in model.layers:
            h = layer(h, model.rope_cos, model.rope_sin)
        tensor_parallel.tp_loss_sum(model.head(h), tokens[:, 1:], group).backward()
        tensor_parallel.sync_tp_gradients(model, group)
    finally:
        for name, fn in originals.items():
            setattr(comm, name, fn)
    bsd = B * S * cfg.dim
    # ring formula, bytes sent + received for n = 4·B·S·D: all-reduce 2·2(N-1)/N·n, the others 2·(N-1)/N·n
    ring = {"all_reduce": 4 * (N - 1) / N * 4 * bsd, "reduce_scatter_into": 2 * (N - 1) / N * 4 * bsd,
            "all_gather_into": 2 * (N - 1) / N * 4 * bsd}
    activations = [(name, nbytes) for name, numel, nbytes in calls if numel == bsd]
    L = cfg.n_layers
    want = {"reduce_scatter_into": 4 * L + 2, "all_gather_into": 6 * L + 3} if sp else {"all_reduce": 4 * L + 2}
    assert Counter(name for name, _ in activations) == want, calls
    assert all(nbytes == ring[name] for name, nbytes in activations), activations
    assert all(numel <= bsd / 16 for _, numel, _ in calls if numel != bsd), calls
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_tp_layouts_match_single_device(reference, ckpt_dir, world):
    jobs, results = _group(world, ckpt_dir)
    for job, res in zip(jobs, results[:len(PIECES[world])]):
        assert ok(res) is True, job
    runs = results[len(PIECES[world]):]
    for (name, (flags, expect)), res in zip(RUNS[world].items(), runs):
        if isinstance(expect, str):                     # bad input: the same message on every rank
            for kind, msg in res:
                assert kind == "config_error" and expect in msg, (name, kind, msg)
            continue
        assert_same_run(res, reference, f"{name}, world {world}")
        for rank, history in enumerate(every_rank(res)):
            if "torch" in name:                   # DTensor's collectives bypass our counter: not measured, not 0
                assert all(row["comm_bytes_tp"] is None and row["comm_bytes"] is None for row in history), (name, rank)
            else:
                check_bytes(history, f"{name}, rank {rank}")
    if world == 2:
        assert_same_run(runs[-2], reference[:2], "saved at tp=2")
        assert_same_run(runs[-1], reference[2:], "resumed at tp=1 × dp=2")


def test_bad_tp_under_torchrun():
    """A real launch: one clear line from rank 0, non-zero exit, no traceback from the script."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           str(ROOT / "02_tensor_parallel" / "train_tp.py"), "--sequence-parallel",
                           "--seq-len", "31", "--steps", "1", "--quiet"],
                          capture_output=True, text=True, timeout=REFUSAL_TIMEOUT_S, env=env, cwd=ROOT)
    assert proc.returncode != 0
    assert "error: --sequence-parallel splits each sequence over --tp 2" in proc.stderr
    assert "use a --seq-len divisible by 2" in proc.stderr
    assert proc.stderr.count("error: ") == 1                # rank 0 speaks, once
    assert 'train_tp.py", line' not in proc.stderr           # no traceback from our ranks (torchrun adds its own)
