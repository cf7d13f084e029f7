"""Chapter 05's 4D run: DP × TP × PP × EP with a mixture of experts reproduces the single device.

Every layout runs 05_moe_expert_parallel/train_4d.py (tiny-moe) and is compared, step by step, with
`python 05_moe_expert_parallel/train_moe.py` (world size 1) given the same flags, on every rank: `loss`
and `grad_norm` within the harness's round-off tolerances (assert_same_run), `aux_loss` and `z_loss`
within 1e-5 relative, the same expert loads. One spawned group per world size (1, 4, 8):

    8 ranks  dp 2 = edp 1 × ep 2, tp 2, pp 2, saving checkpoints; dp 4 = edp 1 × ep 4, pp 2; the first's
             checkpoint of step 1 resumed as the second (dropless, balancing terms 10× the defaults)
    4 ranks  dp 2 = edp 1 × ep 2, pp 2 under ZB-H1 and under DualPipeV, its pairs one after the other
             and two at once (--pair-overlap; also at 8 ranks with tp 2); dp 4 = edp 2 × ep 2 (two ranks hold each expert: the
             edp all-reduce); dp 2 = edp 1 × ep 2, tp 2 (the selection biases must stay equal over each
             TP group); all with bias balancing and a capacity factor; bad 4D layouts refused on every rank
(Layout names below: "dp2·ep2" is dp 2 with ep 2 inside it, so edp = dp/ep.)
"""
from importlib import import_module

import pytest

from harness import assert_one_config_error, assert_same_run, every_rank, max_rel_diff, ok, run_group

REFERENCE = "05_moe_expert_parallel.train_moe:main"
MAIN = "05_moe_expert_parallel.train_4d:main"
STEPS = 3          # the resume starts from step 1: its steps 2 and 3 see the restored moments
BASE = ["--steps", str(STEPS), "--seq-len", "32", "--global-batch", "8", "--quiet"]
# Balancing terms 10× the defaults, so that a stage missing their gradient would show in grad_norm
# and the bias method with a capacity factor (both 4-rank layouts: one reference run fewer)
MODES = {"strong aux": ["--aux-loss-coef", "0.1", "--z-loss-coef", "0.01"],
         "bias + capacity": ["--router-bias-rate", "0.01", "--capacity-factor", "1.0"]}
# world -> name -> (mode, (dp, ep, tp, pp), extra flags)
RUNS = {8: {"dp2·ep2 × tp2 × pp2": ("strong aux", (2, 2, 2, 2), []),
            # pairs with TP: the backward's all-reduces too on twin groups
            "dp2·ep2 × tp2 × pp2 dualpipev paired": ("strong aux", (2, 2, 2, 2), ["--schedule", "dualpipev",
                                                                                  "--microbatches", "4", "--pair-overlap"]),
            "dp4·ep4 × pp2": ("strong aux", (4, 4, 1, 2), [])},
        4: {"dp2·ep2 × pp2 zb-h1": ("bias + capacity", (2, 2, 1, 2), ["--schedule", "zb-h1", "--microbatches", "2"]),
            # DualPipeV (two stages per rank, in a V) with the experts' all-to-all inside each stage
            "dp2·ep2 × pp2 dualpipev": ("bias + capacity", (2, 2, 1, 2), ["--schedule", "dualpipev", "--microbatches", "4"]),
            # and its pairs run two at once: a forward on a second thread beside a backward (paired_executor.py)
            "dp2·ep2 × pp2 dualpipev paired": ("bias + capacity", (2, 2, 1, 2), ["--schedule", "dualpipev",
                                                                                 "--microbatches", "4", "--pair-overlap"]),
            "dp4·ep2": ("bias + capacity", (4, 2, 1, 1), []),
            # TP with bias balancing: every TP rank must update its copy of the selection bias alike
            "dp2·ep2 × tp2": ("bias + capacity", (2, 2, 2, 1), [])}}
TP_BIAS_RUN = "dp2·ep2 × tp2"
CAPTURED = {}      # on each rank of a spawned group: the model of the last run_capturing_model
BAD = {"ep does not divide dp": (["--model", "tiny-moe", "--dp", "2", "--tp", "2", "--pp", "1", "--ep", "4"],
                                 "--ep 4 does not divide --dp 2"),
       "experts do not split": (["--model", "tiny-moe", "--dp", "4", "--tp", "1", "--pp", "1", "--ep", "3"],
                                "the model's 8 experts do not split over --ep 3"),
       "dense preset": (["--model", "tiny", "--ep", "2"], "--ep needs a mixture-of-experts model, but --model tiny is dense"),
       "pairs without dualpipev": (["--model", "tiny-moe", "--dp", "2", "--ep", "2", "--pp", "2", "--pair-overlap"],
                                   "--pair-overlap runs DualPipeV's pairs, but --schedule 1f1b has none")}


def layout(dp, ep, tp, pp, *extra) -> list[str]:
    return BASE + ["--model", "tiny-moe", "--sample-tokens", "0", "--val-every", "0", "--val-batches", "1", "--dp", str(dp), "--ep", str(ep),
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
            # saving: every step, 2 steps (the newest two checkpoints are kept: step 1's stays to resume from)
            saving = ["--checkpoint-dir", ckpt, "--checkpoint-every", "1", "--steps", "2"] if name == "dp2·ep2 × tp2 × pp2" else []
            jobs[name] = (MAIN, layout(*degrees, *MODES[mode], *extra, *saving))
            if name == TP_BIAS_RUN:
                jobs[name] = ("test_4d:run_capturing_model", jobs[name][1])
                jobs["biases"] = ("test_4d:selection_biases",)
        if world == 8:       # the EP-2 run saved at every step: resume from step 1 at EP 4
            jobs["point"] = ("test_3d:point_latest_at", ckpt, "step_000001.pt")
            jobs["resumed dp4·ep4 × pp2"] = (MAIN, layout(4, 4, 1, 2, *MODES["strong aux"], "--checkpoint-dir", ckpt,
                                                          "--resume"))
        if world == 4:
            jobs.update({f"bad {k}": (MAIN, ["--steps", "1", "--quiet"] + argv) for k, (argv, _) in BAD.items()})
        out[world] = dict(zip(jobs, run_group(world, list(jobs.values()), timeout_s=1200)))
    return out


@pytest.mark.parametrize("world", sorted(RUNS))
def test_every_4d_layout_matches_chapter_05_on_one_device(groups, reference, world):
    for name, (mode, (dp, ep, tp, pp), _) in RUNS[world].items():
        ref = reference[mode][:len(ok(groups[world][name]))]              # the saving run: 2 steps
        history = assert_same_run(groups[world][name], ref, name)          # loss and grad_norm, every rank
        for rank, mine in enumerate(every_rank(groups[world][name])):
            for key in ("aux_loss", "z_loss"):
                assert max_rel_diff([r[key] for r in mine], [r[key] for r in ref]) <= 1e-5, (name, rank, key)
            assert [r["expert_load"] for r in mine] == [r["expert_load"] for r in ref], (name, rank)
        assert history[-1]["comm_bytes_ep"] > 0 and (history[-1]["comm_bytes_pp"] > 0) == (pp > 1), name
        if "capacity" in mode:
            assert all(r["dropped_fraction"] > 0 for r in history), name


def test_dualpipev_pairs_run_two_at_once_and_hide_all_to_all_waits(groups):
    """--pair-overlap: every rank ran pairs (none without it), and the all-to-all time no thread computed
    under is at most the time spent in all-to-alls; one action at a time, the two are the same."""
    for world, name in ((4, "dp2·ep2 × pp2 dualpipev paired"), (8, "dp2·ep2 × tp2 × pp2 dualpipev paired"),
                        (4, "dp2·ep2 × pp2 dualpipev")):
        paired = name.endswith("paired")
        for rank, rows in enumerate(every_rank(groups[world][name])):
            for r in rows:
                assert (r["pairs_run"] > 0) == paired, (name, rank, r["pairs_run"])
                assert 0 < r["a2a_exposed_s"] <= r["a2a_wait_s"] + 1e-9, (name, rank, r)
                assert r["bubble_fraction"] >= 0, (name, rank, r["bubble_fraction"])   # two threads: busy once
                if not paired:
                    assert abs(r["a2a_exposed_s"] - r["a2a_wait_s"]) < 1e-9, (name, rank, r)


def test_exposed_all_to_all_counts_waits_no_thread_computes_under():
    """Spans by hand: a forward thread waits 2–4 in an all-to-all while the main thread computes 1–3:
    1 s of the 2 s wait is exposed; validation's all-to-all outside every action is not counted."""
    exposed = import_module("05_moe_expert_parallel.paired_executor").exposed_all_to_all
    events = [{"kind": "F", "start": 0.0, "end": 5.0, "thread": "forward_0"},
              {"kind": "a2a", "start": 2.0, "end": 4.0, "thread": "forward_0"},
              {"kind": "B", "start": 1.0, "end": 3.0},
              {"kind": "a2a", "start": 6.0, "end": 7.0}]                         # after the step's actions
    assert exposed(events) == {"a2a_wait_s": 2.0, "a2a_exposed_s": 1.0}
    alone = [e for e in events if e.get("thread") != "forward_0"] + [{"kind": "a2a", "start": 1.5, "end": 2.5}]
    assert exposed(alone) == {"a2a_wait_s": 1.0, "a2a_exposed_s": 1.0}


def run_capturing_model(argv):
    """train_4d.main(argv), keeping this rank's model (through the EP step it applies) for the next job."""
    parallel_4d = import_module("05_moe_expert_parallel.parallel_4d")
    step = parallel_4d.experts_over_ep

    def capturing(model, mesh):
        step(model, mesh)
        CAPTURED["model"], CAPTURED["tp_group"] = model, mesh.group_ranks["tp"]
    parallel_4d.experts_over_ep = capturing
    try:
        return import_module("05_moe_expert_parallel.train_4d").main(argv)
    finally:
        parallel_4d.experts_over_ep = step


def selection_biases():
    """This rank's TP group and the selection biases of its MoE layers after the captured run."""
    model = CAPTURED["model"]
    return CAPTURED["tp_group"], {n: b.tolist() for n, b in model.named_buffers() if n.endswith("selection_bias")}


def test_selection_biases_equal_across_each_tp_group(groups):
    """Bias balancing moves every bias (γ > 0), and the TP ranks of a stage keep identical copies: they
    route the same tokens, so a bias updated on one TP rank only would route them differently."""
    per_rank = every_rank(groups[4]["biases"])
    for rank, (tp_group, biases) in enumerate(per_rank):
        assert biases and any(v != 0 for b in biases.values() for v in b), f"rank {rank}: no bias moved"
        for other in tp_group:
            differ = sorted(name for name in biases if per_rank[other][1].get(name) != biases[name])
            assert not differ, f"TP ranks {rank} and {other} hold different selection biases: {', '.join(differ)}"


def test_resume_from_ep2_into_ep4(groups, reference):
    ref = reference["strong aux"][1:]
    resumed = assert_same_run(groups[8]["resumed dp4·ep4 × pp2"], ref, "resumed dp4·ep4 × pp2")   # steps 2, 3
    assert max_rel_diff([r["aux_loss"] for r in resumed], [r["aux_loss"] for r in ref]) <= 1e-5


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_4d_layouts_fail_on_every_rank_with_one_message(groups, kind):
    assert_one_config_error(groups[4][f"bad {kind}"], BAD[kind][1])


@pytest.mark.parametrize("argv, world, expected", [
    (["--model", "tiny-moe", "--tp", "2", "--pp", "1", "--sequence-parallel", "--capacity-factor", "1.0"], 4,
     "--sequence-parallel splits the positions over the TP ranks"),
    (["--model", "tiny-moe", "--dp", "2", "--tp", "2", "--pp", "2", "--ep", "8"], 8, "--ep 8 does not divide --dp 2"),
])
def test_what_experts_cannot_share_is_refused_before_any_communication(argv, world, expected):
    from common.errors import ConfigError
    train_4d, parallel_4d = import_module("05_moe_expert_parallel.train_4d"), import_module("05_moe_expert_parallel.parallel_4d")
    with pytest.raises(ConfigError, match=expected):
        parallel_4d.decide_layout(train_4d.parse_args(argv + ["--quiet"]), world)


def test_pairs_on_two_threads_refuse_a_gpu():
    """--pair-overlap runs a pair's halves on two CPU threads; on a GPU that would take a second stream, so
    it is refused before any communication, in one line that says what to add (and a CPU run is not)."""
    from common.errors import ConfigError
    train_4d = import_module("05_moe_expert_parallel.train_4d")
    argv = ["--model", "tiny-moe", "--dp", "2", "--ep", "2", "--pp", "2", "--schedule", "dualpipev",
            "--microbatches", "4", "--pair-overlap", "--quiet"]
    with pytest.raises(ConfigError, match="--pair-overlap runs a pair on two CPU threads .*add --device cpu"):
        train_4d.checked_layout(train_4d.parse_args(argv + ["--device", "cuda"]), 4)
    train_4d.checked_layout(train_4d.parse_args(argv + ["--device", "cpu"]), 4)


def test_default_layout_shows_ep_inside_dp():
    """8 ranks, tiny-moe: dp 4 = edp 2 × ep 2, pp 2, tp 1 by default: EP inside DP, two ranks per expert."""
    train_4d, parallel_4d = import_module("05_moe_expert_parallel.train_4d"), import_module("05_moe_expert_parallel.parallel_4d")
    layout, _ = parallel_4d.decide_layout(train_4d.parse_args(["--quiet"]), 8)
    assert (layout.dp, layout.ep, layout.tp, layout.pp) == (4, 2, 1, 2)
    assert layout.grid() == {"edp": 2, "ep": 2, "pp": 2, "tp": 1}


def test_the_3d_run_refuses_a_mixture_of_experts(monkeypatch):
    """Chapter 04 trains dense models; its refusal (before any communication) names chapter 05's 4D run."""
    from common.errors import ConfigError
    monkeypatch.setenv("WORLD_SIZE", "1")
    train_3d = import_module("04_3d_combined.train_3d")
    with pytest.raises(ConfigError, match="05_moe_expert_parallel/train_4d.py"):
        train_3d.main(["--model", "tiny-moe", "--quiet"])

