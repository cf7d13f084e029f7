"""The single-device mixture of experts: router, balancing losses and capacity against closed-form toy
cases; the layer against a token-by-token loop; parameter counts; the MoE flags' checks."""
import math

import pytest
import torch
import torch.nn as nn

from common.cli import Parser
from common.errors import ConfigError
from common.model import (PRESETS, ModelConfig, MoEFeedForward, SwiGLU, Transformer, build_model, count_parameters,
                          moe_layers)
from common.moe_args import add_moe_args, check_moe_args, expert_parallel_degree, moe_model_config, routing_options
from common.moe_routing import (AddRouterLoss, RoutingOptions, capacity_mask, combine_experts, group_by_expert, route,
                                update_selection_bias)

CFG = ModelConfig(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=32, max_seq_len=16,
                  n_experts=4, top_k=2, expert_hidden=8)


def router_with_logits(logits):
    """A router and inputs whose logits are exactly `logits` (B, S, E): identity weights, x = logits."""
    E = logits.shape[-1]
    router = nn.Linear(E, E, bias=False)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
    return router, logits.clone().requires_grad_(True)


def test_router_picks_the_top_k_and_renormalises_the_gates():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]]])           # (1, 2, 4)
    router, x = router_with_logits(logits)
    r = route(x, router, torch.zeros(4), top_k=2)
    assert r.experts.tolist() == [[0, 1], [2, 3]]
    p = logits.softmax(-1)[0]
    want = torch.stack([p[0, [0, 1]] / p[0, [0, 1]].sum(), p[1, [2, 3]] / p[1, [2, 3]].sum()])
    torch.testing.assert_close(r.gates.detach(), want)
    assert r.keep.all() and r.dropped.item() == 0 and r.load.tolist() == [1, 1, 1, 1]


def test_uniform_routing_gives_an_aux_loss_of_exactly_one():
    """Uniform probabilities: Pᵢ = 1/E, so E·Σ fᵢPᵢ = Σ fᵢ = 1 per sequence, whichever experts top-k picks."""
    router, x = router_with_logits(torch.zeros(3, 5, 4))
    r = route(x, router, torch.zeros(4), top_k=2)
    assert r.aux_sum.item() == pytest.approx(3.0, abs=1e-6)                            # 3 sequences × 1
    assert r.z_sum.item() == pytest.approx(15 * math.log(4) ** 2, rel=1e-6)             # logsumexp(0⁴) = log 4


def test_balancing_terms_of_a_model_with_zero_routers_are_alpha_and_beta_ln_e_squared_per_layer():
    """The scale of both terms, with the weights the training scripts give them (routing_options: α per
    sequence, β per token). Zero router weights make every logit 0 and every probability exactly 1/E, so
    per layer E·Σᵢ fᵢPᵢ = Σᵢ fᵢ = 1 whichever experts top-k picks among the ties (the fᵢ are shares of
    the sequence's S·k slots, k distinct experts per token), and logsumexp(0, ..., 0) = ln E per token:
    the L layers add α·L and β·L·(ln E)² to the objective."""
    cfg = PRESETS["tiny-moe"]
    model = build_model(cfg, seed=0)
    for layer in moe_layers(model):
        layer.router.weight.data.zero_()
        layer.options = routing_options(parse_args([]), sequences_per_step=4, seq_len=32)
    model(torch.randint(0, cfg.vocab_size, (4, 32)))
    aux = sum(layer.options.aux_weight * layer.stats.aux_sum.item() for layer in moe_layers(model))
    z = sum(layer.options.z_weight * layer.stats.z_sum.item() for layer in moe_layers(model))
    assert aux == pytest.approx(0.01 * cfg.n_layers, rel=1e-6)                          # the default α
    assert z == pytest.approx(0.001 * cfg.n_layers * math.log(cfg.n_experts) ** 2, rel=1e-6)   # the default β


def test_aux_loss_closed_form_when_one_expert_takes_everything():
    logits = torch.tensor([[[5.0, 0.0, 0.0, 0.0]] * 4])                                 # (1, 4, 4)
    router, x = router_with_logits(logits)
    r = route(x, router, torch.zeros(4), top_k=1)
    p0 = math.exp(5) / (math.exp(5) + 3)
    assert r.aux_sum.item() == pytest.approx(4 * 1.0 * p0, rel=1e-6)                    # E·f₀·P₀, f₀ = 1
    assert r.z_sum.item() == pytest.approx(4 * math.log(math.exp(5) + 3) ** 2, rel=1e-6)
    # gradient of the aux term reaches the logits through P only: dP₀/dlogit₀ = p₀(1 − p₀) per token
    r.aux_sum.backward()
    assert x.grad[0, 0, 0].item() == pytest.approx(4 * 1.0 * p0 * (1 - p0) / 4, rel=1e-5)


def test_aux_loss_is_per_sequence():
    """Two sequences, each using one expert only: per sequence f = (1, 0) and (0, 1); batch-wide it would be
    (½, ½). The per-sequence loss sees the imbalance inside each sequence."""
    logits = torch.tensor([[[4.0, 0.0]] * 3, [[0.0, 4.0]] * 3])                          # (2, 3, 2)
    router, x = router_with_logits(logits)
    r = route(x, router, torch.zeros(2), top_k=1)
    p = math.exp(4) / (math.exp(4) + 1)
    assert r.aux_sum.item() == pytest.approx(2 * (2 * p), rel=1e-6)                      # each: E·1·p
    assert r.load.tolist() == [3, 3]


def test_capacity_serves_tokens_in_order_until_full():
    # 1 sequence, S = 4 tokens, k = 2, E = 3, CF = 0.75: capacity ⌈0.75·4·2/3⌉ = 2 per expert.
    chosen = torch.tensor([[[0, 1], [1, 0], [0, 2], [2, 1]]])                           # (1, 4, 2)
    keep = capacity_mask(chosen, 3, 0.75)
    # expert 0 serves tokens 0, 1 (full: token 2's slot is dropped); expert 1 tokens 0, 1 (token 3's dropped);
    # expert 2 tokens 2, 3.
    assert keep[0].tolist() == [[True, True], [True, True], [False, True], [True, False]]
    # the order of a token's own choices does not matter, only which experts it chose
    assert torch.equal(capacity_mask(chosen.flip(-1), 3, 0.75), keep.flip(-1))
    assert capacity_mask(chosen, 3, None).all()
    assert capacity_mask(chosen, 3, 1.5).all()                                            # capacity 4: room for all


@pytest.mark.parametrize("cf, S, k, E, capacity", [
    (1.1, 50, 2, 10, 11),     # 1.1·50·2/10 is whole, but 11.000000000000002 in floats: a float ceil says 12
    (0.55, 100, 2, 10, 11),   # likewise
    (1.25, 64, 2, 8, 20),     # whole in floats too
    (1.0, 5, 1, 2, 3),        # ⌈2.5⌉: not whole, so a floor (2) is wrong
    (0.75, 12, 2, 8, 3),      # ⌈2.25⌉
])
def test_capacity_is_the_exact_ceiling(cf, S, k, E, capacity):
    """Every token of one sequence chooses experts 0..k-1: each of them serves exactly `capacity` tokens,
    the first ones, and drops the rest."""
    chosen = torch.arange(k).expand(1, S, k)                                              # (1, S, k)
    keep = capacity_mask(chosen, E, cf)
    assert keep[0].tolist() == [[True] * k] * capacity + [[False] * k] * (S - capacity)


def test_capacity_groups_are_sequences():
    chosen = torch.zeros(3, 4, 1, dtype=torch.long)                                       # everyone picks expert 0
    keep = capacity_mask(chosen, 2, 1.0)                                                   # capacity ⌈4/2⌉ = 2
    assert keep.squeeze(-1).tolist() == [[True, True, False, False]] * 3


def test_a_token_with_every_slot_dropped_passes_through_the_residual_only():
    torch.manual_seed(0)
    block_cfg = ModelConfig(**{**CFG.to_dict(), "n_layers": 1})
    model = build_model(block_cfg, seed=1)
    moe = model.layers[0].mlp
    moe.options = RoutingOptions(capacity_factor=1e-9)                 # capacity ⌈tiny⌉ = 1 slot per expert
    x = torch.randn(1, 8, CFG.dim)
    y = moe(x)
    routing = route(x, moe.router, moe.selection_bias, CFG.top_k, 1e-9)
    # capacity 1, not 0: each chosen expert serves its first slot (a capacity of 0 would drop everything)
    assert routing.keep.any() and routing.keep.sum() == routing.experts.unique().numel()
    dropped_tokens = (~routing.keep).all(dim=1)
    assert dropped_tokens.any()
    assert torch.equal(y[0, dropped_tokens], torch.zeros_like(y[0, dropped_tokens]))


def test_moe_layer_equals_a_token_by_token_loop():
    torch.manual_seed(0)
    moe = MoEFeedForward(CFG)
    moe.selection_bias.copy_(torch.tensor([0.0, 0.05, -0.05, 0.0]))     # the bias moves selection, not the gates
    x = torch.randn(2, 6, CFG.dim)
    y = moe(x)
    probs = moe.router(x).softmax(-1)
    want = torch.zeros_like(y)
    for b in range(2):
        for s in range(6):
            top = (probs[b, s] + moe.selection_bias).topk(2).indices
            gates = probs[b, s, top] / probs[b, s, top].sum()
            want[b, s] = sum(g * moe.experts[e](x[b, s]) for g, e in zip(gates, top.tolist()))
    torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-5)


def test_group_by_expert_and_combine_are_inverse():
    chosen = torch.tensor([[2, 0], [0, 1], [2, 1]])
    r = route(torch.zeros(1, 3, 4), nn.Linear(4, 3, bias=False), torch.zeros(3), 2)
    r.experts, r.gates = chosen, torch.full((3, 2), 0.5)
    order, counts = group_by_expert(r, 3)
    assert counts.tolist() == [2, 2, 2]
    assert order.tolist() == [1, 2, 3, 5, 0, 4]                         # expert 0's slots, then 1's, then 2's
    rows = torch.arange(6.0).view(6, 1)                                 # expert output = sort position
    y = combine_experts(rows, order, r, 1, 3)
    assert y.flatten().tolist() == [0.5 * (4 + 0), 0.5 * (1 + 2), 0.5 * (5 + 3)]


def test_add_router_loss_gives_the_gradient_of_the_sum():
    w = torch.randn(5, requires_grad=True)
    y, aux = w * 2, (w ** 2).sum()
    (AddRouterLoss.apply(y, aux).sum()).backward()
    torch.testing.assert_close(w.grad, torch.full((5,), 2.0) + 2 * w.detach())


def test_selection_bias_update():
    bias = torch.zeros(4)
    update_selection_bias(bias, torch.tensor([10.0, 2.0, 2.0, 2.0]), 0.1)          # mean 4
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])
    update_selection_bias(bias, torch.tensor([4.0, 4.0, 4.0, 4.0]), 0.1)            # balanced: unchanged
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])


def test_parameter_counts_total_and_active():
    for cfg in (CFG, PRESETS["tiny-moe"], PRESETS["small-moe"]):
        with torch.device("meta"):
            model = Transformer(cfg)
        assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())
        expert = sum(p.numel() for p in model.layers[0].mlp.experts[0].parameters())
        idle = cfg.n_layers * (cfg.n_experts - cfg.top_k) * expert          # the experts a token does not use
        assert count_parameters(cfg) - count_parameters(cfg, active=True) == idle
    # tiny-moe computes what tiny computes, plus its routers: the same active MLP size
    assert count_parameters(PRESETS["tiny-moe"], active=True) - count_parameters(PRESETS["tiny"]) == 8 * 128 * 8


def test_dense_configs_build_the_dense_model():
    model = build_model(PRESETS["tiny"], seed=0)
    assert all(isinstance(block.mlp, SwiGLU) for block in model.layers) and not moe_layers(model)
    assert len(moe_layers(build_model(CFG, seed=0))) == CFG.n_layers
    assert "layers.0.mlp.selection_bias" in build_model(CFG, seed=0).state_dict()   # checkpointed


# --- the flags -------------------------------------------------------------------------------------

def parse_args(argv):
    p = Parser()                                    # the scripts' parser: it tells each flag's domain its name
    p.add_argument("--model", default="tiny-moe")
    add_moe_args(p)
    return p.parse_args(argv)


def parse(argv, world=4):
    args = parse_args(argv)
    cfg = moe_model_config(args)
    ep = expert_parallel_degree(args.ep, cfg, world)
    check_moe_args(args, cfg, world, ep)
    return cfg, ep


@pytest.mark.parametrize("argv,world,message", [
    (["--ep", "3"], 6, "8 experts do not split over --ep 3"),
    (["--ep", "4"], 2, "--ep 4 does not divide the world size 2"),
    (["--ep", "0"], 2, "--ep must be a whole number ≥ 1, got 0"),
    (["--top-k", "9"], 2, "--top-k 9 must be between 1 and the model's 8 experts"),
    (["--top-k", "0"], 2, "--top-k must be a whole number ≥ 1, got 0"),
    (["--capacity-factor", "0"], 2, "--capacity-factor must be a finite number > 0"),
    (["--capacity-factor", "nan"], 2, "--capacity-factor must be a finite number > 0"),
    (["--aux-loss-coef", "-0.1"], 2, "--aux-loss-coef must be a finite number ≥ 0"),
    (["--z-loss-coef", "-1"], 2, "--z-loss-coef must be a finite number ≥ 0"),
    (["--router-bias-rate", "inf"], 2, "--router-bias-rate must be a finite number ≥ 0"),
    (["--model", "tiny", "--ep", "2"], 2, "--ep needs a mixture-of-experts model, but --model tiny is dense"),
    (["--model", "tiny", "--capacity-factor", "1"], 2, "--capacity-factor needs a mixture-of-experts model"),
])
def test_bad_moe_flags(argv, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse(argv, world)


def test_default_ep_is_the_largest_that_fits():
    assert parse([], world=4)[1] == 4 and parse([], world=16)[1] == 8 and parse([], world=6)[1] == 2
    assert parse(["--model", "tiny"], world=4)[1] == 1
    assert parse(["--top-k", "1"], world=2)[0].top_k == 1
