"""--tp-overlap (02_tensor_parallel/tp_overlap.py): each decomposed operator against the plain one it replaces,
forward and backward, and its bytes against chapter 02's formulas in tp − 1 messages per ring; then every
script that has TP trained with it, equal to one device (loss 1e-6, gradient norm 1e-5 relative). The
operators time only what their caller hands them (a `span`: tp_trace.py).

The operators are equal to float round-off, not to the bit: the ring adds a chunk's partial sums in ring
order (gloo's reduce-scatter in its own), and a weight gradient is the sum of tp chunk products. One spawned
group per world size runs every check: 2 ranks (the operators, TP 2, TP 2 recomputing), 4 ranks (the
operators, TP 4, TP 2 × DP 2, with PP, with CP, with experts, the refusal); the references run on one rank."""
import sys
from collections import Counter
from contextlib import contextmanager
from importlib import import_module
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import comm                                         # noqa: E402
from common.activation_meter import saved_storages, storages    # noqa: E402
from harness import assert_one_config_error, assert_same_run, ok, run_group   # noqa: E402
from test_tp import check_bytes                                 # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)        # fp32 round-off of a sum of a handful of products


def _libs():
    return import_module("02_tensor_parallel.tp_operators"), import_module("02_tensor_parallel.tp_overlap")


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Messages:
    """Counts the messages common.comm.exchange sends from this rank (one per (outgoing, incoming) pair)."""

    def __enter__(self):
        self.count, original = 0, comm.exchange

        def counted(pairs, *args, **kw):
            self.count += len(pairs)
            return original(pairs, *args, **kw)
        self.patch = mock.patch.object(comm, "exchange", counted)
        self.patch.start()
        return self

    def __exit__(self, *exc):
        self.patch.stop()


def _bytes_and_messages(fn):
    """(TP bytes counted, messages sent) while `fn()` runs."""
    before = comm.COUNTER.total("tp")
    with Messages() as m:
        fn()
    return comm.COUNTER.total("tp") - before, m.count


def check_column_entrance():
    """The ring all-gather → q/k/v-like products against tp_operators.gather_then_column_linears: outputs,
    input and weight gradients; the shard alone kept for backward; forward one all-gather's bytes in tp − 1
    messages, backward an all-gather's and a reduce-scatter's in 2(tp − 1)."""
    tp_operators, tp_overlap = _libs()
    group, N, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    x_full = _randn(2, 4 * N, 8, seed=1)                                          # (B, S, D)
    w_full = [_randn(4 * N, 8, seed=2), _randn(2 * N, 8, seed=3)]                 # two column-parallel weights
    up = [_randn(2, 4 * N, w.shape[0] // N, seed=4 + i) for i, w in enumerate(w_full)]   # my features' dy
    runs = {}
    for name, op in (("plain", tp_operators.gather_then_column_linears),
                     ("ring", tp_overlap.ring_gather_then_column_linears)):
        x = x_full.chunk(N, 1)[r].clone().requires_grad_()                       # (B, S/N, D)
        ws = [w.chunk(N, 0)[r].clone().requires_grad_() for w in w_full]        # (out_i/N, D)
        with saved_storages(storages(ws)) as kept:
            fwd = _bytes_and_messages(lambda: runs.setdefault(name, op(x, ws, group)))
        assert sum(kept.values()) == x.numel() * 4, kept                        # the shard, nothing more
        bwd = _bytes_and_messages(lambda: sum((y * u).sum() for y, u in zip(runs[name], up)).backward())
        runs[name] = (runs[name], x.grad, [w.grad for w in ws], fwd, bwd)
    (ys, dx, dws, fwd, bwd), (ys0, dx0, dws0, fwd0, bwd0) = runs["ring"], runs["plain"]
    for y, y0 in zip(ys, ys0):
        torch.testing.assert_close(y, y0, **TOL)
    torch.testing.assert_close(dx, dx0, **TOL)
    for dw, dw0 in zip(dws, dws0):
        torch.testing.assert_close(dw, dw0, **TOL)
    gathered = x_full.numel() * 4
    assert fwd == (fwd0[0], N - 1) == (comm.collective_bytes("all_gather", gathered, N), N - 1), (fwd, fwd0)
    assert bwd == (bwd0[0], 2 * (N - 1)), (bwd, bwd0)
    return True


def check_row_exit():
    """The row-parallel product → ring reduce-scatter against F.linear then reduce_scatter_to_sequence_
    parallel_region: output, input and weight gradients; one reduce-scatter's bytes forward and one
    all-gather's backward, each in tp − 1 messages."""
    tp_operators, tp_overlap = _libs()
    group, N, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    x_full, w_full = _randn(2, 4 * N, 6 * N, seed=5), _randn(8, 6 * N, seed=6)   # (B, S, F), (D, F)
    up = _randn(2, 4 * N, 8, seed=7).chunk(N, 1)[r]                               # dy of my positions
    runs = {}
    plain = lambda x, w, g: tp_operators.reduce_scatter_to_sequence_parallel_region(F.linear(x, w), g)  # noqa: E731
    for name, op in (("plain", plain), ("ring", tp_overlap.row_linear_then_ring_reduce_scatter)):
        x = x_full.chunk(N, -1)[r].clone().requires_grad_()                       # (B, S, F/N)
        w = w_full.chunk(N, 1)[r].clone().requires_grad_()                         # (D, F/N)
        fwd = _bytes_and_messages(lambda: runs.setdefault(name, op(x, w, group)))
        bwd = _bytes_and_messages(lambda: (runs[name] * up).sum().backward())
        runs[name] = (runs[name], x.grad, w.grad, fwd, bwd)
    (y, dx, dw, fwd, bwd), (y0, dx0, dw0, fwd0, bwd0) = runs["ring"], runs["plain"]
    for got, want in ((y, y0), (dx, dx0), (dw, dw0)):
        torch.testing.assert_close(got, want, **TOL)
    full = 2 * 4 * N * 8 * 4                                                      # (B, S, D) fp32 bytes
    assert fwd == (fwd0[0], N - 1) == (comm.collective_bytes("reduce_scatter", full, N), N - 1), (fwd, fwd0)
    assert bwd == (bwd0[0], N - 1) == (comm.collective_bytes("all_gather", full, N), N - 1), (bwd, bwd0)
    return True


def check_ring_exact_chunks():
    """Each chunk lands where it belongs: integer-valued inputs make every sum exact, so the ring must equal
    the plain operators to the bit (a chunk multiplied against the wrong shard is off by whole numbers)."""
    tp_operators, tp_overlap = _libs()
    group, N, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    x = torch.arange(2 * 2 * 3, dtype=torch.float32).view(2, 2, 3) + 10 * r       # (B, S/N, D), rank-distinct
    w = torch.arange(4 * 3, dtype=torch.float32).view(4, 3) - r                     # (out/N, D)
    with torch.no_grad():
        (ring,), (plain,) = (tp_overlap.ring_gather_then_column_linears(x, [w], group),
                             tp_operators.gather_then_column_linears(x, [w], group))
        assert torch.equal(ring, plain)
        h = torch.arange(2 * 2 * N * 5, dtype=torch.float32).view(2, 2 * N, 5) * (r + 1)   # (B, S, F/N)
        wo = torch.arange(3 * 5, dtype=torch.float32).view(3, 5) + r                          # (D, F/N)
        assert torch.equal(tp_overlap.row_linear_then_ring_reduce_scatter(h, wo, group),
                           tp_operators.reduce_scatter_to_sequence_parallel_region(F.linear(h, wo), group))
    return True


def check_spans_handed_in():
    """The operators time what their caller hands them (parallelize_model(span=...)), nothing else: every SP
    collective of a step as "collective"; under --tp-overlap every ring step's post, compute and wait, tp
    steps per ring (4 rings per block forward and backward, and the head's entrance's 2); and a timed step's
    gradients equal an untimed one's to the bit."""
    tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")
    overlap_tp = import_module("02_tensor_parallel.overlap_tp")
    from common.model import PRESETS, build_model
    group, N, cfg = dist.group.WORLD, dist.get_world_size(), PRESETS["tiny"]
    x = torch.randint(0, cfg.vocab_size, (1, 8 * N), generator=torch.Generator().manual_seed(0))   # (B, S)
    for overlap in (False, True):
        seen, grads = [], []

        @contextmanager
        def span(kind, **labels):
            seen.append((kind, labels.get("ring_step")))
            yield
        for timer in ({}, {"span": span}):
            model = tensor_parallel.parallelize_model(build_model(cfg, 1337), group, True, overlap=overlap, **timer)
            overlap_tp.forward_backward(model, x, x.roll(-1, 1), group)
            grads.append([p.grad for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads))
        rings = {kind: [t for k, t in seen if k == kind] for kind in ("post", "compute", "wait")}
        if overlap:                                     # each ring step t of 8 rings a block and the head's 2
            want = sorted(list(range(N)) * (8 * cfg.n_layers + 2))
            assert all(sorted(t) == want for t in rings.values()), Counter(seen)
            assert [k for k, _ in seen].count("collective") == 2, Counter(seen)   # the embedding's: before no matmul
        else:
            assert not any(rings.values()) and [k for k, _ in seen].count("collective") == 10 * cfg.n_layers + 5
    return True


OPERATORS = [("test_tp_overlap:check_column_entrance",), ("test_tp_overlap:check_row_exit",),
             ("test_tp_overlap:check_ring_exact_chunks",), ("test_tp_overlap:check_spans_handed_in",)]

# --- every script that has TP, with --tp-overlap, against one device ------------------------------------

TP_SCRIPT, THREE, FOUR, FIVE = ("02_tensor_parallel.train_tp:main", "04_3d_combined.train_3d:main",
                                "05_moe_expert_parallel.train_4d:main", "06_context_parallel.train_5d:main")
TP_BASE = ["--steps", "3", "--seq-len", "32", "--global-batch", "8", "--quiet"]
BASE = TP_BASE + ["--sample-tokens", "0", "--val-every", "2", "--val-batches", "1"]
MOE = ["--model", "tiny-moe"]
OVERLAP = ["--sequence-parallel", "--tp-overlap"]
REFERENCES = {"tp": (TP_SCRIPT, TP_BASE), "dense": (THREE, BASE), "moe": (FOUR, BASE + MOE)}
# world -> name -> (script, flags, reference, check chapter 02's bytes formula)
RUNS = {2: {"tp 2": (TP_SCRIPT, TP_BASE + OVERLAP + ["--tp", "2"], "tp", True),
            "tp 2, --recompute full": (TP_SCRIPT, TP_BASE + OVERLAP + ["--tp", "2", "--recompute", "full"], "tp",
                                       False)},
        4: {"tp 4": (TP_SCRIPT, TP_BASE + OVERLAP, "tp", True),
            "tp 2 × dp 2": (TP_SCRIPT, TP_BASE + OVERLAP + ["--tp", "2"], "tp", True),
            "tp 2 × pp 2": (THREE, BASE + OVERLAP + ["--dp", "1", "--tp", "2", "--pp", "2"], "dense", False),
            "tp 2 × cp 2": (FIVE, BASE + OVERLAP + ["--model", "tiny", "--dp", "1", "--tp", "2", "--pp", "1",
                                                    "--cp", "2"], "dense", False),
            "tp 2 × ep 2, experts": (FOUR, BASE + MOE + OVERLAP + ["--dp", "2", "--ep", "2", "--tp", "2",
                                                                  "--pp", "1"], "moe", False)}}
REFUSAL = (TP_SCRIPT, TP_BASE + ["--tp-overlap"], "--tp-overlap decomposes sequence parallelism's all-gather "
                                                  "and reduce-scatter; add --sequence-parallel")


def _jobs(world):
    return OPERATORS + [(script, flags) for script, flags, _, _ in RUNS[world].values()] + \
        ([REFUSAL[:2]] if world == 4 else [])


@pytest.fixture(scope="module")
def reference():
    """The one-device runs, each made when a test first needs it (TP 2 needs train_tp.py's alone)."""
    class Runs(dict):
        def __missing__(self, name):
            (res,) = run_group(1, [REFERENCES[name]], timeout_s=600)
            self[name] = ok(res)
            return self[name]
    return Runs()


@pytest.fixture(scope="module")
def groups():
    return {}


def _results(groups, world):
    if world not in groups:
        groups[world] = run_group(world, _jobs(world), timeout_s=900)
    return groups[world]


@pytest.mark.parametrize("world", [2, 4])
def test_operators_equal_the_plain_ones(groups, world):
    for job, res in zip(OPERATORS, _results(groups, world)):
        assert ok(res) is True, job


@pytest.mark.parametrize("world", [2, 4])
def test_overlapped_runs_match_one_device(groups, reference, world):
    results = _results(groups, world)[len(OPERATORS):]
    for (name, (_, _, ref, bytes_formula)), res in zip(RUNS[world].items(), results):
        history = assert_same_run(res, reference[ref], f"--tp-overlap, {name}")
        if bytes_formula:        # the same bytes as plain sequence parallelism: chapter 02's formulas
            check_bytes(history, f"--tp-overlap, {name}")


def test_overlap_without_sequence_parallel_is_refused(groups):
    assert_one_config_error(_results(groups, 4)[-1], REFUSAL[2])
