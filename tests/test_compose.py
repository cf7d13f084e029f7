"""Every dimension composes with every other, and the published layouts run in miniature: one device's run.

ZeRO on the grid (04_3d_combined/zero_3d.py) shards each kind of state over the group that sums its
gradients: the dense state over dp (dp × cp with CP), the experts' over edp (edp × cp). Sequence
parallelism composes with CP (S/cp/tp positions in the residual stream; chapter 02's f gathers S/cp back
before each attention) and with experts (each TP rank routes its own positions: the routers' per-sequence
counts summed over tp, or cp × tp, the experts' and routers' gradients over tp like the norm gains').

Every layout is compared, step by step and on every rank, with one device (assert_same_run: loss 1e-6,
gradient norm 1e-5 relative; 2 steps, a resumed run's step 3 after the checkpoint of step 2),
validation included (step 2, and step 3 where there is one: ZeRO-3 gathers its weights for it),
the mixtures also on `aux_loss` and `z_loss` (1e-5) and the expert loads (equal); every rank's memory by
component equals chapter 01's formulas for its piece and groups (up to the flat buffers' padding); the
miniatures' bytes per group equal the layout planner's formulas (07_choosing_a_layout/layout_costs.py),
the routed all-to-all's excepted (it depends on the routing). One spawned group per world size:

    16 ranks Llama 3 in miniature (chapter 06's README), saving at step 2, its checkpoint then resumed
             on one device; its bytes per group exactly the planner's, its activations exactly the
             ledger's. All five dimensions at once on the mixture: dp 2 = edp 1 × ep 2, pp 2, cp 2, tp 2
    8 ranks  GPT-3 on Megatron in miniature (chapter 04's README); DeepSeek-V3 in miniature (chapter 05's),
             saving at step 2, resumed as dp 2 = edp 1 × ep 2 × tp 2 × pp 2 with ZeRO-3 under GPipe (FSDP ×
             TP × PP × EP); ZeRO-2 × TP × PP under ZB-H1 (the deferred weight gradients); ZeRO-3 × TP × CP
             on a dense model; ZeRO-2 × EP × CP × PP, interleaved (with the Llama miniature's 1F1B: every
             schedule under ZeRO); SP × experts (its tp bytes equal chapter 02's formulas), SP × CP ×
             experts (SP × CP × PP: the Llama miniature); the refusals that remain, one message on every rank
"""
import os
import subprocess
import sys
from importlib import import_module

import pytest

from harness import (REFUSAL_TIMEOUT_S, ROOT, assert_one_config_error, assert_same_run, every_rank,
                     max_rel_diff, ok, run_group)

THREE, FOUR, FIVE = "04_3d_combined.train_3d:main", "05_moe_expert_parallel.train_4d:main", \
    "06_context_parallel.train_5d:main"
BASE = ["--steps", "3", "--seq-len", "32", "--global-batch", "8", "--quiet", "--sample-tokens", "0",
        "--val-every", "2", "--val-batches", "1"]
MOE = ["--model", "tiny-moe", "--aux-loss-coef", "0.1", "--z-loss-coef", "0.01"]   # balancing 10× the defaults
SP = ["--sequence-parallel"]

# The miniatures' flags, as their chapters' READMEs give them (test_readme_commands checks that they do)
LLAMA3 = ["--model", "tiny", "--dp", "2", "--tp", "2", "--pp", "2", "--cp", "2", "--zero-stage", "2",
          "--sequence-parallel"]
GPT3 = ["--dp", "2", "--tp", "2", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
        "--sequence-parallel", "--recompute", "selective"]
DEEPSEEK = ["--model", "tiny-moe", "--dp", "4", "--ep", "4", "--pp", "2", "--tp", "1", "--zero-stage", "1",
            "--schedule", "zb-h1", "--microbatches", "2"]
MINIATURES = {"Llama 3": ("06_context_parallel", "torchrun --nproc_per_node=16 06_context_parallel/train_5d.py", LLAMA3),
              "GPT-3": ("04_3d_combined", "torchrun --nproc_per_node=8 04_3d_combined/train_3d.py", GPT3),
              "DeepSeek-V3": ("05_moe_expert_parallel", "torchrun --nproc_per_node=8 05_moe_expert_parallel/train_4d.py",
                              DEEPSEEK)}
# world -> name -> (script, flags, reference); a job saving or resuming a checkpoint gets its flags in `groups`
RUNS = {16: {"Llama 3 miniature": (FIVE, LLAMA3, "dense"),
             "5d dp2·ep2 × pp2 × cp2 × tp2": (FIVE, MOE + ["--dp", "2", "--ep", "2", "--tp", "2", "--pp", "2",
                                                          "--cp", "2"], "moe")},
        8: {"GPT-3 miniature": (THREE, GPT3, "dense"),
            "DeepSeek-V3 miniature": (FOUR, DEEPSEEK + MOE[2:], "moe"),
            "ZeRO-2 × tp 2 × pp 2, zb-h1": (THREE, ["--dp", "2", "--tp", "2", "--pp", "2", "--zero-stage", "2",
                                                   "--schedule", "zb-h1", "--microbatches", "2"], "dense"),
            "ZeRO-3 × tp 2 × cp 2, dense": (FIVE, ["--model", "tiny", "--dp", "2", "--tp", "2", "--pp", "1", "--cp",
                                                  "2", "--zero-stage", "3"], "dense"),
            "ZeRO-2 × ep 2 × cp 2 × pp 2, interleaved": (FIVE, MOE + ["--dp", "2", "--ep", "2", "--tp", "1", "--pp",
                                                                     "2", "--cp", "2", "--zero-stage", "2", "--schedule",
                                                                     "interleaved", "--virtual-stages", "2"], "moe"),
            "4d dp4·ep2 × tp2 +SP": (FOUR, MOE + SP + ["--dp", "4", "--ep", "2", "--tp", "2", "--pp", "1",
                                                      "--microbatches", "2"], "moe"),
            "5d dp2·ep2 × tp2 +SP × cp2": (FIVE, MOE + SP + ["--dp", "2", "--ep", "2", "--tp", "2", "--pp", "1",
                                                            "--cp", "2"], "moe"),
            "DeepSeek-V3 resumed as ZeRO-3 × tp2 × pp2 × ep2, gpipe": (FOUR, MOE + ["--dp", "2", "--ep", "2", "--tp",
                                                                                  "2", "--pp", "2", "--zero-stage", "3",
                                                                                  "--schedule", "gpipe", "--resume"],
                                                                      "moe")}}
RESUMES_AT = {"DeepSeek-V3 resumed as ZeRO-3 × tp2 × pp2 × ep2, gpipe": 2}
# the refusals that remain: (script, flags at world size 8, what the message must say)
BAD = {"capacity with SP": (FOUR, ["--model", "tiny-moe", "--dp", "4", "--tp", "2", "--pp", "1", "--capacity-factor",
                                   "1.0"] + SP, "leave --capacity-factor out (dropless, as DeepSeek-V3 trains) with "
                                                "--sequence-parallel"),
       "S/cp does not split over tp": (FIVE, ["--model", "tiny", "--dp", "2", "--tp", "2", "--pp", "1", "--cp", "2",
                                              "--cp-split", "contiguous", "--seq-len", "34"] + SP,
                                       "use a --seq-len that is a multiple of 4")}
SHORT = ["--steps", "2"]    # a layout that does not resume: step 2 already uses step 1's update
PADDING = 256       # bytes: the flat buffers round each unit up to a multiple of N elements


@pytest.fixture(scope="module")
def reference():
    dense, moe = run_group(1, [(THREE, BASE), (FOUR, BASE + MOE)], timeout_s=600)
    return {"dense": ok(dense), "moe": ok(moe)}


class Groups(dict):
    """results[world][name], each world's group spawned when a test first asks for it (so each test's time
    limit covers one group); the Llama miniature's checkpoint resumed on one device is world 1 ("resumed on
    one"), after world 16 has saved it."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.llama, self.deepseek = (str(tmp_path_factory.mktemp(n)) for n in ("llama_ckpt", "deepseek_ckpt"))

    def __missing__(self, world: int) -> dict:
        if world == 1:
            self[16]                                                            # the checkpoint to resume
            _, (resumed,) = run_group(1, [("test_3d:point_latest_at", self.llama, "step_000002.pt"),
                                          (THREE, BASE + ["--checkpoint-dir", self.llama, "--resume"])])
            self[1] = {"resumed on one": [resumed]}
            return self[1]
        saving = {"Llama 3 miniature": self.llama, "DeepSeek-V3 miniature": self.deepseek}
        jobs = {}
        for name, (script, flags, _) in RUNS[world].items():
            if name in RESUMES_AT:
                jobs["point"] = ("test_3d:point_latest_at", self.deepseek, "step_000002.pt")
            ckpt = ["--checkpoint-dir", saving[name], "--checkpoint-every", "2"] if name in saving else \
                ["--checkpoint-dir", self.deepseek] if name in RESUMES_AT else []
            steps = [] if name in RESUMES_AT else SHORT     # the rest, the saving runs too: 2 steps are enough
            jobs[name] = (script, BASE + flags + ckpt + steps)
        if world == 8:
            jobs.update({f"bad {k}": (script, ["--steps", "1", "--quiet"] + argv) for k, (script, argv, _) in BAD.items()})
        self[world] = dict(zip(jobs, run_group(world, list(jobs.values()), timeout_s=900)))
        return self[world]


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return Groups(tmp_path_factory)


@pytest.mark.parametrize("world, name", [(w, n) for w, runs in RUNS.items() for n in runs])
def test_every_layout_is_one_device(groups, reference, world, name):
    ref = reference[RUNS[world][name][2]][RESUMES_AT.get(name, 0):]
    ref = ref[:len(ok(groups[world][name]))]                                 # 2 or 3 steps (SHORT)
    assert_same_run(groups[world][name], ref, name)                            # loss and grad_norm, every rank
    for rank, mine in enumerate(every_rank(groups[world][name])):
        vals = [(a["val_loss"], b["val_loss"]) for a, b in zip(mine, ref) if "val_loss" in b]
        assert vals and max_rel_diff(*map(list, zip(*vals))) <= 1e-6, (name, rank)
        if "aux_loss" in ref[0]:
            for key in ("aux_loss", "z_loss"):
                assert max_rel_diff([r[key] for r in mine], [r[key] for r in ref]) <= 1e-5, (name, rank, key)
            assert [r["expert_load"] for r in mine] == [r["expert_load"] for r in ref], (name, rank)
        # memory by component between steps, against chapter 01's formulas for this rank's piece and groups
        for k, want in mine[-1]["memory_formula"].items():
            assert 0 <= mine[-1][k] - want <= PADDING, (name, rank, k, mine[-1][k], want)


def test_llama3_miniature_resumes_on_one_device_and_its_activations_are_the_ledgers(groups, reference):
    ok(groups[16]["Llama 3 miniature"])            # the run that saves the checkpoint: its own error first
    assert_same_run(groups[1]["resumed on one"], reference["dense"][2:], "Llama 3 miniature resumed on one device")
    for rank, history in enumerate(every_rank(groups[16]["Llama 3 miniature"])):
        assert history[-1]["peak_activation_bytes"] == history[-1]["activation_bytes_predicted"], rank
    # ZeRO-2 over dp × cp = 4: a quarter of the gradients and AdamW state between steps, the weights whole
    row = ok(groups[16]["Llama 3 miniature"])[-1]
    assert row["param_bytes"] == pytest.approx(4 * row["grad_bytes"], abs=PADDING) == 2 * row["optim_bytes"]


def _planner_bytes(preset: str, c, pp_rank: int) -> dict:
    layout_costs = import_module("07_choosing_a_layout.layout_costs")
    schedule_costs = import_module("07_choosing_a_layout.schedule_costs")
    from common.model import PRESETS
    run = layout_costs.Run(PRESETS[preset], 8, 32, "fp32")
    specs = schedule_costs.specs_for(run.cfg, c.pp, c.virtual_stages, 32, c.schedule)
    want, _ = layout_costs.rank_traffic(run, c, specs, pp_rank)
    return want


def test_miniatures_bytes_per_group_are_the_planners(groups):
    """The bytes in the last step, per group, of the first and the last pipeline rank (global rank 0 and the
    first rank of the last stage: pp_rank · cp · tp on the grid (edp, ep, pp, cp, tp)), against
    layout_costs.rank_traffic (the routed all-to-all depends on the routing: within 20% of its
    uniform-routing expectation)."""
    Candidate = import_module("07_choosing_a_layout.layout_costs").Candidate
    cases = {(16, "Llama 3 miniature"): ("tiny", Candidate(dp=2, tp=2, pp=2, cp=2, zero_stage=2, sequence_parallel=True, microbatches=2)),
             (8, "GPT-3 miniature"): ("tiny", Candidate(dp=2, tp=2, pp=2, recompute="selective", sequence_parallel=True, schedule="interleaved", microbatches=2, virtual_stages=2)),
             (8, "DeepSeek-V3 miniature"): ("tiny-moe", Candidate(dp=4, pp=2, ep=4, zero_stage=1, schedule="zb-h1", microbatches=2)),
             # ZeRO-3 on the grid gathers the weights once per step: one gather and one reduce-scatter
             (8, "ZeRO-3 × tp 2 × cp 2, dense"): ("tiny", Candidate(dp=2, tp=2, cp=2, zero_stage=3, microbatches=2))}
    for (world, name), (preset, c) in cases.items():
        histories = every_rank(groups[world][name])
        for pp_rank in sorted({0, c.pp - 1}):
            row, want = histories[pp_rank * c.cp * c.tp][-1], _planner_bytes(preset, c, pp_rank)
            where = (name, pp_rank)
            dp = "comm_bytes_dp_cp" if c.cp > 1 else "comm_bytes_dp"
            assert row[dp] == pytest.approx(want["dp"], abs=PADDING), (where, row[dp], want["dp"])
            for g in ("tp", "pp", "cp"):
                assert row.get(f"comm_bytes_{g}", 0) == want[g], (where, g, row.get(f"comm_bytes_{g}"), want[g])
            if want["ep"]:
                assert row["comm_bytes_ep"] == pytest.approx(want["ep"], rel=0.2), (where, row["comm_bytes_ep"], want["ep"])


def test_tp_bytes_of_sequence_parallel_experts_equal_chapter_02s_formulas(groups):
    """Attention's all-gather / reduce-scatter pairs and nothing in the MoE, each router's (rows, E) counts,
    and after the step the norm gains', routers' and this rank's E/ep experts' gradients, summed over tp."""
    tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")
    from common.comm import collective_bytes
    from common.model import PRESETS
    cfg, tp, ep, dp, m = PRESETS["tiny-moe"], 2, 2, 4, 2
    micro = tensor_parallel.tp_collectives(cfg, 8 // dp // m, 32, tp, True, cfg.n_layers)
    grads = tensor_parallel.tp_gradient_collectives(cfg, tp, True, cfg.n_layers, ep=ep)
    want = m * sum(collective_bytes(k, n, tp) for k, n in micro) + sum(collective_bytes(k, n, tp) for k, n in grads)
    for rank, history in enumerate(every_rank(groups[8]["4d dp4·ep2 × tp2 +SP"])):
        assert [row["comm_bytes_tp"] for row in history] == [want] * len(history), (rank, want)


@pytest.mark.parametrize("kind", sorted(BAD))
def test_what_cannot_compose_is_refused_on_every_rank(groups, kind):
    assert_one_config_error(groups[8][f"bad {kind}"], BAD[kind][2])


def test_refusal_is_one_line_and_exit_2():
    """As a user meets it: `python train_4d.py` told it is one of 8 ranks refuses before any communication."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0"}
    script, argv, message = BAD["capacity with SP"]
    proc = subprocess.run([sys.executable, "05_moe_expert_parallel/train_4d.py", *argv, "--steps", "1", "--quiet"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=REFUSAL_TIMEOUT_S)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_readme_commands():
    """Each miniature is one command in the README of the chapter that can first run it."""
    for name, (chapter, launch, flags) in MINIATURES.items():
        text = (ROOT / chapter / "README.md").read_text()
        assert f"{launch} {' '.join(flags)}" in text, (name, chapter)


def test_memory_table_groups_ranks_and_reads_at_80_columns():
    """The run's last table: ranks with the same numbers on one line (as ranges), the step's peaks only where
    they differ from what is held between steps, the formulas beneath; 80 columns wide at 16 ranks."""
    from rich.console import Console
    console_3d = import_module("04_3d_combined.console_3d")
    held = {"param_bytes": 1642496, "grad_bytes": 410624, "optim_bytes": 821248}
    zero2 = {"held": held, "peak": {"param_bytes": 1642496, "grad_bytes": 1642496}, "activations": 6 * 2**20,
             "formula": held, "activations_predicted": 6 * 2**20}
    last = {**zero2, "activations": 3 * 2**20, "activations_predicted": 3 * 2**20}
    plain = {**zero2, "peak": {"param_bytes": 1642496, "grad_bytes": 410624}}
    console = Console(width=80, record=True)
    console.print(console_3d.memory_table([zero2] * 4 + [last] * 4 + [zero2] * 4 + [last] * 3 + [plain]))
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 80, text
    assert "0-3,8-11" in text and "4-7,12-14" in text and "│ 15 " in text, text
    assert text.count("in a step") == 2 and text.count("formula ") == 3, text
