"""A Llama-style decoder: the single-device reference every chapter starts from.

Nothing here is parallel. Each chapter takes this model (or its state dict) and transforms it:
chapter 01 replicates or shards it, chapter 02 splits its matrices, chapter 03 cuts it into stages.
Because every layout starts from exactly these weights (built from the seed on every rank), every
layout can reproduce exactly the same losses.

Shapes: B batch, S sequence, D model dim, H query heads, K key/value heads, hd head dim, F MLP
hidden dim, V vocabulary; with experts: E experts, k experts per token, T = B·S tokens.

A config with `n_experts > 0` replaces every block's SwiGLU MLP by a mixture of experts (router +
E SwiGLU experts, `MoEFeedForward`; the routing math is in common/moe_routing.py). Dense configs build
exactly the model they always built.
"""
import math
from dataclasses import dataclass, asdict

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import recompute
from common.compile import compile_blocks, eager
from common.errors import require
from common.moe_routing import (AddRouterLoss, RoutingOptions, RoutingTally, combine_experts, group_by_expert,
                                route, router_loss)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256      # byte-level tokenizer: one token per byte
    dim: int = 128
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 4        # grouped-query attention: H/K query heads share one K/V head
    ffn_hidden: int = 384      # SwiGLU hidden size, ≈ 8/3·D rounded up
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    n_experts: int = 0         # 0: a dense SwiGLU MLP per block; E > 0: a mixture of E experts instead
    top_k: int = 2             # experts per token (MoE only)
    expert_hidden: int = 0     # one expert's SwiGLU hidden size (MoE only)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one rank of a TP group of `tp` holds, as chapter 02's ParallelAttention shards them:
        K/tp when K ≥ tp; else one, a copy shared by the tp/K ranks whose query heads read it."""
        return max(1, self.n_kv_heads // tp)

    def to_dict(self) -> dict:
        return asdict(self)


# `tiny` trains in seconds on a laptop CPU, yet has enough heads (8), KV heads (4) and layers (8)
# for every layout of the course: TP up to 4 (8 splits heads evenly too), PP up to 4 stages × 2
# virtual stages, vocabulary 256 divisible by any TP degree up to 8.
PRESETS = {
    "tiny":   ModelConfig(dim=128, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=384, max_seq_len=256),
    "small":  ModelConfig(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=704, max_seq_len=512),
    "medium": ModelConfig(dim=512, n_layers=16, n_heads=16, n_kv_heads=8, ffn_hidden=1408, max_seq_len=1024),
    "large":  ModelConfig(dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_hidden=2816, max_seq_len=2048),
    "xl":     ModelConfig(dim=2048, n_layers=24, n_heads=32, n_kv_heads=8, ffn_hidden=5632, max_seq_len=2048),
    # Mixtures of experts: each is its dense namesake with every MLP replaced by E experts of half the
    # hidden size, top-2, so a token computes as much as in the dense model (same *active* parameters,
    # plus the router) while the model holds E/2 times the MLP parameters. tiny-moe's 8 experts split
    # over EP 2, 4 or 8; small-moe's 16 up to 16. (ffn_hidden is unused when there are experts.)
    "tiny-moe":  ModelConfig(dim=128, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=384, max_seq_len=256,
                             n_experts=8, top_k=2, expert_hidden=192),
    "small-moe": ModelConfig(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=704, max_seq_len=512,
                             n_experts=16, top_k=2, expert_hidden=352),
}


def dense_preset(name: str, other_script: str) -> ModelConfig:
    """The configuration of preset `name`, for a script that distributes dense models only; a
    mixture-of-experts preset is refused, naming the script that distributes it."""
    cfg = PRESETS[name]
    require(not cfg.n_experts, f"--model {name} is a mixture of experts, which this script does not "
                               f"distribute; run it with {other_script}, or use a dense --model")
    return cfg


def parameter_shapes(cfg: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """Every parameter's shape from the config alone (no weights are built), by piece, under the names the
    built model gives them: {"embedding": {"tok_emb.weight": (V, D)}, "block": {...}, "head": {...}}. A
    block's names lack their "layers.i." prefix: every block holds the same. The pieces are the units
    chapter 01's ZeRO-3 gathers (the embedding, each block, the final norm with the head), and the
    counting the planner asks (through the Layout of chapters 04-06, which splits each piece as its
    chapters do)."""
    D, V, H, K, hd = cfg.dim, cfg.vocab_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def swiglu_shapes(prefix: str, hidden: int) -> dict:
        return {f"{prefix}.w_gate.weight": (hidden, D), f"{prefix}.w_up.weight": (hidden, D),
                f"{prefix}.w_down.weight": (D, hidden)}

    if cfg.n_experts:                          # router + experts (each a SwiGLU of expert_hidden)
        mlp = {"mlp.router.weight": (cfg.n_experts, D)}
        for i in range(cfg.n_experts):
            mlp.update(swiglu_shapes(f"mlp.experts.{i}", cfg.expert_hidden))
    else:
        mlp = swiglu_shapes("mlp", cfg.ffn_hidden)
    block = {"attn_norm.weight": (D,), "attn.wq.weight": (H * hd, D), "attn.wk.weight": (K * hd, D),
             "attn.wv.weight": (K * hd, D), "attn.wo.weight": (D, H * hd), "mlp_norm.weight": (D,), **mlp}
    return {"embedding": {"tok_emb.weight": (V, D)}, "block": block,
            "head": {"norm.weight": (D,), "lm_head.weight": (V, D)}}


def count_parameters(cfg: ModelConfig, active: bool = False) -> int:
    """Parameter count from the config alone (parameter_shapes), for printing presets.

    active=True: the parameters one token computes with. For a dense model that is all of them; with
    experts, the router and k of the E experts per layer (what a step's FLOPs scale with).
    """
    size = {piece: {name: math.prod(shape) for name, shape in shapes.items()}
            for piece, shapes in parameter_shapes(cfg).items()}
    block = sum(size["block"].values())
    if active and cfg.n_experts:               # the router and k of the E experts (each the same size)
        experts = sum(n for name, n in size["block"].items() if name.startswith("mlp.experts."))
        block -= experts - experts // cfg.n_experts * cfg.top_k
    return sum(size["embedding"].values()) + cfg.n_layers * block + sum(size["head"].values())


def describe_size(cfg: ModelConfig) -> str:
    """'1.6M params', or for a mixture of experts '5.2M params, 1.7M active'."""
    text = f"{count_parameters(cfg) / 1e6:.1f}M params"
    return text + (f", {count_parameters(cfg, active=True) / 1e6:.1f}M active" if cfg.n_experts else "")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):                                    # (..., D) -> (..., D)
        rms = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.float() * rms).type_as(x) * self.weight


def rope_tables(cfg: ModelConfig, device=None):
    """cos and sin tables for rotary position embeddings, each (max_seq_len, hd/2)."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate each (first half, second half) pair of x by its position's angle. x: (B, h, S, hd)."""
    S = x.shape[-2]
    cos, sin = cos[:S].to(x.dtype), sin[:S].to(x.dtype)      # (S, hd/2)
    x1, x2 = x.chunk(2, dim=-1)                              # (B, h, S, hd/2) each
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def causal_attention(q, k, v, cos, sin):
    """The attention math, shared by the single-device and the tensor-parallel attention.

    q: (B, h, S, hd), k and v: (B, kv, S, hd) with h a multiple of kv (grouped-query attention).
    Returns (B, S, h·hd). `h` and `kv` are whatever this rank holds: all heads here, a slice in TP.
    """
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    B, h, S, hd = out.shape
    return out.transpose(1, 2).reshape(B, S, h * hd)         # (B, S, h·hd)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # The attention core, (q, k, v, cos, sin) -> (B, S, h·hd): a plain attribute (no weights), so
        # that chapter 06 can put its context-parallel attention in its place.
        self.attend = causal_attention

    def forward(self, x, cos, sin):                          # x: (B, S, D)
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)     # (B, H, S, hd)
        k = self.wk(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, K, S, hd)
        v = self.wv(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, K, S, hd)
        return self.wo(self.attend(q, k, v, cos, sin))                             # (B, S, D)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, hidden: int | None = None):     # hidden: an expert's size
        super().__init__()
        hidden = hidden or cfg.ffn_hidden
        self.w_gate = nn.Linear(cfg.dim, hidden, bias=False)
        self.w_up = nn.Linear(cfg.dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x):                                    # (B, S, D) -> (B, S, D)
        return self.w_down(swiglu(self.w_gate(x), self.w_up(x)))    # hidden: (B, S, F)


def swiglu(gate, up):
    """silu(gate)·up, (..., F) each -> (..., F). Its backward needs gate, up and silu(gate): selective
    recomputation keeps gate and up (the matmul outputs) and rebuilds silu(gate), F values per token."""
    return recompute.cheap(_silu_times, gate, up)


def _silu_times(gate, up):
    return F.silu(gate) * up


class MoEFeedForward(nn.Module):
    """A mixture of experts in place of the MLP: each token goes to the k best of E SwiGLU experts.

    The router is a linear map D → E (no bias), softmax over the experts, top-k (common/moe_routing.py).
    Each expert runs on the rows routed to it, one batched call per expert, and a token's output is the
    gate-weighted sum of its k experts' outputs. Chapter 05 splits `experts` over ranks and moves the
    rows with an all-to-all; nothing here is parallel.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg, cfg.expert_hidden) for _ in range(cfg.n_experts))
        # Aux-loss-free balancing's bias: a buffer, not a parameter (no gradient, no optimizer), saved in
        # the state dict so a resumed run continues with it.
        self.register_buffer("selection_bias", torch.zeros(cfg.n_experts))
        self.options = RoutingOptions()         # dropless, no balancing terms, until a training run sets them
        self.stats = RoutingTally(cfg.n_experts)   # this step's routing on this rank: metrics, bias update

    # --compile runs this layer eagerly, between the compiled halves of its block (common/compile.py): how
    # many rows each expert gets is known only once the router has run (`counts.tolist()`), and a graph
    # traced for one step's counts would be traced again for the next step's.
    @eager
    def forward(self, x):                                    # (B, S, D) -> (B, S, D)
        B, S, D = x.shape
        routing = route(x, self.router, self.selection_bias, self.top_k, self.options.capacity_factor,
                        self.options.sequence_group, self.options.sequence_name)
        self.stats.add(routing)
        order, counts = group_by_expert(routing, self.n_experts)                 # (N,), (E,)
        xs = x.reshape(B * S, D)[order // self.top_k]                            # (N, D) grouped by expert
        ys = torch.cat([expert(rows) for expert, rows in zip(self.experts, xs.split(counts.tolist()))])
        y = combine_experts(ys, order, routing, B, S)                            # (B, S, D)
        return AddRouterLoss.apply(y, router_loss(routing, self.options))      # y; the terms join backward


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """Every mixture-of-experts layer of a model (single-device or expert-parallel: both keep `stats`)."""
    return [m for m in model.modules() if isinstance(getattr(m, "stats", None), RoutingTally)]


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

    `recompute_mode` (none | selective | full, common/recompute.py) says what its backward recomputes. It
    lives here, in the block every chapter keeps, so tensor-parallel attention, a pipeline stage's
    layers and expert-parallel MoE layers all honour it: they replace what is inside a block.
    """

    def __init__(self, cfg: ModelConfig, recompute_mode: str = "none"):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MoEFeedForward(cfg) if cfg.n_experts else SwiGLU(cfg)
        self.recompute_mode = recompute_mode

    def forward(self, x, cos, sin):                          # (B, S, D) -> (B, S, D)
        if self.recompute_mode == "full":         # keep x (cos, sin are the model's tables): rerun all in backward
            return recompute.recomputed(self.body, x, cos, sin)
        if self.recompute_mode == "none":         # (no context to enter: the compiler could not trace it)
            return self.body(x, cos, sin)
        with recompute.selective(True):
            return self.body(x, cos, sin)

    def body(self, x, cos, sin):                             # (B, S, D) -> (B, S, D)
        x = x + self.attn(recompute.cheap(self.attn_norm, x), cos, sin)
        return x + self.mlp(recompute.cheap(self.mlp_norm, x))


class Transformer(nn.Module):
    """tokens (B, S) -> logits (B, S, V). Pipeline stages call `embed`, `layers[i]`, `head` apart."""

    def __init__(self, cfg: ModelConfig, recompute_modes: list[str] | None = None):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, mode) for mode in recompute_modes or ["none"] * cfg.n_layers)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)   # untied from tok_emb
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)         # (max_seq_len, hd/2)
        self.register_buffer("rope_sin", sin, persistent=False)

    def embed(self, tokens):                                 # (B, S) -> (B, S, D)
        return self.tok_emb(tokens)

    def head(self, h):                                       # (B, S, D) -> (B, S, V)
        return self.lm_head(self.norm(h))

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.head(h)


def init_weights(model: Transformer, seed: int) -> Transformer:
    """Deterministic initialisation from the seed alone, identical on every rank and in every layout.

    Each parameter draws from its own generator seeded by (seed, parameter name), so the weights do
    not depend on construction order: a pipeline stage that builds only layers 4-7 gets exactly the
    same layer-4 weights as the full model. Residual output projections are scaled by 1/sqrt(2L).
    """
    n_layers = model.cfg.n_layers
    for name, p in model.named_parameters():
        g = torch.Generator().manual_seed(seed * 1_000_003 + _stable_hash(name))
        if name.endswith("norm.weight"):
            value = torch.ones(p.shape)
        else:
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("wo.weight", "w_down.weight")) else 0.02
            value = torch.randn(p.shape, generator=g) * std
        with torch.no_grad():
            p.copy_(value)
    return model


def _stable_hash(name: str) -> int:
    """A hash of a string that is the same in every process (Python's hash() is salted per process)."""
    h = 0
    for ch in name.encode():
        h = (h * 131 + ch) % 2_147_483_647
    return h


def build_model(cfg: ModelConfig, seed: int, device="cpu", recompute_mode: str = "none",
                compile_backend: str = "none", recompute_layers: int | None = None, stages=None) -> Transformer:
    """The reference model from the seed; `recompute_mode`: --recompute, in the first `recompute_layers`
    blocks of each of the pipeline's `stages` (their layer indices; default: every block, one stage), see
    common/recompute.py; `compile_backend`: --compile, each block compiled at its first call (common/compile.py)."""
    require(recompute_mode in recompute.MODES, f"recompute mode {recompute_mode!r} is not one of {recompute.MODES}")
    modes = recompute.block_modes(recompute_mode, cfg.n_layers, recompute_layers, stages)
    model = init_weights(Transformer(cfg, modes), seed).to(device)
    return compile_blocks(model, compile_backend)


def loss_sum(logits, targets):
    """Summed (not averaged) cross-entropy. (B, S, V), (B, S) -> scalar.

    Every layout divides this sum by the token count of the *global* batch, so that summing the
    per-rank gradients gives exactly the single-device gradient of the mean loss.
    """
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
