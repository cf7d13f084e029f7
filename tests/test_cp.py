"""Chapter 06: context parallelism reproduces the single device, end to end.

Every layout runs 06_context_parallel/train_cp.py (dense tiny) or train_5d.py (tiny-moe, balancing terms
10× the defaults) and is compared, step by step and on every rank, with the same script at world size 1
(which uses plain `scaled_dot_product_attention`): `loss` and `grad_norm` within the harness's round-off
tolerances (assert_same_run), `aux_loss` and `z_loss` within 1e-5, the same expert loads. On the way:

    comm_bytes_cp      exactly the bytes formula of attention_bookkeeping.cp_bytes, layer by layer
    attn_work_imbalance   1 with the zig-zag split, cp with the contiguous one
    peak_activation_bytes flat (within 5 %) as S and cp double together at the same rows per rank
    a CP × TP run        (a loss counted once per TP group, not halved or doubled), under --recompute full
    the all-to-all       (Ulysses) at cp 4 (GQA: 1 KV head per rank) and cp 2 × dp 2; the hybrid at cp 4 = 2 × 2,
                        at cp 2 × tp 2 under --recompute full, and inside the 5D run; attn_work_imbalance 1 for
                        the all-to-all whatever the split; the heads it cannot split refused in one line
    the ledger           peak_activation_bytes within 2 % of common/activation_ledger's prediction for S/cp
    a resume            cp 4's checkpoint of step 1 continued as cp 2 × dp 2 with the all-gather attention
                        and the contiguous split
    bad input           one message on every rank, before any communication

One spawned group per world size: 1 (the references) and 4 (train_cp's layouts, a 4D-plus-CP run, bad
input). All five dimensions at once (dp 2 = edp 1 × ep 2, pp 2, cp 2, tp 2, 16 ranks) run in
tests/test_compose.py's group of 16, with the Llama 3 miniature.
"""
import json
from importlib import import_module
from pathlib import Path

import pytest

from harness import assert_one_config_error, assert_same_run, every_rank, max_rel_diff, ok, run_group

CP = "06_context_parallel.train_cp:main"
FIVE = "06_context_parallel.train_5d:main"
STEPS = 3           # the resume starts from step 1: its steps 2 and 3 see the restored moments
BASE = ["--steps", str(STEPS), "--seq-len", "32", "--global-batch", "8", "--quiet"]
MOE = ["--model", "tiny-moe", "--aux-loss-coef", "0.1", "--z-loss-coef", "0.01", "--sample-tokens", "0",
       "--val-every", "2", "--val-batches", "1"]
# name -> flags; all at world size 4, against train_cp.py at world size 1
CP_RUNS = {"cp4 ring zigzag": ["--cp", "4"],
           "cp2 × dp2 ring contiguous, selective recompute": ["--cp", "2", "--cp-split", "contiguous",
                                                              "--recompute", "selective"],
           "cp2 × tp2 ring zigzag, full recompute": ["--cp", "2", "--tp", "2", "--recompute", "full"],
           # the all-to-all (Ulysses): cp 4 leaves 2 heads and 1 KV head per rank (GQA), cp 2 with dp 2
           "cp4 alltoall zigzag": ["--cp", "4", "--cp-attention", "alltoall"],
           "cp2 × dp2 alltoall contiguous, selective recompute": ["--cp", "2", "--cp-attention", "alltoall",
                                                                  "--cp-split", "contiguous", "--recompute", "selective"],
           # the hybrid: all-to-all over 2 ranks × ring over 2 groups; at cp 2 (× tp 2) K 2 leaves a ring of one
           "cp4 alltoall+ring 2 × 2": ["--cp", "4", "--cp-attention", "alltoall+ring", "--cp-alltoall", "2"],
           "cp2 × tp2 alltoall+ring K 2, full recompute": ["--cp", "2", "--tp", "2", "--cp-attention", "alltoall+ring",
                                                          "--cp-alltoall", "2", "--recompute", "full"]}
# inside the 5D run: the hybrid's all-to-all, sub-groups and ring (the pure all-to-all's code is its inner half)
FIVE_RUNS = {4: {"dp2·ep2 × cp2": ["--dp", "2", "--ep", "2", "--tp", "1", "--pp", "1", "--cp", "2"],
                 "5d cp4 alltoall+ring 2 × 2": ["--dp", "1", "--ep", "1", "--tp", "1", "--pp", "1", "--cp", "4",
                                             "--cp-attention", "alltoall+ring", "--cp-alltoall", "2"]}}
# S and cp double together at 8 rows per rank: the same tokens per rank, so the same activation bytes
FLAT = {"S 64, cp 2 × dp 2": ["--seq-len", "64", "--cp", "2", "--global-batch", "16"],
        "S 128, cp 4": ["--seq-len", "128", "--cp", "4"]}
BAD = {"zig-zag chunks": (CP, ["--seq-len", "36", "--cp", "4"], "--seq-len 36"),
       "cp not the world": (CP, ["--cp", "3"], "must equal the world size 4"),
       "longer than the model": (CP, ["--seq-len", "512"], "exceeds the tiny preset's max_seq_len 256"),
       "5d cp does not divide": (FIVE, ["--cp", "3"], "--cp 3 does not divide the world size 4"),
       "5d capacity": (FIVE, ["--cp", "2", "--capacity-factor", "1.0"], "leave --capacity-factor out"),
       "hybrid K does not divide cp": (CP, ["--cp", "4", "--cp-attention", "alltoall+ring", "--cp-alltoall", "3"],
                                       "--cp-alltoall 3 must divide --cp 4; use a divisor of 4"),
       "hybrid without K": (FIVE, ["--cp", "2", "--cp-attention", "alltoall+ring"],
                            "--cp-attention alltoall+ring needs --cp-alltoall K"),
       "K without the hybrid": (CP, ["--cp-alltoall", "2"], "--cp-alltoall 2 sets the all-to-all degree of "
                                                            "--cp-attention alltoall+ring only")}
# the all-to-all's degree must divide this rank's KV heads (tiny: 8 heads, 4 KV heads; / tp): checked in one process
HEADS = {"alltoall cp 8": ("alltoall", None, 8, 1, "splits this rank's 8 heads and 4 KV heads (--tp 1) over 8 ranks, "
                                                   "and 8 does not divide 4"),
         "alltoall cp 4 × tp 2": ("alltoall", None, 4, 2, "splits this rank's 4 heads and 2 KV heads (--tp 2) over 4 "
                                                          "ranks, and 4 does not divide 2"),
         "hybrid K 8 of cp 16": ("alltoall+ring", 8, 16, 1, "over 8 ranks, and 8 does not divide 4")}


@pytest.fixture(scope="module")
def reference():
    # one rank holds the whole sequence in order with either split; contiguous needs no exercise 06.zigzag
    one = ["--cp-split", "contiguous"]
    jobs = {"cp": (CP, BASE + one), "5d": (FIVE, BASE + MOE + one), "flat": (CP, ["--steps", "1", "--quiet"] + BASE[2:6] + one)}
    return dict(zip(jobs, (ok(r) for r in run_group(1, list(jobs.values()), timeout_s=600))))


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("cp_ckpt"))
    # The contiguous runs first: they need exercise 06.merge but not 06.zigzag, and a rank stops at its first
    # failing job, so a student's unwritten zig-zag does not stop the run that grades the merge.
    jobs = {name: (CP, BASE + CP_RUNS[name]) for name in sorted(CP_RUNS, key=lambda name: "zigzag" in name)}
    timeline = str(tmp_path_factory.mktemp("cp_timeline") / "contiguous.json")      # train_cp.py --timeline
    jobs["cp2 × dp2 ring contiguous, selective recompute"][1].extend(["--timeline", timeline])
    jobs["cp4 ring zigzag"] = (CP, BASE + CP_RUNS["cp4 ring zigzag"] + ["--checkpoint-dir", ckpt,
                                                                        "--checkpoint-every", "1", "--steps", "2"])   # step 1's checkpoint stays
    jobs["point"] = ("test_3d:point_latest_at", ckpt, "step_000001.pt")
    jobs["resumed cp2 × dp2 allgather"] = (CP, BASE + ["--cp", "2", "--cp-attention", "allgather", "--cp-split",
                                                       "contiguous", "--checkpoint-dir", ckpt, "--resume"])
    jobs.update({name: (FIVE, BASE + MOE + flags) for name, flags in FIVE_RUNS[4].items()})
    jobs.update({name: (CP, ["--steps", "1", "--quiet", "--global-batch", "8"] + flags) for name, flags in FLAT.items()})
    jobs.update({f"bad {k}": (main, ["--steps", "1", "--quiet"] + argv) for k, (main, argv, _) in BAD.items()})
    return {4: dict(zip(jobs, run_group(4, list(jobs.values()), timeout_s=900))), "timeline": timeline}


def cp_bytes_per_step(history_row, recompute: str = "none") -> int:
    """attention_bookkeeping.cp_bytes for one attention call, times the layers and micro-batches of a step
    (--recompute full reruns each forward, its hops included)."""
    attention_bookkeeping = import_module("06_context_parallel.attention_bookkeeping")
    from common.model import PRESETS
    cfg, r = PRESETS["tiny"], history_row
    rows = 8 // r["dp"]
    kv = cfg.kv_heads_per_rank(r["tp"])
    return cfg.n_layers * attention_bookkeeping.cp_bytes(r["cp_attention"], rows, 32, r["cp"], kv, cfg.head_dim, 4,
                                                         2 if recompute == "full" else 1, h=cfg.n_heads // r["tp"],
                                                         K=r.get("cp_alltoall") or 1)


@pytest.mark.parametrize("name", sorted(CP_RUNS))
def test_every_cp_layout_matches_one_device(groups, reference, name):
    ref = reference["cp"][:len(ok(groups[4][name]))]                           # the saving run: 2 steps
    history = assert_same_run(groups[4][name], ref, name)                      # loss and grad_norm, every rank
    for row in history:
        flags = CP_RUNS[name]
        recompute = flags[flags.index("--recompute") + 1] if "--recompute" in flags else "none"
        assert row["comm_bytes_cp"] == cp_bytes_per_step(row, recompute), (name, row["step"])
        ring_ranks = {"alltoall": 1, "alltoall+ring": row["cp"] // (row.get("cp_alltoall") or 1)}
        want = 1.0 if row["cp_split"] == "zigzag" else float(ring_ranks.get(row["cp_attention"], row["cp"]))
        assert row["attn_work_imbalance"] == pytest.approx(want), name
    for rank, rows in enumerate(every_rank(groups[4][name])):      # the ledger for S/cp positions (common/)
        for row in rows:
            assert abs(row["peak_activation_bytes"] / row["activation_bytes_predicted"] - 1) <= 0.02, (name, rank)


def test_timeline_records_every_ranks_ring_steps(groups):
    """--timeline: one Chrome trace, every rank's ring forward spans (compute with its CPU seconds, wait, post)."""
    ok(groups[4]["cp2 × dp2 ring contiguous, selective recompute"])   # the run that writes it: its own error first
    events = json.loads(Path(groups["timeline"]).read_text())["traceEvents"]
    compute = [e for e in events if e.get("cat") == "compute"]
    assert {e["tid"] for e in compute} == {0, 1, 2, 3} and all(e["args"]["cpu_s"] >= 0 for e in compute)
    assert {e["args"]["step"] for e in compute} == set(range(1, STEPS + 1))
    assert {e["cat"] for e in events if e["ph"] == "X"} >= {"compute", "wait", "post"}


def test_resume_from_cp4_into_cp2_with_the_other_attention(groups, reference):
    history = assert_same_run(groups[4]["resumed cp2 × dp2 allgather"], reference["cp"][1:], "resumed")   # steps 2, 3
    for row in history:        # (the all-gather keeps every rank's K/V: the ledger's gathered term)
        assert row["comm_bytes_cp"] == cp_bytes_per_step(row) and row["attn_work_imbalance"] == pytest.approx(2.0)
        assert abs(row["peak_activation_bytes"] / row["activation_bytes_predicted"] - 1) <= 0.02


@pytest.mark.parametrize("world", sorted(FIVE_RUNS))
def test_5d_layouts_match_chapter_05_on_one_device(groups, reference, world):
    ref = reference["5d"]
    for name in FIVE_RUNS[world]:
        history = assert_same_run(groups[world][name], ref, name)
        for rank, mine in enumerate(every_rank(groups[world][name])):
            for key in ("aux_loss", "z_loss"):
                assert max_rel_diff([r[key] for r in mine], [r[key] for r in ref]) <= 1e-5, (name, rank, key)
            assert [r["expert_load"] for r in mine] == [r["expert_load"] for r in ref], (name, rank)
            assert [r.get("val_loss") is None for r in mine] == [r.get("val_loss") is None for r in ref]
            vals = [(a["val_loss"], b["val_loss"]) for a, b in zip(mine, ref) if "val_loss" in b]
            assert vals and max_rel_diff(*map(list, zip(*vals))) <= 1e-6, (name, rank)
        assert history[-1]["comm_bytes_cp"] > 0 and history[-1]["attn_work_imbalance"] == pytest.approx(1.0), name


def test_activation_bytes_stay_flat_as_seq_len_and_cp_double_together(groups, reference):
    one = reference["flat"][0]["peak_activation_bytes"]                     # S 32 on one rank
    for name in FLAT:
        for rank, history in enumerate(every_rank(groups[4][name])):
            assert abs(history[0]["peak_activation_bytes"] / one - 1) <= 0.05, (name, rank, one)


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_cp_input_fails_on_every_rank_with_one_message(groups, kind):
    assert_one_config_error(groups[4][f"bad {kind}"], BAD[kind][2])


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_alltoall_refuses_heads_it_cannot_split(kind):
    """One line, before any communication (check_cp runs in decide_degrees / decide_layout on every rank)."""
    import argparse
    from common.errors import ConfigError
    from common.model import PRESETS
    context_parallel = import_module("06_context_parallel.context_parallel")
    variant, K, cp, tp, message = HEADS[kind]
    args = argparse.Namespace(cp_attention=variant, cp_alltoall=K)
    with pytest.raises(ConfigError, match="") as err:
        context_parallel.check_alltoall(args, cp, PRESETS["tiny"], tp)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    context_parallel.check_alltoall(argparse.Namespace(cp_attention=variant, cp_alltoall=K and 2), 2, PRESETS["tiny"], tp)
