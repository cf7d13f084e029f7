"""07_choosing_a_layout/torchtitan_memory.py against measurement: what torchtitan's operator-level selective
checkpointing keeps of a Llama block, and its loss's two moments, each counted by common/live_memory.py's meter
on this CPU. The block is the course's (common/model.Block: the operators of torchtitan's Llama block in the same
order) with its weights in bf16, as FSDP2 computes; the policy is written here from its definition (the outputs
of every other matmul, the first on, and of the attention kernel), not from the file it checks."""
from importlib import import_module

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from common.live_memory import LiveTensors
from common.model import Block, ModelConfig, rope_tables

torchtitan_memory = import_module("07_choosing_a_layout.torchtitan_memory")

# grouped-query attention and an MLP width unlike any other, so that keeping the wrong matmul shows
CFG = ModelConfig(dim=128, n_layers=1, n_heads=8, n_kv_heads=2, ffn_hidden=448, max_seq_len=64, vocab_size=1000)
ATTENTION_KERNEL = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default     # what SDPA runs on a CPU


def op_policy():
    """torchtitan's "op" policy: keep the output of every other matmul (the 1st, 3rd, ...) and of the attention
    kernel, recompute everything else. `matmuls` counts the forward's."""
    matmuls = []

    def policy(ctx, func, *args, **kwargs):
        if func is torch.ops.aten.mm.default:
            if not ctx.is_recompute:
                matmuls.append(func)
            return CheckpointPolicy.MUST_SAVE if len(matmuls) % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func is ATTENTION_KERNEL else CheckpointPolicy.PREFER_RECOMPUTE
    return policy, matmuls


def kept_per_position(block, cos, sin, rows: int, seq: int, policy=None) -> tuple[float, torch.Tensor]:
    """Bytes a checkpointed block keeps after its forward, per position (its input included: the checkpoint
    holds it), and the input's gradient after the backward."""
    with LiveTensors(list(block.parameters()) + [cos, sin]) as live:
        torch.manual_seed(1)
        x = torch.randn(rows, seq, CFG.dim, dtype=torch.bfloat16, requires_grad=True)
        before = live.live - x.untyped_storage().nbytes()
        context = (lambda: create_selective_checkpoint_contexts(policy)) if policy else None
        y = checkpoint(block.body, x, cos, sin, use_reentrant=False,
                       **({"context_fn": context} if context else {}))
        kept = live.live - before - y.untyped_storage().nbytes()
        y.float().square().sum().backward()
    return kept / (rows * seq), x.grad


def test_the_op_policy_keeps_what_the_file_counts():
    torch.manual_seed(0)
    block = Block(CFG).to(torch.bfloat16)
    cos, sin = rope_tables(CFG)
    policy, matmuls = op_policy()
    selective, grad = kept_per_position(block, cos, sin, 2, 64, policy)
    assert len(matmuls) == len(torchtitan_memory.MATMULS)          # the block's seven, counted by the policy
    assert selective == torchtitan_memory.block_bytes(CFG, "selective")
    full, grad_full = kept_per_position(block, cos, sin, 2, 64)
    assert full == torchtitan_memory.block_bytes(CFG, "full")
    assert torch.equal(grad, grad_full)                              # the recomputation rebuilt the same


def test_the_loss_holds_what_the_file_counts():
    """The bf16 logits cast to fp32 for cross-entropy: the forward's peak, then (the logits deleted) the
    backward's, each within a few scalars of the file's moments."""
    tokens, D = 256, 64
    h = torch.randn(tokens, D, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(CFG.vocab_size, D, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, CFG.vocab_size, (tokens,))
    moments = torchtitan_memory.loss_moments(CFG, tokens)
    with LiveTensors([h, w, targets]) as live:
        base = live.live
        logits = h @ w.t()                                           # (t, V) bf16, as the output layer makes them
        loss = F.cross_entropy(logits.float(), targets)
        forward = live.reset() - base
        del logits
        loss.backward()
        backward = live.reset() - base
    assert abs(forward - moments["forward"]) <= 64
    assert abs(backward - moments["backward"]) <= 64


def test_the_published_run_is_the_sum_of_its_parts():
    """Llama 3.1 8B on 8 ranks, 2 × 8K positions each: every part named, the total their sum, the loss the
    largest transient (3 fp32 [t, V])."""
    cfg = import_module("07_choosing_a_layout.layout_inputs").model_for("llama3-8b")
    parts = torchtitan_memory.peak(cfg, 8, 2, 8192)
    total = parts.pop("total")
    assert total == sum(parts.values())
    assert parts["loss"] == 3 * 4 * 2 * 8192 * cfg.vocab_size
    assert parts["activations"] == 2 * 8192 * (32 * torchtitan_memory.block_bytes(cfg) + torchtitan_memory.head_bytes(cfg))
