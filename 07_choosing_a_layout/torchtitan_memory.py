"""What torchtitan's code holds at the peak of a step, counted the ledger's way: the published memory row
(`torchtitan-llama3-8b`: Llama 3.1 8B under FSDP on 8 GPUs, two sequences of 8K in one micro-batch, selective
activation checkpointing, 82.4 GiB per GPU) against a prediction of the code that ran it.

The planner predicts the course's code: for that run 148.6 GiB (§6 of the README: autocast keeps a bf16 cast of
every weight for the backward, and the course's selective recomputation keeps every matmul's input). torchtitan's
code keeps less in three places, each counted here from what the code does:

  state        FSDP2 (fully_shard on each block and on the root) computing in bf16 weights, reducing in fp32:
               the fp32 master weights and AdamW's two moments, sharded over the N ranks; the gradients are set
               to None as the step starts, so at the loss they do not exist yet. Each block's bf16 weights are
               gathered for its forward and freed after it, except two sets that stay gathered: the last
               block's (its backward comes first; torchtitan does not reshard it) and the root's (embedding,
               final norm, output layer: fully_shard leaves the root unsharded after forward).
  activations  torchtitan's default selective checkpointing, by operator ("op"): a block keeps its input and the
               outputs of the operators on its save list, every other matmul (the 1st, 3rd, 5th and 7th of wq,
               wk, wv, wo, gate, up, down) and the attention kernel (its output and fp32 log-sum-exp), and
               recomputes the rest in backward. All bf16: without autocast the residual stream is bf16 too. The
               head keeps its final norm's fp32 input and rms, the norm's bf16 output and the output layer's
               bf16 input.
  the loss     cross-entropy of the bf16 logits cast to fp32: in the forward the bf16 logits, their fp32 copy
               and the fp32 log-softmax it keeps, 2.5 fp32 [t, V] at once; the logits are deleted before the
               backward, whose first operation holds the log-softmax, its gradient and its input's: 3.

The peak is the loss's backward (a block's backward holds the logits' gradient in bf16 and one block's
recomputation: far less than the loss's 3 fp32 [t, V]). tests/test_torchtitan_memory.py measures it on this CPU
with common/live_memory.py's meter: the block and the loss to the byte (the policy run by torch.utils.checkpoint
on the course's Block in bf16, whose operators are torchtitan's Llama block's in the same order), and a whole step
of the recipe in miniature, PyTorch's own FSDP2 on two ranks, within 0.4 % of peak() (the course's RMSNorm
keeps its input's fp32 copy twice where this file counts it once).

What this count leaves out is the allocator: the published number is the most the CUDA caching allocator
reserved, the tensors' peak plus what it kept cached around them (blocks split and freed between tensors of
8 GiB and of a few MiB). `reserved` gives that too: torchtitan's step itself (torchtitan_step.py, the course's
model under PyTorch's FSDP2 and the op policy) traced on fake tensors at the run's shapes
(allocation_trace.py), then handed to a model of the allocator (caching_allocator.py).
"""
import math
from importlib import import_module

from common.model import count_parameters, parameter_shapes

allocation_trace = import_module("07_choosing_a_layout.allocation_trace")  # this chapter: a step's allocations
caching_allocator = import_module("07_choosing_a_layout.caching_allocator")  # this chapter: what a GPU reserves
layout_inputs = import_module("07_choosing_a_layout.layout_inputs")        # this chapter: models and devices
torchtitan_step = import_module("07_choosing_a_layout.torchtitan_step")    # this chapter: torchtitan's step

FP32, BF16 = 4, 2
MATMULS = ("wq", "wk", "wv", "wo", "gate", "up", "down")     # a Llama block's matmuls, in the order they run
SAVED = MATMULS[0::2]                                        # the op policy keeps every other one's output, the first on


def matmul_widths(cfg) -> dict:
    """Each matmul's output width (elements per position)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return dict(zip(MATMULS, (q, kv, kv, cfg.dim, cfg.ffn_hidden, cfg.ffn_hidden, cfg.dim)))


def block_bytes(cfg, mode: str = "selective") -> int:
    """Bytes one block keeps per position: its bf16 input, and under "selective" (the op policy) the bf16 outputs
    of the saved matmuls and of the attention kernel, with the kernel's fp32 log-sum-exp (one per head)."""
    kept = BF16 * cfg.dim
    if mode == "selective":
        widths = matmul_widths(cfg)
        kept += BF16 * (sum(widths[m] for m in SAVED) + cfg.n_heads * cfg.head_dim) + FP32 * cfg.n_heads
    return kept


def head_bytes(cfg) -> int:
    """Per position: the final norm's fp32 input and rms, its bf16 output, and the output layer's bf16 input."""
    return FP32 * (cfg.dim + 1) + 2 * BF16 * cfg.dim


def loss_moments(cfg, tokens: int) -> dict:
    """The loss's bytes at its forward (bf16 logits, their fp32 copy, the fp32 log-softmax) and at the first
    operation of its backward (the log-softmax, its gradient, its input's gradient)."""
    logits = FP32 * tokens * cfg.vocab_size
    return {"forward": 2.5 * logits, "backward": 3 * logits}


def peak(cfg, world: int, rows: int, seq_len: int, mode: str = "selective") -> dict:
    """One rank's bytes by component at the loss's backward, for `rows` sequences of `seq_len` in one
    micro-batch on each of `world` FSDP ranks, and the total."""
    n, t = count_parameters(cfg), rows * seq_len
    block = sum(math.prod(shape) for shape in parameter_shapes(cfg)["block"].values())
    parts = {"master weights (fp32, 1/N)": FP32 * n / world,
             "AdamW moments (fp32, 1/N)": 2 * FP32 * n / world,
             "root and last block gathered (bf16)": BF16 * (2 * cfg.vocab_size * cfg.dim + cfg.dim + block),
             "activations": t * (cfg.n_layers * block_bytes(cfg, mode) + head_bytes(cfg)),
             "loss": loss_moments(cfg, t)["backward"]}
    return {**parts, "total": sum(parts.values())}


def reserved(cfg, world: int, rows: int, seq_len: int) -> dict:
    """torchtitan's step run on fake tensors at these shapes (two steps: the second has AdamW's moments) and
    what the caching allocator would hold for it: {"tensors": the live bytes at their most, "segments": the
    allocator's reserve by default, "expandable": with expandable_segments:True, as torchtitan launches}."""
    events = torchtitan_step.fake_trace(cfg, world, rows, seq_len)
    return {"tensors": allocation_trace.live_peak(events),
            "segments": caching_allocator.reserved_peak(events, expandable=False),
            "expandable": caching_allocator.reserved_peak(events, expandable=True)}


def of_args(args, counted=peak) -> dict:
    """`counted` (peak, or reserved) for the planner's flags of a run that FSDP spreads over every rank
    (choose_layout.parse_args): each rank one micro-batch of its share of the global batch."""
    cfg = layout_inputs.model_for(args.model)
    return counted(cfg, args.world, args.global_batch // args.world, args.seq_len)
