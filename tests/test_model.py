"""The single-device reference model: shapes, RoPE, grouped-query attention, causality, init."""
import math

import torch
import torch.nn.functional as F

from common.model import (PRESETS, ModelConfig, Transformer, apply_rope, build_model, causal_attention,
                          count_parameters, init_weights, loss_sum, rope_tables)

CFG = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=96, max_seq_len=32)


def test_output_shapes():
    model = build_model(CFG, seed=0)
    tokens = torch.randint(0, CFG.vocab_size, (3, 11))
    assert model.embed(tokens).shape == (3, 11, CFG.dim)
    assert model(tokens).shape == (3, 11, CFG.vocab_size)
    loss = loss_sum(model(tokens), tokens)
    assert loss.shape == () and math.isclose(loss.item() / 33, math.log(256), rel_tol=0.05)   # ≈ uniform at init


def test_rope_preserves_norms():
    cos, sin = rope_tables(CFG)
    x = torch.randn(2, 4, 16, CFG.head_dim)                 # (B, h, S, hd)
    torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1))


def test_rope_scores_depend_only_on_the_offset():
    """q·k after rotating q to position m and k to position n depends on m - n alone."""
    cos, sin = rope_tables(CFG)
    q, k = torch.randn(CFG.head_dim), torch.randn(CFG.head_dim)
    S = CFG.max_seq_len

    def score(m, n):
        qs = torch.zeros(1, 1, S, CFG.head_dim)
        ks = torch.zeros(1, 1, S, CFG.head_dim)
        qs[0, 0, m], ks[0, 0, n] = q, k
        return (apply_rope(qs, cos, sin)[0, 0, m] @ apply_rope(ks, cos, sin)[0, 0, n]).item()

    for offset in (0, 3, 10):
        scores = [score(n + offset, n) for n in (0, 5, 17)]
        assert max(scores) - min(scores) < 1e-4, scores
    assert abs(score(7, 0) - score(3, 0)) > 1e-3            # and it does depend on the offset


def test_grouped_query_attention_equals_repeated_kv_heads():
    cos, sin = rope_tables(CFG)
    B, H, K, S, hd = 2, CFG.n_heads, CFG.n_kv_heads, 9, CFG.head_dim
    q, k, v = torch.randn(B, H, S, hd), torch.randn(B, K, S, hd), torch.randn(B, K, S, hd)
    # Explicit multi-head attention: each query head h uses K/V head h // (H/K).
    k_rep, v_rep = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)   # (B, H, S, hd)
    qr, kr = apply_rope(q, cos, sin), apply_rope(k_rep, cos, sin)
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    att = (qr @ kr.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~mask, float("-inf")).softmax(-1)
    want = (att @ v_rep).transpose(1, 2).reshape(B, S, H * hd)
    torch.testing.assert_close(causal_attention(q, k, v, cos, sin), want, atol=1e-5, rtol=1e-4)


def test_causal_mask_hides_the_future():
    model = build_model(CFG, seed=0)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % CFG.vocab_size
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_count_parameters_matches_the_built_model():
    for cfg in (CFG, PRESETS["tiny"], PRESETS["small"]):
        with torch.device("meta"):                            # no memory for the weights
            model = Transformer(cfg)
        assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())


def test_init_is_the_same_whatever_the_building_order():
    """Each weight comes from (seed, its name), not from a shared RNG stream consumed in order."""
    from common.model import Block
    full = build_model(CFG, seed=5)
    torch.manual_seed(123)                                    # the global RNG state must not matter
    other = Transformer(CFG)
    blocks = [Block(CFG) for _ in range(CFG.n_layers)][::-1]  # layers constructed last to first
    for i in reversed(range(CFG.n_layers)):
        other.layers[i] = blocks[CFG.n_layers - 1 - i]
    init_weights(other, seed=5)
    for (name, p), (_, q) in zip(full.named_parameters(), other.named_parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(full.layers[0].attn.wq.weight, build_model(CFG, seed=6).layers[0].attn.wq.weight)
    assert not torch.equal(full.layers[0].attn.wq.weight, full.layers[1].attn.wq.weight)


def test_init_of_a_partial_model_matches_the_full_one():
    """Stage-style: a model with only the first layer gets exactly the full model's layer-0 weights."""
    full = build_model(CFG, seed=5)
    part = Transformer(CFG)
    del part.layers[1:]                                       # only layer 0 remains
    init_weights(part, seed=5)
    for name, p in part.named_parameters():
        assert torch.equal(p, dict(full.named_parameters())[name]), name


def test_loss_sum_is_the_summed_cross_entropy():
    logits, targets = torch.randn(2, 5, 256), torch.randint(0, 256, (2, 5))
    torch.testing.assert_close(loss_sum(logits, targets) / 10, F.cross_entropy(logits.view(10, 256), targets.view(10)))
