"""Chapter 04 in 4D: DP × TP × PP × EP with a mixture of experts reproduces chapter 05's single device.

Every layout runs 04_3d_combined/train_3d.py --model tiny-moe and is compared, step by step, with
`python 05_moe_expert_parallel/train_moe.py` (world size 1) given the same flags, on every rank: `loss`
and `grad_norm` within the harness's round-off tolerances (assert_same_run), `aux_loss` and `z_loss`
within 1e-5 relative, the same expert loads. One spawned group per world size (1, 4, 8):

    8 ranks  dp2·ep2 × tp2 × pp2, saving checkpoints; dp4·ep4 × pp2; the dp2·ep2 checkpoint of step 5
             resumed as dp4·ep4 (dropless, balancing terms 10× the defaults)
    4 ranks  dp2·ep2 × pp2 under ZB-H1, and dp4·ep2 (two ranks hold each expert: the EDP all-reduce),
             both with bias balancing and a capacity factor; bad 4D layouts refused on every rank
"""
from importlib import import_module

import pytest

from harness import assert_one_config_error, assert_same_run, every_rank, max_rel_diff, ok, run_group

REFERENCE = "05_moe_expert_parallel.train_moe:main"
MAIN = "04_3d_combined.train_3d:main"
STEPS = 10
BASE = ["--steps", str(STEPS), "--seq-len", "32", "--global-batch", "8", "--quiet"]
# Balancing terms 10× the defaults, so that a stage missing their gradient would show in grad_norm
# and the bias method with a capacity factor (both 4-rank layouts: one reference run fewer)
MODES = {"strong aux": ["--aux-loss-coef", "0.1", "--z-loss-coef", "0.01"],
         "bias + capacity": ["--router-bias-rate", "0.01", "--capacity-factor", "1.0"]}
# world -> name -> (mode, (dp, ep, tp, pp), extra flags)
RUNS = {8: {"dp2·ep2 × tp2 × pp2": ("strong aux", (2, 2, 2, 2), []),
            "dp4·ep4 × pp2": ("strong aux", (4, 4, 1, 2), [])},
        4: {"dp2·ep2 × pp2 zb-h1": ("bias + capacity", (2, 2, 1, 2), ["--schedule", "zb-h1", "--microbatches", "2"]),
            "dp4·ep2": ("bias + capacity", (4, 2, 1, 1), [])}}
BAD = {"ep does not divide dp": (["--model", "tiny-moe", "--dp", "2", "--tp", "2", "--pp", "1", "--ep", "4"],
                                 "--ep 4 does not divide --dp 2"),
       "experts do not split": (["--model", "tiny-moe", "--dp", "4", "--tp", "1", "--pp", "1", "--ep", "3"],
                                "the model's 8 experts do not split over --ep 3"),
       "dense preset": (["--model", "tiny", "--ep", "2"], "--ep needs a mixture-of-experts model, but --model tiny is dense")}


def layout(dp, ep, tp, pp, *extra) -> list[str]:
    return BASE + ["--model", "tiny-moe", "--sample-tokens", "0", "--val-every", "0", "--dp", str(dp), "--ep", str(ep),
                   "--tp", str(tp), "--pp", str(pp)] + list(extra)


@pytest.fixture(scope="module")
def reference():
    jobs = [(REFERENCE, BASE + flags) for flags in MODES.values()]
    return {mode: ok(res) for mode, res in zip(MODES, run_group(1, jobs, timeout_s=1200))}


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("moe_3d_ckpt"))
    out = {}
    for world, runs in RUNS.items():
        jobs = {}
        for name, (mode, degrees, extra) in runs.items():
            saving = ["--checkpoint-dir", ckpt, "--checkpoint-every", "5"] if name == "dp2·ep2 × tp2 × pp2" else []
            jobs[name] = (MAIN, layout(*degrees, *MODES[mode], *extra, *saving))
        if world == 8:       # the EP-2 run saved at steps 5 and 10: resume from 5 at EP 4
            jobs["point"] = ("test_3d:point_latest_at", ckpt, "step_000005.pt")
            jobs["resumed dp4·ep4 × pp2"] = (MAIN, layout(4, 4, 1, 2, *MODES["strong aux"], "--checkpoint-dir", ckpt,
                                                          "--resume"))
        if world == 4:
            jobs.update({f"bad {k}": (MAIN, ["--steps", "1", "--quiet"] + argv) for k, (argv, _) in BAD.items()})
        out[world] = dict(zip(jobs, run_group(world, list(jobs.values()), timeout_s=1200)))
    return out


@pytest.mark.parametrize("world", sorted(RUNS))
def test_every_4d_layout_matches_chapter_05_on_one_device(groups, reference, world):
    for name, (mode, (dp, ep, tp, pp), _) in RUNS[world].items():
        ref = reference[mode]
        history = assert_same_run(groups[world][name], ref, name)          # loss and grad_norm, every rank
        for rank, mine in enumerate(every_rank(groups[world][name])):
            for key in ("aux_loss", "z_loss"):
                assert max_rel_diff([r[key] for r in mine], [r[key] for r in ref]) <= 1e-5, (name, rank, key)
            assert [r["expert_load"] for r in mine] == [r["expert_load"] for r in ref], (name, rank)
        assert history[-1]["comm_bytes_ep"] > 0 and (history[-1]["comm_bytes_pp"] > 0) == (pp > 1), name
        if "capacity" in mode:
            assert all(r["dropped_fraction"] > 0 for r in history), name


def test_resume_from_ep2_into_ep4(groups, reference):
    ref = reference["strong aux"][5:]
    resumed = assert_same_run(groups[8]["resumed dp4·ep4 × pp2"], ref, "resumed dp4·ep4 × pp2")   # steps 6..10
    assert max_rel_diff([r["aux_loss"] for r in resumed], [r["aux_loss"] for r in ref]) <= 1e-5


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_4d_layouts_fail_on_every_rank_with_one_message(groups, kind):
    assert_one_config_error(groups[4][f"bad {kind}"], BAD[kind][1])


@pytest.mark.parametrize("argv, world, expected", [
    (["--model", "tiny-moe", "--tp", "2", "--pp", "1", "--sequence-parallel"], 4, "leave --sequence-parallel out"),
    (["--model", "tiny-moe", "--tp", "1", "--pp", "1", "--zero-stage", "1"], 4, "leave --zero-stage out"),
    (["--model", "tiny-moe", "--dp", "2", "--tp", "2", "--pp", "2", "--ep", "8"], 8, "--ep 8 does not divide --dp 2"),
])
def test_what_experts_cannot_share_is_refused_before_any_communication(monkeypatch, argv, world, expected):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    from common.errors import ConfigError
    train_3d = import_module("04_3d_combined.train_3d")
    with pytest.raises(ConfigError, match=expected):
        train_3d.parse_args(argv + ["--quiet"])


def test_default_ep_is_drawn_from_dp(monkeypatch):
    """8 ranks, tiny-moe: dp 2 × tp 2 × pp 2 by default, and EP 2 inside the DP dimension."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    train_3d = import_module("04_3d_combined.train_3d")
    args = train_3d.parse_args(["--model", "tiny-moe", "--quiet"])
    assert (args.dp, args.ep, args.tp, args.pp) == (2, 2, 2, 2)
    assert train_3d.parse_args(["--quiet"]).ep == 1

