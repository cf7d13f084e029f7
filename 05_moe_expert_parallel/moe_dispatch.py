"""The all-to-all that carries tokens to their experts and back, as autograd operators.

With experts split over the EP group (rank j holds experts [j·E/ep, (j+1)·E/ep)), each rank has rows
(tokens) for every expert and experts for rows of every rank. Dispatch is two exchanges:

  1. the counts: rank s tells rank j how many rows it has for each of j's experts (E/ep integers per
     pair). Now every rank knows how many rows it will receive, from whom, for which expert.
  2. the rows: `all_to_all_single` with uneven split sizes. Rank s's rows, sorted by expert, are
     already sorted by destination rank (experts are numbered rank by rank), so input_splits[j] is the
     number of s's rows for j's experts, output_splits[s] the number j receives from s.

A list of unequal tensors (`dist.all_to_all`) fails on gloo; one flat tensor with split sizes works
on gloo and NCCL alike. The exchange is a permutation of rows between ranks, so its gradient is the
reverse permutation: backward is the same all-to-all with the split sizes swapped.

Volume: each rank sends the rows of its kept slots whose expert lives elsewhere, D floats each, and
receives as many; (ep-1)/ep of them when routing ignores where a token is. A forward has two exchanges
(dispatch, combine), a backward two more.
"""
import torch

from common import comm


class AllToAll(torch.autograd.Function):
    """Forward: send input_splits[r] rows to rank r, receive output_splits[r] rows from it.
    Backward: the gradients of the received rows go back to where the rows came from."""

    @staticmethod
    def forward(ctx, rows, output_splits: list, input_splits: list, group):
        # >>> exercise 05.all_to_all
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))          # (M, D)
        comm.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group, name="ep")
        return out
        # <<< exercise 05.all_to_all

    @staticmethod
    def backward(ctx, grad_out):
        # >>> exercise 05.all_to_all
        output_splits, input_splits = ctx.splits
        grad_in = grad_out.new_empty((sum(input_splits), *grad_out.shape[1:]))   # (N, D)
        comm.all_to_all_single(grad_in, grad_out.contiguous(), input_splits, output_splits, group=ctx.group,
                               name="ep")
        return grad_in, None, None, None
        # <<< exercise 05.all_to_all


def all_to_all(rows, output_splits: list, input_splits: list, group):
    """(N, D) rows out by input_splits, (sum(output_splits), D) rows in; differentiable."""
    return AllToAll.apply(rows, output_splits, input_splits, group)


def exchange_counts(counts, ep: int, group):
    """counts: (E,) rows this rank has for each expert. Returns (ep, E/ep): row s = the rows rank s
    will send me for each of my experts (every rank sends E/ep integers to every rank)."""
    # >>> exercise 05.counts_first
    send = counts.view(ep, -1).contiguous()                                  # (ep, E/ep): row j for rank j
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, [1] * ep, [1] * ep, group=group, name="ep")
    return recv
    # <<< exercise 05.counts_first


def expert_major(recv_counts):
    """Rows arrive grouped by source rank, then by expert: [s0: e0 e1 ..][s1: e0 e1 ..]. Each local expert
    wants its rows contiguous: [e0: s0 s1 ..][e1: s0 s1 ..]. Returns the index that reorders them
    (received[index] is expert-major) and the rows per local expert. recv_counts: (ep, E/ep)."""
    ep, n_local = recv_counts.shape
    starts = (recv_counts.flatten().cumsum(0) - recv_counts.flatten()).view(ep, n_local)   # (ep, E/ep)
    index = [torch.arange(starts[s, e], starts[s, e] + recv_counts[s, e])
             for e in range(n_local) for s in range(ep)]
    index = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)
    return index.to(recv_counts.device), recv_counts.sum(dim=0).tolist()
