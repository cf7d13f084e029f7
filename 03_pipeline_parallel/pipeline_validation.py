"""Validation through a pipeline: the forward half only, every rank its stages in order.

Chapter 04's trainer calls it every --val-every steps. No backward, so no schedule: each rank runs its
stages micro-batch after micro-batch (GPipe's forward half), receiving from the stage before and
sending to the stage after, which may live on this same rank (a V, or interleaving).
"""
import torch

from common import comm

from . import pipeline_executor, pipeline_stages

@torch.no_grad()
def forward_only_loss_sum(model, my_specs, pp_rank: int, pp_ranks: list[int], group, inputs: list,
                          targets: list, loss_fn, act_shape, device, rank_of=None, wire=None):
    """Forward only, through the whole pipeline (validation): the summed loss of the micro-batches
    on the last stage, 0 elsewhere. No backward, so no schedule is needed: every rank runs its
    stages in order, micro-batch after micro-batch (GPipe's forward half). Receives block, sends do
    not, and both ends of every channel see the messages in the same order, so this cannot deadlock.
    rank_of[stage]: where each stage lives (default the loop, stage s on rank s % p; a V passes its own);
    wire: how a message travels (the executor's: pipeline_executor.Whole by default)."""
    p, wire = len(pp_ranks), wire or pipeline_executor.Whole()
    rank_of = rank_of or [s % p for s in range(max(s.index for s in my_specs) + 2)]
    total = torch.zeros((), device=device)
    local, sends = {}, []
    for spec in my_specs:                                   # increasing stage index
        for mb, (x, y) in enumerate(zip(inputs, targets)):
            if spec.first:
                inp = x                                     # (mb, S) tokens
            elif rank_of[spec.index - 1] == pp_rank:
                inp = local.pop((mb, spec.index))           # the previous stage lives on this rank too
            else:
                buf = torch.empty(wire.shape(act_shape), device=device)   # (mb, S, D), or (mb, S/tp, D) with SP
                comm.recv(buf, src=pp_ranks[rank_of[spec.index - 1]], group=group, name="pp").wait()
                inp = wire.unpack(buf, act_shape)
            out = pipeline_stages.stage_forward(model, spec, inp)
            if spec.last:
                total += loss_fn(out, y)
            elif rank_of[spec.index + 1] == pp_rank:
                local[(mb, spec.index + 1)] = out
            else:
                out = wire.pack(out)
                sends.append((out, comm.send(out, dst=pp_ranks[rank_of[spec.index + 1]], group=group, name="pp")))
    for _, work in sends:
        work.wait()
    return total
