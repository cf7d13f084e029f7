"""The activation ledger: the bytes autograd keeps for backward, predicted term by term for this model.

Korthikanti et al. (2022) count, for a GPT block in 16-bit with dropout, sbh·(34 + 5as/h) bytes per
layer (s sequence, b micro-batch, h hidden size, a heads). This file is the same count for this
Llama block (RMSNorm, RoPE, grouped-query attention, SwiGLU, the SDPA kernel), in fp32, for each
`--recompute` mode and each layout. Per position of a sequence and per layer (β = 4 bytes):

    term                                              kept in            bytes per position
    block input x (the residual stream)               none, sel., full   β·D          (SP shard)
    attention norm: x·rms and rms                     none               β·(D + 1)    (SP shard)
    norm output: wq, wk, wv's input                   none, selective    β·D          (SP shard)
    attention kernel (SDPA): q, k after RoPE, v, out,
        and its fp32 log-sum-exp                      none, selective    β·(2h + 2k)·hd + 4·h
    attention output reshaped: wo's input             none, selective    β·h·hd
    residual after attention                          none, selective    β·D          (SP shard)
    MLP norm: x·rms and rms                           none               β·(D + 1)    (SP shard)
    norm output: gate and up's input                  none, selective    β·D          (SP shard)
    gate and up outputs                               none, selective    2β·F
    silu(gate)                                        none               β·F
    silu(gate)·up: down's input                       none, selective    β·F

h and k are the query and KV heads this rank holds (H/tp, K/tp or 1), F the MLP hidden size it holds
(F/tp). "(SP shard)" terms are kept whole on every TP rank without sequence parallelism, and as this
rank's S/tp positions with it; every other term covers S positions (S/cp under context parallelism).
The residual stream and the norms live outside the tensor-parallel region, so SP splits them; the
norm outputs are the column-parallel layers' input, which SP all-gathers to (B, S, D), but chapter
02's `GatherThenColumnLinears` keeps only the shard and gathers it again in backward (Megatron-LM's
way). That is Korthikanti et al.'s split: without SP the whole-on-every-rank terms are their
sbh·10 (norm inputs, dropout masks, the two gathered inputs), the rest sbh·24/t; with SP all 34/t.
RoPE keeps nothing of its own (it multiplies by constant tables), nor do the residual additions.
Compared with the GPT count: no dropout masks (no dropout), no 5as/h term (the SDPA kernel keeps a
log-sum-exp per head and position, never the S×S scores), two norm outputs where LayerNorm keeps its
input, and SwiGLU's four F-wide tensors where a GeLU MLP keeps two of 4h.

Under bf16 autocast the ledger has its own terms (bf16_layer_terms, bf16_weight_copies, bf16_rope_casts):
what stays fp32 (the residual stream, the norms, the loss, SP's kept input shards, CP's attention output)
and what autocast casts, each nn.Linear its own copy of its input and of its weight, each block its own
copies of the RoPE tables. It keeps about 0.7 of the fp32 bytes, not half.

Around the layers: the embedding keeps nothing but the token ids (the step's input, not counted; under
TP its own shifted int64 ids and an fp32 mask), the head its final norm and the lm_head's input (both
SP shards) and the loss's (B, S, V) log-softmax (under TP: the softmax of V/tp columns, the targets
and a bool mask), and every micro-batch on a stage with layers references the RoPE tables (model
buffers, counted once per micro-batch by the measurement).
"""
from dataclasses import dataclass

from common.recompute import MODES, recomputed_of

FP32, INT64, BF16 = 4, 8, 2
LOSS_SCALAR = 4       # the loss keeps one fp32 scalar (cross-entropy's total weight)
EVERY, NOT_FULL, NONE_ONLY = MODES, ("none", "selective"), ("none",)


@dataclass(frozen=True)
class Term:
    name: str
    bytes_per_position: int
    kept: tuple            # the --recompute modes in which autograd keeps it
    sp_shard: bool = False  # S/tp positions under sequence parallelism (S without): the "(SP shard)" terms


def attention_kernel_term(cfg, tp: int = 1, kv_copies: int = 1) -> Term:
    """What the attention kernel keeps per position it computes: SDPA's q, k (after RoPE), v, out and
    fp32 log-sum-exp (B, h, S). Chapter 06's ring attention keeps exactly these for its S/cp positions
    (it recomputes every block's probabilities from them); its all-gather variant keeps the K and V
    gathered from all cp ranks instead of its own: `kv_copies` = cp."""
    h, k = cfg.n_heads // tp, cfg.kv_heads_per_rank(tp)
    return Term("attention kernel (SDPA, or CP's): q, k, v, out, log-sum-exp",
                FP32 * (2 * h + 2 * k * kv_copies) * cfg.head_dim + 4 * h, NOT_FULL)


def layer_terms(cfg, tp: int = 1, kv_copies: int = 1, dtype: str = "fp32", sequence_parallel: bool = False,
                cp: int = 1) -> list[Term]:
    """One block's saved tensors, per position (bytes), as the table in the module docstring; under bf16
    autocast, bf16_layer_terms."""
    if dtype == "bf16":
        return bf16_layer_terms(cfg, tp, kv_copies, sequence_parallel, cp)
    D, hd, F, h = cfg.dim, cfg.head_dim, cfg.ffn_hidden // tp, cfg.n_heads // tp
    return [
        Term("block input x (residual stream)", FP32 * D, EVERY, sp_shard=True),
        Term("attention norm: x·rms, rms", FP32 * (D + 1), NONE_ONLY, sp_shard=True),
        Term("norm output (wq, wk, wv input)", FP32 * D, NOT_FULL, sp_shard=True),   # gathered again in backward
        attention_kernel_term(cfg, tp, kv_copies),
        Term("attention output (wo input)", FP32 * h * hd, NOT_FULL),
        Term("residual after attention", FP32 * D, NOT_FULL, sp_shard=True),
        Term("MLP norm: x·rms, rms", FP32 * (D + 1), NONE_ONLY, sp_shard=True),
        Term("norm output (gate, up input)", FP32 * D, NOT_FULL, sp_shard=True),     # gathered again in backward
        Term("gate, up outputs", FP32 * 2 * F, NOT_FULL),
        Term("silu(gate)", FP32 * F, NONE_ONLY),
        Term("silu(gate)·up (down input)", FP32 * F, NOT_FULL),
    ]


def bf16_layer_terms(cfg, tp: int = 1, kv_copies: int = 1, sequence_parallel: bool = False,
                     cp: int = 1) -> list[Term]:
    """One block's saved tensors under bf16 autocast, measured with the activation meter on one rank, on a
    pipeline's stages, under TP with and without SP and under CP (tests/test_bf16.py, within 0.5 %): the
    residual stream and RMSNorm stay fp32 (the weights are fp32; a norm computes in fp32); every nn.Linear saves
    its own bf16 cast of its input (wq, wk and wv three copies of the norm output, gate and up two), and its
    output is bf16; SDPA keeps bf16 q, k, v and out with an fp32 log-sum-exp; SwiGLU's tensors are bf16. So
    it is not the fp32 ledger halved: it keeps about 0.7 of it. Under SP chapter 02's gather-then-column
    function saves its input shard as it came, fp32, once for all the linears it feeds (the casts it makes
    inside are gone when it returns); under CP chapter 06's attention keeps its running out in fp32 (its
    softmax math runs with autocast off)."""
    D, hd, F, h, k = cfg.dim, cfg.head_dim, cfg.ffn_hidden // tp, cfg.n_heads // tp, cfg.kv_heads_per_rank(tp)
    if sequence_parallel and tp > 1:
        norm_outputs = [Term("norm output shard (fp32), kept once by SP's gather for wq, wk, wv", FP32 * D, NOT_FULL,
                             sp_shard=True),
                        Term("norm output shard (fp32), kept once by SP's gather for gate, up", FP32 * D, NOT_FULL,
                             sp_shard=True)]
    else:
        norm_outputs = [Term("norm output, cast to bf16 by wq, wk, wv (three copies)", 3 * BF16 * D, NOT_FULL,
                             sp_shard=True),
                        Term("norm output, cast to bf16 by gate and up (two copies)", 2 * BF16 * D, NOT_FULL,
                             sp_shard=True)]
    out = FP32 if cp > 1 else BF16
    return [
        Term("block input x (residual stream, fp32)", FP32 * D, EVERY, sp_shard=True),
        Term("attention norm: x·rms, rms (fp32)", FP32 * (D + 1), NONE_ONLY, sp_shard=True),
        norm_outputs[0],
        Term(f"attention kernel: bf16 q, k, v; {'fp32' if cp > 1 else 'bf16'} out; fp32 log-sum-exp",
             BF16 * (h + 2 * k * kv_copies) * hd + out * h * hd + 4 * h, NOT_FULL),
        Term("attention output (wo input, bf16)", BF16 * h * hd, NOT_FULL),
        Term("residual after attention (fp32)", FP32 * D, NOT_FULL, sp_shard=True),
        Term("MLP norm: x·rms, rms (fp32)", FP32 * (D + 1), NONE_ONLY, sp_shard=True),
        norm_outputs[1],
        Term("gate, up outputs (bf16)", BF16 * 2 * F, NOT_FULL),
        Term("silu(gate) (bf16)", BF16 * F, NONE_ONLY),
        Term("silu(gate)·up (down input, bf16)", BF16 * F, NOT_FULL),
    ]


def bf16_weight_copies(cfg, n_layers: int, mode: str, last: bool, tp: int = 1, sequence_parallel: bool = False) -> int:
    """The bf16 casts of the weights that autocast makes in a forward and each nn.Linear saves for backward:
    a micro-batch holds its own (a block recomputed whole saves none until its backward), the head's
    always. This rank's shards under TP. Under SP the column-parallel weights (wq, wk, wv, gate, up, the
    head's) are cast inside SP's gather-then-column function, which saves the fp32 weights themselves: only
    the row-parallel wo and down keep casts."""
    D, hd, F, h, k = cfg.dim, cfg.head_dim, cfg.ffn_hidden // tp, cfg.n_heads // tp, cfg.kv_heads_per_rank(tp)
    if sequence_parallel and tp > 1:
        block, head = BF16 * D * (h * hd + F), 0
    else:
        block, head = BF16 * D * ((2 * h + 2 * k) * hd + 3 * F), BF16 * D * cfg.vocab_size // tp
    return (n_layers * block if mode != "full" else 0) + (head if last else 0)


def bf16_rope_casts(cfg, positions: int) -> int:
    """Under bf16 autocast RoPE multiplies q and k by cos and sin cast to bf16 in each block, and the products
    keep those casts: (positions, hd/2) each, four per block and micro-batch, whatever its rows (the fp32
    tables themselves are then kept by nothing)."""
    return 4 * positions * (cfg.head_dim // 2) * BF16


def embedding_terms(cfg, tp: int = 1) -> list[Term]:
    """The token ids themselves are the step's input, not counted; a vocab-parallel embedding keeps
    its own shifted ids and a mask."""
    return [Term("local ids (int64), mask (fp32)", INT64 + FP32, EVERY)] if tp > 1 else []


def head_terms(cfg, tp: int = 1, dtype: str = "fp32", sequence_parallel: bool = False) -> list[Term]:
    D, V = cfg.dim, cfg.vocab_size
    if dtype == "bf16" and tp == 1:      # the loss runs in fp32 under autocast: it keeps an fp32 log-softmax
        return [Term("final norm: x, x·rms, rms (fp32)", FP32 * (2 * D + 1), EVERY, sp_shard=True),
                Term("lm_head input (bf16 cast)", BF16 * D, EVERY, sp_shard=True),
                Term("log-softmax (B, S, V), fp32", FP32 * V, EVERY), Term("targets (int64)", INT64, EVERY)]
    if tp == 1:
        loss = [Term("log-softmax (B, S, V)", FP32 * V, EVERY), Term("targets (int64)", INT64, EVERY)]
    else:        # the vocab-parallel cross-entropy's own saved tensors
        loss = [Term("softmax (B, S, V/tp)", FP32 * V // tp, EVERY),
                Term("local targets (int64), mask (bool)", INT64 + 1, EVERY)]
    if dtype == "bf16" and not sequence_parallel:    # TP's lm_head, a linear under autocast: its input's bf16 cast
        head_input = Term("lm_head input (bf16 cast)", BF16 * D, EVERY)
    else:                                            # (SP's gather keeps the fp32 shard, gathered again in backward)
        head_input = Term("lm_head input", FP32 * D, EVERY, sp_shard=True)
    return [Term("final norm: x, x·rms, rms", FP32 * (2 * D + 1), EVERY, sp_shard=True), head_input] + loss


def deferred_terms(cfg, tp: int = 1) -> list[Term]:
    """Zero bubble: what B leaves for W, each nn.Linear's input x and output gradient dy (wq, wk, wv
    share x; so do gate and up). The layers of tensor parallelism are not nn.Linear: their weight
    gradients are computed in B, nothing waits."""
    if tp > 1:
        return []
    D, hd, F, h, k = cfg.dim, cfg.head_dim, cfg.ffn_hidden, cfg.n_heads, cfg.n_kv_heads
    return [Term("linear inputs x", FP32 * (2 * D + h * hd + F), EVERY),
            Term("linear output gradients dy", FP32 * ((h + 2 * k) * hd + 2 * D + 2 * F), EVERY)]


def rope_tables_bytes(cfg, cp: int = 1, positions: int = 0) -> int:
    """cos and sin, (max_seq_len, hd/2) fp32 each: referenced by every micro-batch's saved tensors.
    Under context parallelism the attention rotates by its own rows of them, (S/cp, hd/2) each, gathered
    once and shared by every layer (chapter 06's ContextParallelAttention)."""
    return 2 * (cfg.max_seq_len if cp == 1 else positions) * (cfg.head_dim // 2) * FP32


def terms_bytes(terms, mode: str, rows: int, positions: int, shard_positions: int) -> int:
    return sum(t.bytes_per_position * rows * (shard_positions if t.sp_shard else positions)
               for t in terms if mode in t.kept)


def microbatch_bytes(cfg, mode: str, rows: int, positions: int, n_layers: int, first: bool = True,
                     last: bool = True, tp: int = 1, sequence_parallel: bool = False, cp: int = 1,
                     gathered_kv: bool = False, dtype: str = "fp32", weight_casts: bool = True,
                     recomputed: int | None = None) -> int:
    """Bytes one micro-batch of `rows` sequences keeps on a stage of `n_layers` blocks (plus the
    embedding if `first`, the head and loss if `last`), the first `recomputed` of them (--recompute-layers;
    None: all) in `mode`, the others in "none". `positions`: the positions of a sequence this
    rank computes (S; S/cp under context parallelism over `cp` ranks, whose all-gather attention keeps
    every rank's K/V if `gathered_kv`); the "(SP shard)" terms hold positions/tp of them under sequence
    parallelism."""
    shard = positions // tp if sequence_parallel else positions
    kv_copies = cp if gathered_kv else 1
    k = recomputed_of(n_layers, recomputed)
    terms = layer_terms(cfg, tp, kv_copies, dtype, sequence_parallel, cp)
    total = sum(count * terms_bytes(terms, m, rows, positions, shard) for count, m in ((k, mode), (n_layers - k, "none")))
    if dtype == "bf16" and weight_casts:
        total += bf16_weight_copies(cfg, k, mode, last, tp, sequence_parallel) + \
            bf16_weight_copies(cfg, n_layers - k, "none", False, tp, sequence_parallel)
    if first:
        total += terms_bytes(embedding_terms(cfg, tp), mode, rows, positions, shard)
    if last:       # (the vocab-parallel loss keeps no scalar: it saves its own three tensors)
        total += terms_bytes(head_terms(cfg, tp, dtype, sequence_parallel), mode, rows, positions, shard) + \
            (LOSS_SCALAR if tp == 1 else 0)
    if dtype == "bf16":          # each block keeps its own bf16 casts of the RoPE tables (a full one keeps none)
        return total + (n_layers - (k if mode == "full" else 0)) * bf16_rope_casts(cfg, positions)
    return total + (rope_tables_bytes(cfg, cp, positions) if n_layers else 0)


def ledger_applies(cfg, dtype: str) -> bool:
    """Where a run prints the ledger beside its meter: fp32 dense blocks (MoE layers keep routed rows; the
    bf16 terms, bf16_layer_terms, are checked against the meter by tests/test_bf16.py on one rank and a
    pipeline only, and the layout planner uses them)."""
    return dtype == "fp32" and not cfg.n_experts


def predicted_bytes(cfg, args, mb_rows: int, tp: int = 1, sequence_parallel: bool = False, cp: int = 1,
                    gathered_kv: bool = False) -> int | None:
    """The peak of a run without a pipeline (one micro-batch of `mb_rows` sequences alive at a time,
    the whole model on this rank, S/cp positions of each sequence); None where the ledger does not apply."""
    if not ledger_applies(cfg, args.dtype):
        return None
    return microbatch_bytes(cfg, args.recompute, mb_rows, args.seq_len // cp, cfg.n_layers, tp=tp,
                            sequence_parallel=sequence_parallel, cp=cp, gathered_kv=gathered_kv,
                            recomputed=args.recompute_layers)


def schedule_peak(actions, held: dict, deferred: dict) -> int:
    """The most bytes alive at once on a pipeline rank running `actions` (kind, mb, stage) in order,
    as the measurement counts them: F holds held[stage] until the micro-batch's last backward action
    on that stage (B, W or BW); a B that a W follows (zero bubble) keeps deferred[stage] until the W
    instead (on stage 0 it does nothing: no stage waits for a token's gradient). DualPipeV's Pair (kind
    "F+BW", a tuple of its two actions: 03_pipeline_parallel/pipeline_actions.py) counts as its F, then its BW."""
    actions = [u for a in actions for u in (a if a.kind == "F+BW" else (a,))]
    waits_for_w = {(a.mb, a.stage) for a in actions if a.kind == "W"}
    alive, live, peak = {}, 0, 0                  # live = sum(alive.values()), kept as it changes
    for a in actions:
        key = (a.mb, a.stage)
        if a.kind == "F":
            alive[key] = held[a.stage]
            live += alive[key]
        elif a.kind == "B" and key in waits_for_w:
            kept = deferred[a.stage] if a.stage else alive[key]
            live += kept - alive[key]
            alive[key] = kept
        else:
            live -= alive.pop(key)
        peak = max(peak, live)
    return peak


def pipeline_peaks(cfg, mode: str, plan, specs, rows: int, positions: int, tp: int = 1,
                   sequence_parallel: bool = False, cp: int = 1, gathered_kv: bool = False,
                   dtype: str = "fp32", weight_casts: bool = True, recomputed: int | None = None) -> list[int]:
    """Each pipeline rank's predicted peak: `plan` holds every rank's actions, `specs` every stage
    (.layers, .first, .last); a micro-batch has `rows` sequences of `positions` on this rank (S/cp
    under context parallelism: microbatch_bytes). `weight_casts` False leaves out the bf16 weight casts each
    micro-batch keeps (bf16_weight_copies), for a planner that counts one copy per rank instead; `recomputed`:
    the blocks of each stage in `mode` (--recompute-layers; None: all)."""
    kinds = {(len(s.layers), s.first, s.last) for s in specs}         # stages of the same shape keep the same
    of_kind = {k: microbatch_bytes(cfg, mode, rows, positions, *k, tp, sequence_parallel, cp, gathered_kv, dtype,
                                   weight_casts, recomputed) for k in kinds}
    held = {s.index: of_kind[(len(s.layers), s.first, s.last)] for s in specs}
    shard = positions // tp if sequence_parallel else positions
    per_layer = terms_bytes(deferred_terms(cfg, tp), mode, rows, positions, shard)
    head = FP32 * rows * positions * (cfg.dim + cfg.vocab_size) if tp == 1 else 0    # lm_head's x, dy
    deferred = {s.index: len(s.layers) * per_layer + (head if s.last else 0) for s in specs}
    return [schedule_peak(actions, held, deferred) for actions in plan]
