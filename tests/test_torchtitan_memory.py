"""07_choosing_a_layout/torchtitan_memory.py against measurement: what torchtitan's operator-level selective
checkpointing keeps of a Llama block, its loss's two moments, and a whole step of its recipe in miniature with
PyTorch's own FSDP2 on two ranks, each counted by common/live_memory.py's meter on this CPU; and that step's
allocation trace (allocation_trace.py), against the meter and against the same step traced on fake tensors.
The block is the course's (common/model.Block: the operators of torchtitan's Llama block in the same order)
with its weights in bf16, as FSDP2 computes; the policy and the step are torchtitan_step.py's, written from
torchtitan's definition (the outputs of every other matmul, the first on, and of the attention kernel), not
from the file the counts are checked in."""
import functools
from importlib import import_module

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from common.live_memory import LiveTensors, held_tensors
from common.model import Block, ModelConfig, rope_tables
from harness import ok, run_group

allocation_trace = import_module("07_choosing_a_layout.allocation_trace")
caching_allocator = import_module("07_choosing_a_layout.caching_allocator")
torchtitan_memory = import_module("07_choosing_a_layout.torchtitan_memory")
torchtitan_step = import_module("07_choosing_a_layout.torchtitan_step")

# grouped-query attention and an MLP width unlike any other, so that keeping the wrong matmul shows
CFG = ModelConfig(dim=128, n_layers=1, n_heads=8, n_kv_heads=2, ffn_hidden=448, max_seq_len=64, vocab_size=1000)
def kept_per_position(block, cos, sin, rows: int, seq: int, policy=None) -> tuple[float, torch.Tensor]:
    """Bytes a checkpointed block keeps after its forward, per position (its input included: the checkpoint
    holds it), and the input's gradient after the backward."""
    with LiveTensors(list(block.parameters()) + [cos, sin]) as live:
        torch.manual_seed(1)
        x = torch.randn(rows, seq, CFG.dim, dtype=torch.bfloat16, requires_grad=True)
        before = live.live - x.untyped_storage().nbytes()
        context = (lambda: create_selective_checkpoint_contexts(policy)) if policy else noop_context_fn
        y = checkpoint(block.body, x, cos, sin, use_reentrant=False, context_fn=context)
        kept = live.live - before - y.untyped_storage().nbytes()
        y.float().square().sum().backward()
    return kept / (rows * seq), x.grad


def test_the_op_policy_keeps_what_the_file_counts():
    torch.manual_seed(0)
    block = Block(CFG).to(torch.bfloat16)
    cos, sin = rope_tables(CFG)
    policy, matmuls = torchtitan_step.op_policy()
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


# the step's miniature: a vocabulary 16 times the width and 4 × 64 positions, so that, as in the published run,
# the loss's backward is the step's peak (not the gradients' reduction at its end)
STEP_CFG = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=224, max_seq_len=64, vocab_size=4000)
ROWS, SEQ = 4, 64


def fsdp2_step() -> tuple[int, list]:
    """A job: torchtitan's step in miniature (07_choosing_a_layout/torchtitan_step.py) on the course's model,
    two steps (the first makes AdamW's moments). Returns the second step's peak in bytes, everything the rank
    holds included, by the meter, and allocation_trace's events of both steps. FSDP2 frees a block's gathered
    weights by emptying their storage in place, which the meter reads again after each block's forward."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    model = torchtitan_step.sharded_model(STEP_CFG, init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    held = held_tensors(model)
    with LiveTensors(held) as live, allocation_trace.AllocationTrace(held) as trace:
        for block in model.layers:
            block.register_forward_hook(lambda *_: live.resync())
        for step in range(2):
            tokens = torch.randint(0, STEP_CFG.vocab_size, (ROWS, SEQ + 1), generator=generator)
            live.resync()
            live.reset()
            torchtitan_step.train_step(model, optimizer, tokens)
            live.resync()
            peak = live.reset()
    return peak, trace.events


@functools.cache
def miniature_step() -> tuple[int, list]:
    """fsdp2_step on two spawned ranks, once for the tests that read it: rank 0's (peak, events)."""
    return ok(run_group(2, [("test_torchtitan_memory:fsdp2_step",)])[0])


def test_a_step_of_torchtitan_s_recipe_peaks_where_the_file_says():
    """PyTorch's FSDP2 and selective checkpointing on two ranks: the step's peak within 1 % of
    torchtitan_memory.peak (measured: 0.4 % above it, the course's RMSNorm keeping its input's fp32 copy twice
    where the file counts it once)."""
    measured = miniature_step()[0]
    predicted = torchtitan_memory.peak(STEP_CFG, 2, ROWS, SEQ)["total"]
    assert abs(measured / predicted - 1) < 0.01, (measured, predicted)


def test_the_allocation_trace_counts_what_the_meter_counts():
    """allocation_trace.py's events of the same two steps: the bytes live at once at their most, the meter's
    peak to the byte (the second step's: AdamW's moments exist), and three streams."""
    peak, events = miniature_step()
    assert allocation_trace.live_peak(events) == peak
    # FSDP2's gathers on its all-gather stream, its reductions on its reduce-scatter stream, the rest on compute
    assert {e.stream for e in events} == {"compute", "stream 1", "stream 2"}


def test_a_fake_step_asks_what_a_real_one_asks():
    """The miniature traced on FakeTensorMode's tensors under a fake process group (torchtitan_step.fake_trace,
    what the published run is traced with): the real step's allocations, each of the same size on the same
    stream in the same order, the same frees, the same peak of live bytes, and the same bytes reserved by the
    allocator's model in both its modes. (Where the two free a tensor may move by an operator or so: fake
    tensors die when Python drops them, as real ones do, but not always in the same order.)"""
    _, events = miniature_step()
    fake = torchtitan_step.fake_trace(STEP_CFG, 2, ROWS, SEQ)
    assert [e for e in fake if e.kind == "alloc"] == [e for e in events if e.kind == "alloc"]
    assert sorted(fake) == sorted(events)
    assert allocation_trace.live_peak(fake) == allocation_trace.live_peak(events)
    for expandable in (False, True):
        assert caching_allocator.reserved_peak(fake, expandable) == caching_allocator.reserved_peak(events, expandable)
