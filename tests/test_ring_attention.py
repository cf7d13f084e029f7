"""Chapter 06's attention alone: ring, all-gather-KV, all-to-all (Ulysses) and hybrid (all-to-all over K = 2
ranks, ring across) attention against single-device scaled_dot_product_attention, and the split of the
sequence that decides each rank's positions and work.

One spawned group of 4 ranks runs `check_attention` (below) at cp 1 (four groups of one), cp 2 (two groups
of two) and cp 4: every variant, split, dtype, MHA and GQA, on random shapes. Each rank returns what it
measured; the tests here compare. The split's own tests need no ranks."""
import itertools
import random
import sys
from importlib import import_module
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import every_rank, run_group

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.errors import ConfigError                              # noqa: E402

RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}       # norm of the difference / norm of the reference
CASES = list(itertools.product(("ring", "allgather"), ("zigzag", "contiguous"), (torch.float32, torch.float64),
                               (False, True)))       # variant, split, dtype, GQA
# the all-to-all variants after the others (the others' random shapes stay as they were): their heads and KV
# heads are multiples of the all-to-all's degree (cp, or K = 2 for the hybrid)
CASES += list(itertools.product(("alltoall", "alltoall+ring"), ("zigzag", "contiguous"), (torch.float32, torch.float64),
                                (False, True)))


def _chapter():
    return (import_module("06_context_parallel.cp_split"), import_module("06_context_parallel.ring_attention"),
            import_module("06_context_parallel.allgather_attention"))


def _degree(variant: str, cp: int) -> int:
    """The ranks one all-to-all spans: cp for alltoall, K = min(2, cp) for the hybrid, 1 (none) otherwise."""
    return {"alltoall": cp, "alltoall+ring": min(2, cp)}.get(variant, 1)


def _shape(rng: random.Random, gqa: bool, degree: int = 1) -> dict:
    """Random sizes; S a multiple of 8 splits at every cp here (zigzag cp 4, S 8: chunks of one position).
    Not shorter than 8 nor hd below 8: there, a gradient's few rows carry the softmax backward's cancellation
    (dS = P∘(dP − D)) and fp32 scaled_dot_product_attention itself is up to 2e-6 (relative) off the fp64
    result, so two fp32 computations cannot agree within 1e-6."""
    kv = rng.choice((1, 2)) * degree
    return dict(B=rng.choice((1, 2)), h=kv * (rng.choice((2, 4)) if gqa else 1), kv=kv,
                S=rng.choice((8, 16, 24)), hd=rng.choice((8, 16)))


def check_attention() -> list[dict]:
    """Every case at cp 1, 2 and 4 on this rank: the errors of the output and of dq, dk, dv against the
    single-device reference (this rank's rows of it), the "cp" bytes and the score entries the bookkeeping
    counts for the call (forward and backward), each variant built once per case as a run builds it."""
    cp_split = import_module("06_context_parallel.cp_split")
    alltoall_attention = import_module("06_context_parallel.alltoall_attention")
    context_parallel = import_module("06_context_parallel.context_parallel")            # build_attention
    attention_bookkeeping = import_module("06_context_parallel.attention_bookkeeping")   # bytes formula, work
    from common import comm
    world, me = dist.get_world_size(), dist.get_rank()
    results = []
    for cp in (1, 2, 4):
        groups = [dist.new_group(list(range(s, s + cp))) for s in range(0, world, cp)]   # every rank creates all
        group = groups[me // cp]
        r = dist.get_rank(group)
        hybrid = alltoall_attention.HybridGroups(group, min(2, cp))   # every rank, the same order
        rng = random.Random(cp)                                   # the same shapes on every rank
        for variant, split_name, dtype, gqa in CASES:
            K = _degree(variant, cp)
            shape = _shape(rng, gqa, K)
            B, h, kv, S, hd = (shape[n] for n in ("B", "h", "kv", "S", "hd"))
            gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
            q, k, v = (torch.randn(B, n, S, hd, generator=gen, dtype=dtype, requires_grad=True)
                       for n in (h, kv, kv))
            grad = torch.randn(B, h, S, hd, generator=gen, dtype=dtype)      # the upstream gradient
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            ref.backward(grad)

            split = cp_split.SequenceSplit(S, cp, split_name, K if variant == "alltoall+ring" else 1)
            attention = context_parallel.build_attention(variant, hybrid if variant == "alltoall+ring" else group,
                                                         split)
            ql, kl, vl = (split.take(t.detach(), r, dim=2).requires_grad_() for t in (q, k, v))
            comm.COUNTER.reset()
            out = attention(ql, kl, vl)
            out.backward(split.take(grad, r, dim=2))
            errors = {name: ((mine - split.take(want, r, dim=2)).norm() / split.take(want, r, dim=2).norm()).item()
                      for name, mine, want in (("out", out.detach(), ref.detach()), ("dq", ql.grad, q.grad),
                                               ("dk", kl.grad, k.grad), ("dv", vl.grad, v.grad))}
            results.append(dict(cp=cp, variant=variant, split=split_name, dtype=dtype, gqa=gqa, shape=shape,
                                rank=r, errors=errors, bytes=comm.COUNTER.by_group().get("cp", 0),
                                formula=attention_bookkeeping.cp_bytes(variant, B, S, cp, kv, hd, q.element_size(),
                                                                       h=h, K=K),
                                work=2 * attention_bookkeeping.call_entries(variant, split, r, B, h),
                                work_expected=_work(split, variant, r, B, h)))
    return results


def _work(split, variant: str, r: int, B: int, h: int) -> int:
    """Score entries counted forward and backward: the chunk pairs of rank r (ring, all-gather); the causal
    S(S+1)/2 of h/cp heads over the whole sequence (all-to-all); the outer ring's pairs of h/K heads (hybrid)."""
    if variant == "alltoall":
        return 2 * B * (h // split.cp) * split.seq_len * (split.seq_len + 1) // 2
    if variant == "alltoall+ring":
        return 2 * B * (h // split.inner) * split.outer().work(r // split.inner)
    return 2 * B * h * split.work(r)


@pytest.fixture(scope="module")
def measured() -> list[list[dict]]:
    """measured[rank][i]: rank's i-th case."""
    (res,) = run_group(4, [("test_ring_attention:check_attention",)])
    return every_rank(res)


def _label(c: dict) -> str:
    return f"cp {c['cp']} {c['variant']} {c['split']} {str(c['dtype'])[6:]} {'GQA' if c['gqa'] else 'MHA'} " \
           f"{c['shape']} cp rank {c['rank']}"


def test_matches_single_device_attention(measured):
    """Forward and every input gradient, every case, every rank: fp32 within 1e-6, fp64 within 1e-12."""
    for case in itertools.chain(*measured):
        worst = max(case["errors"].values())
        assert worst <= RTOL[case["dtype"]], f"{_label(case)}: relative errors {case['errors']}"
    assert {(c["cp"], c["variant"], c["split"], c["gqa"]) for c in measured[0]} == \
        {(cp, *case[:2], case[3]) for cp in (1, 2, 4) for case in CASES}


def test_bytes_equal_the_formula(measured):
    for case in itertools.chain(*measured):
        assert case["bytes"] == case["formula"], _label(case)
    assert any(c["bytes"] > 0 for c in measured[0])


def test_work_counts_every_computed_pair(measured):
    """attention_bookkeeping.call_entries (what a run's WORK adds per call, twice with the backward) counts the
    forward's pairs and the backward's recomputation of the same pairs, all heads and rows; zigzag gives every rank the same work, contiguous gives the last rank cp times the first's;
    the all-to-all's is the same on every rank by construction, the hybrid's ring part as a ring of cp/K."""
    for case in itertools.chain(*measured):
        assert case["work"] == case["work_expected"], _label(case)
    for i, case in enumerate(measured[0]):
        if case["cp"] == 1:
            continue
        group = [measured[rank][i]["work"] for rank in range(4)][:case["cp"]]     # cp ranks 0..cp-1 of one group
        ratio = max(group) / min(group)
        want = {"alltoall": 1, "alltoall+ring": case["cp"] // _degree("alltoall+ring", case["cp"])}.get(case["variant"],
                                                                                                      case["cp"])
        assert ratio == (1 if case["split"] == "zigzag" else want), (_label(case), group)


# --- the online-softmax merge, in one process (exercise 06.merge: no ring, no split) ----------------------

@pytest.mark.parametrize("scale", [1.0, 100.0])
def test_merge_folds_blocks_into_one_softmax(scale):
    """Keys in three blocks, each block's (out_b, lse_b) as one ring step computes it, folded into "no key yet"
    (out 0, lse −∞): the result is attention over all keys at once, out and lse. At scale 100 the scores reach a
    few hundred, where e^score overflows float32 (above 88): only a merge that subtracts the max survives it.
    Rows 0-1 see no key of block 1 (lse_b −∞, out_b 0), as behind a causal mask."""
    _, ring_attention, _ = _chapter()
    gen = torch.Generator().manual_seed(0)
    B, h, L, hd, sizes = 2, 3, 5, 8, (4, 6, 3)
    q = torch.randn(B, h, L, hd, generator=gen)
    keys = [torch.randn(B, h, n, hd, generator=gen) for n in sizes]
    values = [torch.randn(B, h, n, hd, generator=gen) for n in sizes]
    s = [scale * q @ k.transpose(-1, -2) / hd ** 0.5 for k in keys]          # (B, h, L, n) per block
    s[1][:, :, :2] = float("-inf")
    out, lse = torch.zeros(B, h, L, hd), torch.full((B, h, L), float("-inf"))
    for s_b, v_b in zip(s, values):
        lse_b = torch.logsumexp(s_b, -1)                                      # (B, h, L), −∞ on a hidden row
        out_b = torch.nan_to_num(torch.softmax(s_b, -1)) @ v_b                # (B, h, L, hd), 0 on a hidden row
        out, lse = ring_attention.merge(out, lse, out_b, lse_b)
    every = torch.cat(s, -1)                                                  # (B, h, L, 13): all keys
    want = {"out": torch.softmax(every, -1) @ torch.cat(values, 2), "lse": torch.logsumexp(every, -1)}
    err = {name: ((got - want[name]).norm() / want[name].norm()).item() for name, got in (("out", out), ("lse", lse))}
    finite = bool(torch.isfinite(out).all() and torch.isfinite(lse).all())
    assert finite and max(err.values()) <= 1e-5, (
        f"scale {scale:g} (scores up to {every.max():.0f}): merged relative errors {err}"
        + ("" if finite else "; not finite: e^score overflows float32 unless the larger lse is subtracted first"))


def test_timeline_totals_per_rank():
    """train_cp.py --timeline's per-rank lines: wall seconds per kind, and the compute spans' CPU seconds."""
    cp_timeline = import_module("06_context_parallel.cp_timeline")
    events = [dict(rank=1, kind="compute", start=0.0, end=0.5, cpu_s=0.25), dict(rank=0, kind="wait", start=0.0, end=2.0, cpu_s=1.0),
              dict(rank=1, kind="compute", start=1.0, end=1.25, cpu_s=0.125), dict(rank=0, kind="F", start=0.0, end=9.0)]
    assert cp_timeline.seconds_per_rank(events) == {
        0: {"compute": 0.0, "wait": 2.0, "post": 0.0, "compute_cpu": 0.0},
        1: {"compute": 0.75, "wait": 0.0, "post": 0.0, "compute_cpu": 0.375}}


# --- the split, in one process ------------------------------------------------------------------------

def test_zigzag_chunks_and_positions():
    cp_split, _, _ = _chapter()
    split = cp_split.SequenceSplit(8, 2, "zigzag")
    assert split.chunks(0) == [(0, 2), (6, 8)] and split.chunks(1) == [(2, 4), (4, 6)]
    assert split.positions(0).tolist() == [0, 1, 6, 7]
    t = torch.arange(3 * 8).view(3, 8)
    assert split.take(t, 1).tolist() == [[8 * i + j for j in (2, 3, 4, 5)] for i in range(3)]
    contiguous = cp_split.SequenceSplit(8, 2, "contiguous")
    assert contiguous.chunks(1) == [(4, 8)] and contiguous.positions(1).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("split_name", ["zigzag", "contiguous"])
@pytest.mark.parametrize("S,cp", [(8, 1), (8, 2), (24, 4), (48, 8)])
def test_positions_form_a_permutation(split_name, S, cp):
    cp_split, _, _ = _chapter()
    split = cp_split.SequenceSplit(S, cp, split_name)
    every = torch.cat([split.positions(r) for r in range(cp)])
    assert sorted(every.tolist()) == list(range(S))
    for r in range(cp):
        assert len(split.positions(r)) == S // cp


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_work_zigzag_balanced_contiguous_not(cp):
    """Zigzag: 2cp+1 chunk pairs of c² on every rank; contiguous: rank r computes r+1 blocks. The sum over the
    ranks is the causal mask's S(S+1)/2 entries plus the masked half of each diagonal block computed anyway."""
    cp_split, _, _ = _chapter()
    S = 16 * cp
    zigzag = [cp_split.SequenceSplit(S, cp, "zigzag").work(r) for r in range(cp)]
    contiguous = [cp_split.SequenceSplit(S, cp, "contiguous").work(r) for r in range(cp)]
    c = S // (2 * cp)
    assert zigzag == [(2 * cp + 1) * c * c] * cp
    assert contiguous == [(r + 1) * (S // cp) ** 2 for r in range(cp)]
    assert max(contiguous) / min(contiguous) == cp


def test_pairs_skip_and_mask_by_position():
    """Zigzag cp 2, S 8: rank 0's queries (chunks 0 and 3) against rank 1's keys (chunks 1 and 2): chunk 0
    sees neither (skipped), chunk 3 sees both whole; against its own keys, two diagonal pairs are masked."""
    cp_split, _, _ = _chapter()
    split = cp_split.SequenceSplit(8, 2, "zigzag")
    other = split.pairs(0, 1)
    assert [(p.q_rows, p.k_rows, p.mask) for p in other] == [(slice(2, 4), slice(0, 2), None),
                                                             (slice(2, 4), slice(2, 4), None)]
    own = split.pairs(0, 0)
    assert [(p.q_rows, p.k_rows) for p in own] == [(slice(0, 2), slice(0, 2)), (slice(2, 4), slice(0, 2)),
                                                   (slice(2, 4), slice(2, 4))]
    assert own[1].mask is None and own[0].mask.tolist() == own[2].mask.tolist() == [[False, True], [False, False]]


@pytest.mark.parametrize("S,cp,split_name,expected", [
    (100, 4, "zigzag", "--seq-len 100 does not split into 2·cp = 8 equal chunks for --cp-split zigzag with --cp 4; "
                       "use a --seq-len that is a multiple of 8 (or --cp-split contiguous: a multiple of 4)"),
    (10, 4, "contiguous", "--seq-len 10 does not split into cp = 4 equal chunks for --cp-split contiguous with "
                          "--cp 4; use a --seq-len that is a multiple of 4"),
    (8, 2, "stripes", "--cp-split stripes is not one of zigzag, contiguous"),
])
def test_check_split_messages(S, cp, split_name, expected):
    cp_split, _, _ = _chapter()
    with pytest.raises(ConfigError) as err:
        cp_split.check_split(S, cp, split_name)
    assert str(err.value) == expected
    with pytest.raises(ConfigError):
        cp_split.SequenceSplit(S, cp, split_name)
    cp_split.check_split(8 * cp, cp, "zigzag")                    # a good one passes


def test_cp_bytes_formula():
    """The formula's own arithmetic at one point: B 2, S 64, cp 4, kv 2, hd 8, fp32: blk = 2·16·2·8·4 bytes."""
    attention_bookkeeping = import_module("06_context_parallel.attention_bookkeeping")
    blk = 2 * 16 * 2 * 8 * 4
    assert attention_bookkeeping.cp_bytes("ring", 2, 64, 4, 2, 8, 4) == 2 * 6 * 3 * blk
    assert attention_bookkeeping.cp_bytes("allgather", 2, 64, 4, 2, 8, 4) == 2 * 4 * 3 * blk
    assert attention_bookkeeping.cp_bytes("ring", 2, 64, 1, 2, 8, 4) == 0
