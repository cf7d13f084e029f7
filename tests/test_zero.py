"""Chapter 01 part two, ZeRO: every stage reproduces the single-device run (losses and gradient
norms), holds on every rank the bytes the formulas say, resumes exactly, and rejects bad input with
one clear message; stage 2's gradient hook alone gives each rank its shard of the twin's summed gradient."""
import os
import subprocess
import sys
import weakref
from importlib import import_module
from pathlib import Path

import pytest

from harness import REFUSAL_TIMEOUT_S, ROOT, assert_same_run, every_rank, grad_norms, losses, ok, run_group

ZERO_ACCOUNTING = import_module("01_data_parallel.zero_accounting")

STEPS = 4           # steps 2..4 use AdamW's moments; a resume at step 2 leaves two to compare
BASE = ["--steps", str(STEPS), "--seq-len", "32", "--global-batch", "8", "--quiet"]
ZERO = "01_data_parallel.train_zero:main"
M = 1_640_576 * 4          # tiny preset: parameters × 4 bytes (fp32)


def point_latest_at(directory: str, step: int) -> None:
    """A job run on every rank: make `latest` name an earlier checkpoint (as if the run had stopped there)."""
    import torch.distributed as dist
    if dist.get_rank() == 0:
        (Path(directory) / "latest").write_text(f"step_{step:06d}.pt")
    dist.barrier()


def alive(refs, patience_s: float = 1.0) -> list:
    """Units whose gathered buffer is still alive. The backend's worker thread may hold a finished
    all-gather's output for a moment after wait() returns, so give it a second: a buffer that is
    still referenced after that is really kept alive (by us or by autograd)."""
    import gc
    import time
    deadline = time.time() + patience_s
    while True:
        gc.collect()
        left = [u for u, r in refs if r() is not None]
        if not left or time.time() > deadline:
            return left
        time.sleep(0.05)


def stage3_frees_gathered_weights() -> dict:
    """A job: after forward, no gathered unit is alive (autograd keeps notes, not weights); after
    backward, none either; and the backward re-gathered every unit but the embedding."""
    import torch
    import torch.distributed as dist
    from importlib import import_module
    from common.model import PRESETS, build_model
    zero_sharding = import_module("01_data_parallel.zero_sharding")
    zero_stage3 = import_module("01_data_parallel.zero_stage3")
    model = build_model(PRESETS["tiny"], 1)
    zero = zero_stage3.ZeroStage3(model, zero_sharding.model_units(model), dist.group.WORLD, 1e-3, 0.1,
                                  tokens_per_step=2 * 16)
    refs, issue = [], zero._issue_gather

    def spy(u):
        new = 0 <= u < len(zero.units) and zero._full[u] is None
        issue(u)
        if new:
            refs.append((u, weakref.ref(zero._full[u])))
    zero._issue_gather = spy
    out = zero.forward(torch.randint(0, 256, (2, 16)))
    after_forward = alive(refs)
    refs.clear()
    out.float().pow(2).mean().backward()
    zero.sync_gradients()
    return {"after_forward": after_forward, "after_backward": alive(refs),
            "regathered": sorted(u for u, _ in refs), "peak": zero.peak_param_bytes}


def stage2_gradient_shards() -> dict:
    """A job: ZeRO stage 2's gradient hook alone, on a two-unit toy, against its single-device twin.

    y = (x @ w1 + b1) @ w2 + b2, loss = sum(y * c); unit 0 = (w1, b1), 15 elements, unit 1 = (w2, b2),
    7 elements: both padded to 16 and 8 at N = 2. Two micro-batches, each rank its own x and c. Every
    value is a small integer, so every sum is exact in any order: the shards must match bit for bit."""
    import torch
    import torch.distributed as dist
    from importlib import import_module
    zero_sharding = import_module("01_data_parallel.zero_sharding")
    rank, world = dist.get_rank(), dist.get_world_size()

    def ints(seed, *shape):                               # small integers held as fp32: exact arithmetic
        return torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(seed)).float()

    shapes = {"w1": (4, 3), "b1": (3,), "w2": (3, 2), "b2": (1,)}
    init = {n: ints(i, *s) for i, (n, s) in enumerate(shapes.items())}
    batch = {(r, mb): (ints(100 + 10 * r + mb, 2, 4), ints(200 + 10 * r + mb, 2, 2))   # x (2, 4), c (2, 2)
             for r in range(world) for mb in range(2)}

    def loss(p, x, c):
        return (((x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]) * c).sum()

    # The twin: one device, every rank's micro-batches, the gradients summed (what the DP group adds up).
    twin = {n: t.clone().requires_grad_() for n, t in init.items()}
    for (r, mb), (x, c) in batch.items():
        loss(twin, x, c).backward()

    params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    fired = []                                            # registered first: runs before ZeRO's hook
    for p in params.values():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    units = [("first", [(n, params[n]) for n in ("w1", "b1")]), ("second", [(n, params[n]) for n in ("w2", "b2")])]
    opt = zero_sharding.ZeroOptimizer([nv for _, named in units for nv in named], dist.group.WORLD,
                                      1e-3, 0.1, stage=2, units=units)
    launches, launch = [], opt.reduce_scatter.launch
    opt.reduce_scatter.launch = lambda u, full: (launches.append((u, len(fired))), launch(u, full))
    kept = []
    for mb in range(2):
        loss(params, *batch[(rank, mb)]).backward()
        kept += [f"micro-batch {mb}: {n}" for n, p in params.items() if p.grad is not None]
    opt.sync_gradients()
    want = [u.flatten([twin[n].grad for n in u.names])[u.lo:u.hi] for u in opt.units]   # (padded/N,) each
    return {"shards": [g.tolist() for g in opt.shard_grads], "want": [w.tolist() for w in want],
            "spans": [(u.lo, u.hi) for u in opt.units], "launches": launches, "kept": kept}


@pytest.fixture(scope="module")
def reference():
    results = run_group(1, [("01_data_parallel.train_dp:main", BASE)] +
                           [(ZERO, BASE + ["--zero-stage", s]) for s in "123"])
    ref = ok(results[0])
    for stage, res in zip("123", results[1:]):    # world size 1: every stage is the reference itself
        assert_same_run(res, ref, f"zero-{stage} world 1")
    return ref


def test_two_ranks(reference, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    save = BASE + ["--zero-stage", "3", "--checkpoint-dir", ckpt, "--checkpoint-every", "2"]
    jobs = [(ZERO, BASE + ["--zero-stage", s]) for s in "123"]                          # 0-2
    jobs += [(ZERO, BASE + ["--zero-stage", "3", "--impl", "torch"])]                   # 3
    jobs += [(ZERO, save), ("test_zero:point_latest_at", ckpt, 2), (ZERO, save + ["--resume"])]   # 4-6
    jobs += [(ZERO, BASE + ["--zero-stage", "1", "--checkpoint-dir", ckpt, "--resume"])]          # 7
    jobs += [(ZERO, BASE + ["--zero-stage", "4"]),                                      # 8
             (ZERO, BASE[:-3] + ["--global-batch", "7", "--quiet"]),                    # 9
             (ZERO, BASE + ["--impl", "torch", "--checkpoint-dir", ckpt + "_torch"]),   # 10
             ("test_zero:stage3_frees_gathered_weights",)]                              # 11
    r = run_group(2, jobs)
    for i, name in enumerate(["stage 1", "stage 2", "stage 3", "FSDP2"]):
        assert_same_run(r[i], reference, f"zero {name}, N=2")
    full, resumed = ok(r[4]), ok(r[6])
    assert [row["step"] for row in resumed] == list(range(3, STEPS + 1))
    assert losses(resumed) == losses(full)[2:]                    # exact: same bits after resuming
    assert grad_norms(resumed) == grad_norms(full)[2:]
    expected = {7: "zero_stage=3 but this run has zero_stage=1", 8: "invalid choice: 4",
                9: "use a multiple of 2", 10: "--impl ours only"}
    for i, text in expected.items():
        assert [kind for kind, _ in r[i]] == ["config_error"] * 2, r[i]
        assert text in r[i][0][1], r[i][0][1]
    block = 4 * (2 * 128 + 128 * 128 * 2 + 2 * 128 * 64 + 3 * 128 * 384)
    for rank, freed in enumerate(every_rank(r[11])):               # each rank gathers and frees its own
        assert freed["after_forward"] == [] and freed["after_backward"] == [], (rank, freed)
        assert freed["regathered"] == list(range(1, 10)), rank         # every unit but the embedding
        assert freed["peak"] == 2 * block, rank                         # one unit + the prefetched next one


def test_stage2_reduce_scatters_each_unit_once_its_gradients_exist():
    """ZeroOptimizer._on_grad_ready alone (stage 2), two ranks, two micro-batches: each unit's flat gradient
    is reduce-scattered as soon as its last gradient exists, the full gradients are freed, and each
    rank's shard holds its slice of the gradient summed over ranks and micro-batches. Its own small group,
    not test_two_ranks's: the exercise's quick grade (its unit tests alone) then runs no training."""
    for rank, got in enumerate(every_rank(run_group(2, [("test_zero:stage2_gradient_shards",)])[0])):
        assert got["launches"] == [(1, 2), (0, 4), (1, 6), (0, 8)], \
            f"rank {rank}: reduce-scatters launched as (unit, gradients ready so far) {got['launches']}; " \
            f"expected [(1, 2), (0, 4), (1, 6), (0, 8)]: each unit once per backward, as soon as its own " \
            f"2 gradients exist (unit 1 is nearer the loss, so first)"
        assert got["kept"] == [], f"rank {rank}: after backward these .grad still hold a full gradient " \
                                  f"(set q.grad = None once the unit is flattened): {got['kept']}"
        for u, (shard, want, (lo, hi)) in enumerate(zip(got["shards"], got["want"], got["spans"])):
            assert shard == want, f"rank {rank}: shard_grads[{u}] = {shard}; expected {want}, elements {lo}:{hi} " \
                                  f"of unit {u}'s padded flat gradient summed over 2 ranks and 2 micro-batches"


def test_four_ranks_equivalence_memory_and_bytes(reference):
    N = 4
    r = run_group(N, [(ZERO, BASE + ["--zero-stage", s]) for s in "123"] +
                     [(ZERO, BASE + ["--zero-stage", "1", "--impl", "torch", "--microbatches", "2"])])
    last = {}
    for s, res in zip((1, 2, 3, "torch-1"), r):
        assert_same_run(res, reference, f"zero-{s}, N=4")
        last[s] = [history[-1] for history in every_rank(res)]
    # Padding: each of the 10 units is padded to a multiple of N, fewer than N elements each.
    pad = 10 * (N - 1) * 4
    for rank in range(N):                       # every rank holds its own shard: each must fit the formula
        rows = {s: last[s][rank] for s in (1, 2, 3)}
        at_rest = {s: rows[s]["param_bytes"] + rows[s]["grad_bytes"] + rows[s]["optim_bytes"] for s in (1, 2, 3)}
        assert abs(at_rest[3] - 4 * M / N) <= 0.05 * (4 * M / N), rank     # a quarter of plain DP's 4M
        assert 4 * M / N <= at_rest[3] <= 4 * M / N + 4 * pad / N, rank
        assert 2 * M + 2 * M / N <= at_rest[1] <= 2 * M + 2 * M / N + 3 * pad, rank   # 2M + αM/N
        assert M + 3 * M / N <= at_rest[2] <= M + 3 * M / N + 2 * pad, rank           # M + (1+α)M/N
        # Bytes sent per step: all-reduce 2(N-1)/N, all-gather and reduce-scatter (N-1)/N each.
        Mp = rows[1]["param_bytes"]                                # M + padding
        assert rows[1]["comm_bytes_sent"] == pytest.approx(3 * (N - 1) / N * Mp, abs=16), rank
        assert rows[2]["comm_bytes_sent"] == pytest.approx(2 * (N - 1) / N * Mp, abs=16), rank
        for s in (1, 2):                                           # the planner's formula, the same numbers
            assert rows[s]["comm_bytes_sent"] == pytest.approx(ZERO_ACCOUNTING.zero_sent_share(s, N) * Mp, abs=16)
        embed = 256 * 128 * 4                                      # not re-gathered for backward
        assert rows[3]["comm_bytes_sent"] == pytest.approx(3 * (N - 1) / N * Mp - (N - 1) / N * embed, abs=16), rank
    # chapter 07's planner runs a dense layout of DP alone under ZeRO-3 as this chapter's: its bytes per step and
    # its weights at the peak (the shard and the two units gathered at once) are this run's
    layout_costs = import_module("07_choosing_a_layout.layout_costs")
    from common.model import PRESETS
    run = layout_costs.Run(PRESETS["tiny"], 8, 32, "fp32")
    c = layout_costs.Candidate(dp=N, zero_stage=3)
    planned = layout_costs.predict(run, c, import_module("07_choosing_a_layout.layout_inputs").device_for("cpu", "fp32", N), 8)
    row0 = last[3][0]
    assert planned["comm_bytes"]["dp"] == row0["comm_bytes"]
    assert planned["memory_bytes"]["params"] == row0["param_bytes"] + row0["peak_param_bytes"]
    assert planned["memory_bytes"]["held_between_steps"] == row0["param_bytes"] + row0["grad_bytes"] + row0["optim_bytes"]


def test_torchrun_rejects_bad_stage():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node=2",
                           "01_data_parallel/train_zero.py", "--zero-stage", "0", "--quiet"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=REFUSAL_TIMEOUT_S)
    assert proc.returncode != 0
    assert "error: argument --zero-stage: invalid choice: 0" in proc.stderr
    assert 'train_zero.py", line' not in proc.stderr            # one line, no traceback from our ranks
