"""Chapter 02's --tp-overlap on a GPU: what of sequence parallelism's rings the chunk matmuls leave exposed.

Under --tp-overlap (02_tensor_parallel/tp_overlap.py) each all-gather and reduce-scatter of SP is a ring of
N − 1 hops (N = tp), each hop one chunk of the (rows, S/cp, D) activation, bytes/N of it, and the matmul it
feeds (or that feeds it) runs as N chunk matmuls, one under each hop. Per ring:

    exposed = (N − 1) · max(0, t_hop − t_chunk)
    t_hop   = one chunk's message on the TP tier (step_time.link_seconds: bytes/N sent and received, one message)
    t_chunk = the ring's matmul ÷ N (block_time's operation on the device file)

The rings of one block, forward and backward (tensor_parallel.tp_collectives counts the same collectives):

    forward    all-gather under q/k/v (and gate/up), reduce-scatter under wo (and down)
    backward   under q/k/v's (gate/up's) dX and dW chunks together: the shard re-gathered for dW and dX's
               partial sums, two messages a hop; under wo's (down's) dX and dW: the gradient's all-gather
    recompute  full recomputation reruns the forward's rings up to what backward needs (not down's)

A mixture of experts' MLP stays whole on every TP rank: only the attention's rings. The head is an entrance
(its all-gather forward, both rings backward, under the LM head's matmuls). What no ring decomposes stays
exposed as plain chapter 02 moves it: the embedding's reduce-scatter and its backward all-gather, the
vocab-parallel loss's all-reduces, the routers' counts, the gradient all-reduces of the norm gains.
"""
from importlib import import_module

from common.comm import collective_bytes
from common.recompute import recomputed_of

block_time = import_module("07_choosing_a_layout.block_time")              # this chapter: one block's operations
pipeline_stages = import_module("03_pipeline_parallel.pipeline_stages")     # chapter 03: each rank's stages
schedule_costs = import_module("07_choosing_a_layout.schedule_costs")      # this chapter: the stages


def ring_exposed(t_hop: float, matmul: float, n: int) -> float:
    """One ring of `n` ranks: its n − 1 hops, each under one chunk of `matmul` (seconds of the whole)."""
    return (n - 1) * max(0.0, t_hop - matmul / n)


def rings(forward: list, backward: list, names: tuple[str, ...], spec) -> dict:
    """{name: (forward matmul s, backward dX + dW s)} of the matmuls `names`, on device file `spec`."""
    fwd = {op.name: block_time.op_seconds(op, spec) for op in forward}
    bwd = {op.name: block_time.op_seconds(op, spec) for op in backward}
    return {n: (fwd[n], bwd[f"{n} input gradient"] + bwd[f"{n} weight gradient"]) for n in names}


def stage_rings(cfg, shape, spec, blocks: int, again: int, last: bool) -> list[tuple[int, float]]:
    """(collectives in the ring, seconds of the matmul under it) of every ring of one micro-batch through a
    stage of `blocks` blocks, `again` of them recomputed in full, the head if `last`."""
    fwd = block_time.block_forward(cfg, shape)
    dense = not cfg.n_experts                     # a mixture's MLP is whole on every TP rank: no ring
    entrances, exits = ("qkv",) + ("mlp up",) * dense, ("out",) + ("mlp down",) * dense
    mm = rings(fwd, block_time.block_backward(fwd), entrances + exits, spec)
    block = [(1, mm[n][0]) for n in entrances + exits] + [(2, mm[n][1]) for n in entrances] + \
            [(1, mm[n][1]) for n in exits]
    rerun = [(1, mm[n][0]) for n in entrances + ("out",)]        # the forward again, down's ring not
    out = blocks * block + again * rerun
    if last:
        head = block_time.head_forward(cfg, shape)[:-1]
        lm = rings(head, block_time.block_backward(head), ("lm head",), spec)["lm head"]
        out += [(1, lm[0]), (2, lm[1])]
    return out


def exposed_tp(run, c, dev, shape, plain: float, hop) -> float:
    """Rank 0's exposed TP seconds in a step under --tp-overlap: `plain` (its collectives unhidden) less
    its rings' plain seconds, plus what of each ring its chunks do not cover. `hop(nbytes, messages)`: the
    seconds of messages on the TP tier (step_time.link_seconds)."""
    n, act = c.tp, shape.tokens * run.cfg.dim * shape.e          # one (rows, S/cp, D) activation's bytes
    specs = schedule_costs.specs_for(run.cfg, c.pp, c.virtual_stages, run.seq_len, c.schedule)
    plain_rings = overlapped = 0.0
    for s in pipeline_stages.rank_stages(specs, c.pp, 0):
        again = recomputed_of(len(s.layers), c.recompute_layers) if c.recompute == "full" else 0
        for k, matmul in stage_rings(run.cfg, shape, dev.spec, len(s.layers), again, s.last):
            plain_rings += k * hop(collective_bytes("all_gather", act, n), 1)
            overlapped += ring_exposed(hop(k * 2 * act / n, k), matmul, n)
    return max(0.0, plain + c.microbatches * (overlapped - plain_rings))
