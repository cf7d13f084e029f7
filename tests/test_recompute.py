"""--recompute: every mode gives the bit-identical run of `none` in every layout (losses, gradient
norms, MoE token counts), the recomputation replays the forward's RNG state, and the activation ledger
(common/activation_ledger.py) predicts the measured bytes within 2 % in every mode × layout; so does
--recompute-layers (full recomputation of the first blocks of each stage only) on one rank, TP + SP and
two pipelines."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from importlib import import_module

from common.comm import collective_bytes
from common.model import PRESETS
from common.recompute import MODES
from harness import every_rank, run_group

tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")
expert_parallel = import_module("05_moe_expert_parallel.expert_parallel")

BASE = ["--steps", "2", "--seq-len", "32", "--global-batch", "8", "--quiet"]
DP, TP, PP, MOE = ("01_data_parallel.train_dp:main", "02_tensor_parallel.train_tp:main",
                   "03_pipeline_parallel.train_pp:main", "05_moe_expert_parallel.train_moe:main")
ZERO = "01_data_parallel.train_zero:main"
LAYOUTS = {  # world -> {label: (script, flags)}
    1: {"1 rank": (DP, []), "1 rank, S×2, 2 micro-batches": (DP, ["--seq-len", "64", "--microbatches", "2"])},
    2: {"TP 2": (TP, ["--tp", "2"]),
        "TP 2 + SP": (TP, ["--tp", "2", "--sequence-parallel"]),
        "TP 2 + SP, S×2": (TP, ["--tp", "2", "--sequence-parallel", "--seq-len", "64"]),
        "1F1B pp 2": (PP, ["--pp", "2", "--schedule", "1f1b", "--microbatches", "4"]),
        "1F1B pp 2, S×2": (PP, ["--pp", "2", "--schedule", "1f1b", "--microbatches", "4", "--seq-len", "64"]),
        "ZB-H1 pp 2": (PP, ["--pp", "2", "--schedule", "zb-h1", "--microbatches", "4"]),
        "EP 2": (MOE, ["--ep", "2", "--router-bias-rate", "0.01"]),
        # ZeRO-3 frees each unit's weights after its forward: a recomputation gathers them again
        "ZeRO-3 dp 2": (ZERO, ["--zero-stage", "3"])},
    # TP groups {0, 1} and {2, 3} inside a world of 4: a recomputation on another group than the
    # forward's (the world, the DP group) sums other ranks' activations and changes the gradients
    4: {"TP 2 × DP 2": (TP, ["--tp", "2"])},
}
SAME = ("loss", "grad_norm", "expert_load", "aux_loss", "z_loss")
# --recompute-layers: full recomputation of the first 3 blocks of each stage only (of 8 in one stage,
# of 4 in each of pp 2's): between full and none in memory, its TP reruns only for those blocks
PARTIAL = "full, 3 blocks per stage"
PARTIAL_IN = ("1 rank", "TP 2 + SP", "1F1B pp 2", "ZB-H1 pp 2", "ZeRO-3 dp 2")
FLAGS = {**{mode: ["--recompute", mode] for mode in MODES}, PARTIAL: ["--recompute", "full", "--recompute-layers", "3"]}


def modes_of(label: str) -> tuple:
    return MODES + (PARTIAL,) if label in PARTIAL_IN else MODES


def histories(world: int) -> dict:
    """{(label, mode): rank 0's history} for every layout of `world`, one spawned group."""
    keys = [(label, mode) for label in LAYOUTS[world] for mode in modes_of(label)]
    jobs = [(LAYOUTS[world][label][0], BASE + LAYOUTS[world][label][1] + FLAGS[mode]) for label, mode in keys]
    results = run_group(world, jobs)
    return {key: every_rank(res)[0] for key, res in zip(keys, results)}


def tp_bytes(row: dict, S: int, mode: str) -> int:
    """Chapter 02's formula for one step's "tp" bytes of the tiny model (one micro-batch), in `mode`."""
    cfg, tp, sp = PRESETS["tiny"], row["tp"], row["sequence_parallel"]
    rows = 8 // row["dp"]
    mode, recomputed = ("full", 3) if mode == PARTIAL else (mode, None)
    collectives = (tensor_parallel.tp_collectives(cfg, rows, S, tp, sp, cfg.n_layers, recompute=mode,
                                                  recomputed=recomputed)
                   + tensor_parallel.tp_gradient_collectives(cfg, tp, sp, cfg.n_layers))
    return sum(collective_bytes(kind, n, tp) for kind, n in collectives)


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_every_mode_is_the_run_of_none_and_the_ledger_holds(world):
    runs = histories(world)
    for label in LAYOUTS[world]:
        reference = runs[(label, "none")]
        for mode in modes_of(label):
            rows = runs[(label, mode)]
            for row, ref in zip(rows, reference):
                for key in SAME:
                    assert row.get(key) == ref.get(key), f"{label} --recompute {mode} step {row['step']}: {key}"
            if rows[-1].get("tp", 1) > 1:     # full recomputation reruns the forward's TP collectives too
                flags = BASE + LAYOUTS[world][label][1]
                S = int(flags[len(flags) - 1 - flags[::-1].index("--seq-len") + 1])   # the last --seq-len
                assert rows[-1]["comm_bytes_tp"] == tp_bytes(rows[-1], S, mode), f"{label} --recompute {mode}"
            if "ZeRO-3" in label:             # no meter (its own hooks note what autograd saves); the weights
                # gathered at once: as few units as without recomputation, not the model (a recomputation
                # that kept the forward's weights for backward would hold every unit)
                assert rows[-1]["peak_param_bytes"] == reference[-1]["peak_param_bytes"], f"{label} {mode}"
                continue
            measured, predicted = rows[-1].get("peak_activation_bytes"), rows[-1].get("activation_bytes_predicted")
            if "EP" in label:                 # MoE layers: routed rows, not in the ledger
                assert predicted is None
                # full recomputation reruns each block's dispatch and combine (2 of the 4 exchanges) and counts
                counts = 8 * expert_parallel.counts_bytes(8, 2)
                rerun = (reference[-1]["comm_bytes_ep"] - counts) // 2 + counts if mode == "full" else 0
                assert rows[-1]["comm_bytes_ep"] == reference[-1]["comm_bytes_ep"] + rerun, f"{label} {mode}"
                # and chapter 05's formula, which the layout planner uses, adds the same share
                once, twice = (expert_parallel.expected_ep_bytes(8, 256, 2, 128, 8, 2, forward_runs=r) for r in (1, 2))
                assert twice - once == pytest.approx((once - counts) / 2 + counts)
                continue
            for m, p in zip(*(v if isinstance(v, list) else [v] for v in (measured, predicted))):
                assert abs(p - m) <= 0.02 * m, f"{label} --recompute {mode}: predicted {p} vs measured {m} bytes"
        saved = [runs[(label, mode)][-1].get("peak_activation_bytes") for mode in modes_of(label)]
        if saved[0] is not None:          # each mode keeps less: selective some, full most
            first = lambda v: v[0] if isinstance(v, list) else v   # noqa: E731
            assert first(saved[0]) > first(saved[1]) > first(saved[2]), f"{label}: {saved}"
            if label in PARTIAL_IN:       # 3 blocks of each stage recomputed: between none and full
                assert first(saved[0]) > first(saved[3]) > first(saved[2]), f"{label}: {saved}"


class DropoutAfter(nn.Module):
    """A module followed by dropout: a random op inside what the block recomputes."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return F.dropout(self.inner(x), p=0.5, training=True)


def block_gradients(mode: str) -> list[torch.Tensor]:
    from common.model import PRESETS, build_model
    model = build_model(PRESETS["tiny"], seed=0, recompute_mode=mode)
    block = model.layers[0]
    block.attn_norm, block.mlp_norm = DropoutAfter(block.attn_norm), DropoutAfter(block.mlp_norm)
    x = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(2)
    out = block(x, model.rope_cos, model.rope_sin)
    torch.randn(1000)                          # the RNG moves on before the backward recomputes
    out.square().sum().backward()
    return [x.grad] + [p.grad for p in block.parameters()]


def test_recomputation_replays_the_forwards_random_numbers():
    reference = block_gradients("none")
    for mode in ("selective", "full"):
        for got, want in zip(block_gradients(mode), reference):
            assert torch.equal(got, want), f"--recompute {mode}: the recomputed dropout drew another mask"


def test_a_recomputation_enters_every_context_its_forward_was_given_outer_first():
    """around_recomputation nests: ZeRO-3's weights and the executor's plain linear layers of a whole
    backward pass can both be around one forward, and its recomputation must enter both."""
    from contextlib import contextmanager
    from common import recompute
    entered = []

    @contextmanager
    def named(name):
        entered.append(name)
        yield

    x = torch.randn(4, requires_grad=True)
    with recompute.around_recomputation(lambda: named("outer")), recompute.around_recomputation(lambda: named("inner")):
        y = recompute.recomputed(torch.sin, x)
    assert entered == []
    y.sum().backward()
    assert entered == ["outer", "inner"] and torch.equal(x.grad, torch.cos(x.detach()))


def test_flag_domain_and_refusals():
    from common.errors import ConfigError
    from common.model import build_model
    with pytest.raises(ConfigError, match="recompute mode 'partial'"):
        build_model(PRESETS["tiny"], seed=0, recompute_mode="partial")
    results = run_group(1, [(DP, BASE + ["--recompute", "partial"]), (DP, BASE + ["--recompute"]),
                            (DP, BASE + ["--recompute-layers", "2"]), (DP, BASE + ["--recompute-layers", "0"])])
    for res, needle in zip(results, ["invalid choice: 'partial'", "expected one argument",
                                     "--recompute-layers 2 chooses blocks to recompute; add --recompute full",
                                     "--recompute-layers must be a whole number ≥ 1, got 0"]):
        (kind, message), = res
        assert kind == "config_error" and needle in message, message
