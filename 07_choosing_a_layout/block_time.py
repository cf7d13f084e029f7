"""One block's work on one GPU rank, operation by operation, and how long each takes on a device file.

A micro-batch of `rows` sequences reaches a rank as t = rows · S/cp tokens (its share of the sequence
under CP). Under TP the rank holds H/tp query heads, its KV heads and F/tp of the MLP; under sequence
parallelism (SP) the norms and residuals outside them run on t/tp tokens. Per block, forward:

    matmul   qkv        2 · t · D · (H/tp + 2·K_rank) · hd
             scores     2 · t · S · hd · H/tp · ½           QKᵀ; causal: flash attention skips the masked half
             values     2 · t · S · hd · H/tp · ½           P·V
             out        2 · t · (H/tp) · hd · D
             mlp up     SwiGLU: 2 · t · D · 2F/tp (gate and up as one); GELU: 2 · t · D · F/tp
             mlp down   2 · t · F/tp · D
             (experts: E/ep experts each with t·k·ep/E tokens, gate+up and down, plus the router 2·t·D·E)
    memory   norm ×2    read + write t_sp · D                t_sp = t/tp under SP, else t
             residual ×2  two reads + one write of t_sp · D
             rope       read + write of q and k
             activation SwiGLU: gate and up read, one written (t · F/tp ×3); GELU: ×2

Attention is assumed fused on a GPU (flash attention): the softmax never goes to memory, and its
backward recomputes the scores inside the kernel (5 products against the forward's 2: 2.5×). Every other
matmul's backward is two matmuls of the forward's size (the input's and the weight's gradient); a
memory-bound operation's backward moves twice its forward's bytes (the gradient in, its input, the
gradient out). Each matmul runs at the share of the peak its own size gets (device_files.py), each
memory-bound operation at the HBM bandwidth its size gets. Dropout is modelled where a GPT has it
(Llama has none): inside unfused attention (`--attention unfused`), and with a model's `dropout` before each
residual add (a one-byte mask). A model with `bias` (a GPT) adds a bias to every matmul, whose gradient sums
the output's gradient over the tokens: each weight gradient reads it once more.

Recomputation adds exactly the operations it reruns in backward: `selective` the norms and the
activation (the course's selective mode, common/recompute.py); `full` the whole forward up to the last
tensor backward needs, i.e. all of it but the MLP's down projection and the last residual add (as
common/mfu.recompute_flops_per_token counts it: PyTorch's non-reentrant checkpoint stops there); with
`--full-recompute whole-block` the whole forward, down projection and residual too, as Megatron-LM's
`--recompute-granularity full` reruns a block (a checkpoint that does not stop early).

The head (last stage): the final norm, the LM head's matmul 2 · t · D · V/tp, and the vocab-parallel
cross-entropy over fp32 logits as memory traffic (read the logits, write their softmax and gradient);
the embedding (first stage) a lookup of t·D and its scatter-add in backward.
"""
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Op:
    name: str
    engine: str                # "matrix" (tensor cores), "flash" (the fused attention kernel) or "vector"
    flops: float
    nbytes: float              # read + written in HBM
    times: int = 1             # identical operations (experts)
    weights: float = 0         # a matmul's weight elements: its backward accumulates their fp32 gradient
    e: int = 2                 # bytes per element of its operands
    bias: float = 0            # a biased matmul's output elements its bias gradient sums (read again in backward)


@dataclass(frozen=True)
class Shape:
    """What one rank computes of one micro-batch: tokens, the sequence they attend over, the split."""
    tokens: int                # t = rows · S/cp
    seq_len: int               # S: the keys a query can see (the whole sequence, also under CP's ring)
    tp: int
    sp: bool
    ep: int
    e: int                     # bytes per element of activations
    attention: str = "flash"   # "flash": fused, causal half skipped; "unfused": scores and softmax in memory


def matmul(name: str, m: float, k: float, n: float, e: int, times: int = 1, bias: float = 0) -> Op:
    """(m, k) @ (k, n): 2mkn FLOPs, its two inputs read and its output written; `bias`: the output elements
    its bias is added to (a GPT's), whose gradient backward sums."""
    return Op(name, "matrix", 2 * m * k * n, (m * k + k * n + m * n) * e, times, k * n, e, bias)


def elementwise(name: str, elements: float, reads: int, writes: int, flops_each: float, e: int,
                times: int = 1) -> Op:
    return Op(name, "vector", flops_each * elements, (reads + writes) * elements * e, times)


def attention(cfg, s: Shape, t: int, heads: int, kv: int) -> list[Op]:
    """QKᵀ, the softmax and P·V of one block: fused (flash: the causal half skipped, the scores never in
    memory, q, k, v read and the output written once) or unfused (the whole square computed, the scores
    written, softmaxed in memory and read again, as Megatron-LM's fused scale-mask-softmax kernel does)."""
    hd, S, e = cfg.head_dim, s.seq_len, s.e
    if s.attention == "flash":
        qkvo = (2 * t * heads + 2 * S * kv) * hd * e
        return [Op("scores", "flash", 2 * t * S * hd * heads / 2, qkvo / 2),
                Op("values", "flash", 2 * t * S * hd * heads / 2, qkvo / 2)]
    square = t * S * heads                                           # one (heads, t, S) tensor's elements
    return [Op("scores", "matrix", 2 * square * hd, (t * heads + S * kv) * hd * e + square * e),
            elementwise("softmax", square, 1, 1, 5, e),
            Op("attention dropout", "vector", 2 * square, square * (2 * e + 1)),     # its one-byte mask written
            Op("values", "matrix", 2 * square * hd, square * e + (S * kv + t * heads) * hd * e)]


def block_forward(cfg, s: Shape) -> list[Op]:
    """One block's forward on one rank, as operations (the module docstring's table)."""
    t, D, hd, tp, e = s.tokens, cfg.dim, cfg.head_dim, s.tp, s.e
    heads, kv = cfg.n_heads // tp, cfg.kv_heads_per_rank(tp)
    t_sp = t // tp if s.sp else t
    biased = gpt_piece(cfg, "bias")         # a GPT's biases: a row-parallel one added after the reduction (t_sp)
    ops = [elementwise("norm 1", t_sp * D, 1, 1, 5, e),
           matmul("qkv", t, D, (heads + 2 * kv) * hd, e, bias=biased * t * (heads + 2 * kv) * hd),
           elementwise("rope", t * (heads + kv) * hd, 1, 1, 3, e),
           *attention(cfg, s, t, heads, kv),
           matmul("out", t, heads * hd, D, e, bias=biased * t_sp * D),
           residual("residual 1", cfg, t_sp * D, e),
           elementwise("norm 2", t_sp * D, 1, 1, 5, e)]
    if cfg.n_experts:
        per_expert = t * cfg.top_k * s.ep / cfg.n_experts          # tokens one expert gets, balanced routing
        local, F = cfg.n_experts // s.ep, cfg.expert_hidden
        ops += [matmul("router", t, D, cfg.n_experts, e),
                matmul("mlp up", per_expert, D, 2 * F, e, local),
                elementwise("activation", per_expert * F, 2, 1, 6, e, local),
                matmul("mlp down", per_expert, F, D, e, local)]
    else:
        gelu = mlp_kind(cfg) == "gelu"
        F = (cfg.gelu_hidden if gelu else cfg.ffn_hidden) // tp     # a GELU MLP's own width (model_files.py)
        ops += [matmul("mlp up", t, D, (1 if gelu else 2) * F, e, bias=biased * t * (1 if gelu else 2) * F),
                elementwise("activation", t * F, 1 if gelu else 2, 1, 8 if gelu else 6, e),
                matmul("mlp down", t, F, D, e, bias=biased * t_sp * D)]
    return ops + [residual("residual 2", cfg, t_sp * D, e)]


def residual(name: str, cfg, elements: float, e: int) -> Op:
    """A residual add (two reads, one write); with a GPT's dropout before it (Megatron-LM's fused
    bias-dropout-add) its one-byte mask written too (read again in backward: twice the bytes)."""
    op = elementwise(name, elements, 2, 1, 1, e)
    return replace(op, nbytes=op.nbytes + elements) if gpt_piece(cfg, "dropout") else op


def mlp_kind(cfg) -> str:
    """"swiglu" (the course's model) or "gelu" (a GPT two-matrix MLP: model_files.PlannedModel)."""
    return getattr(cfg, "mlp", "swiglu")


def gpt_piece(cfg, name: str) -> bool:
    """Whether a model has a GPT's `bias`, `dropout` or `tied_embeddings` (model_files.PlannedModel's fields;
    the course's ModelConfig has none of them)."""
    return getattr(cfg, name, False)


ATTENTION = ("scores", "softmax", "attention dropout", "values")
SELECTIVE = ("norm 1", "norm 2", "activation")           # what --recompute selective reruns (flash attention)
NOT_RERUN = ("mlp down", "residual 2")                   # what --recompute full stops before


def block_backward(forward: list[Op]) -> list[Op]:
    """The backward of `forward`: two matmuls of each matmul's size, the input's gradient and the weight's (which
    reads and writes the fp32 gradient it accumulates into, as mixed precision keeps it, instead of reading
    the weight); flash attention's five products for its forward's two (the scores again, then dV, dP, dQ,
    dK); twice each memory-bound operation's bytes."""
    out = [replace(op, name=op.name + " backward", times=2 * op.times) for op in forward if not op.weights]
    for op in (op for op in forward if op.weights):     # the input's gradient, then the weight's, added in fp32
        out += [replace(op, name=op.name + " input gradient"),      # (and a bias's: its output's gradient again)
                replace(op, name=op.name + " weight gradient",
                        nbytes=op.nbytes + op.weights * (2 * 4 - op.e) + op.bias * op.e)]
    flash = not any(op.name == "softmax" for op in forward)
    return out + [replace(op, name="scores recomputed") for op in forward if op.name == "scores" and flash]


def rerun(forward: list[Op], mode: str) -> list[Op]:
    """The forward operations recomputation runs again in backward."""
    if mode == "selective":       # unfused, the attention core too: Megatron-LM's selective recomputation
        unfused = any(op.name == "softmax" for op in forward)
        return [op for op in forward if op.name in SELECTIVE or unfused and op.name in ATTENTION]
    if mode == "full":
        return [op for op in forward if op.name not in NOT_RERUN]
    if mode == "whole-block":     # --full-recompute whole-block: Megatron-LM reruns the block's whole forward
        return list(forward)
    return []


def head_forward(cfg, s: Shape) -> list[Op]:
    """The last stage's final norm, LM head (vocab-parallel over TP) and cross-entropy over fp32 logits: read
    the logits, write their softmax and its gradient (its backward is in its forward)."""
    t, D, V = s.tokens, cfg.dim, cfg.vocab_size // s.tp
    t_sp = t // s.tp if s.sp else t
    return [elementwise("final norm", t_sp * D, 1, 1, 5, s.e), matmul("lm head", t, D, V, s.e),
            elementwise("loss", t * V, 1, 2, 5, 4)]


def embed_forward(cfg, s: Shape) -> list[Op]:
    return [elementwise("embedding", s.tokens * cfg.dim, 1, 1, 0, s.e)]


def op_seconds(op: Op, dev) -> float:
    """One operation on device file `dev`: its arithmetic at its size's share of its engine's peak, its
    bytes at their size's share of the HBM bandwidth, added (the file's `no_overlap`) or the larger."""
    return op.times * dev.op_seconds(op.engine, op.flops, op.nbytes)


def seconds(ops: list[Op], dev, split: bool = False):
    """Time of `ops` on device file `dev`. `split`: (tensor-core operations' seconds, the others')."""
    matrix = sum(op_seconds(op, dev) for op in ops if op.engine != "vector")
    vector = sum(op_seconds(op, dev) for op in ops if op.engine == "vector")
    return (matrix, vector) if split else matrix + vector


def microbatch_passes(cfg, s: Shape, blocks: int, recomputed: int, mode: str, first: bool,
                      last: bool) -> tuple[list[Op], list[Op], list[Op]]:
    """One micro-batch through `blocks` blocks on one rank, `recomputed` of them rerunning their forward
    (`mode`), with the embedding and the head where they live, as a pipeline schedule's three passes: the
    forward F, the input gradient B (what recomputation reruns among it) and the weight gradient W."""
    fwd = block_forward(cfg, s)
    forward, backward = blocks * fwd, blocks * block_backward(fwd) + recomputed * rerun(fwd, mode)
    if first:
        forward, backward = forward + embed_forward(cfg, s), backward + block_backward(embed_forward(cfg, s))
    if last:                        # the loss's forward writes its gradient too: no backward of its own
        head = head_forward(cfg, s)
        forward, backward = forward + head, backward + block_backward(head[:-1])
    weight = [op.name.endswith("weight gradient") for op in backward]
    return forward, [op for op, w in zip(backward, weight) if not w], [op for op, w in zip(backward, weight) if w]


def microbatch_ops(cfg, s: Shape, blocks: int, recomputed: int, mode: str, first: bool, last: bool) -> list[Op]:
    """Every operation of one micro-batch's forward and backward (microbatch_passes, all three)."""
    return [op for ops in microbatch_passes(cfg, s, blocks, recomputed, mode, first, last) for op in ops]


def attention_seconds(cfg, s: Shape, dev, blocks: int) -> float:
    """The attention products of `blocks` blocks, forward and backward: what CP's ring hops hide behind."""
    fwd = [op for op in block_forward(cfg, s) if op.name in ATTENTION]
    return blocks * seconds(fwd + block_backward(fwd), dev)
