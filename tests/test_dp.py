"""Chapter 01 data parallelism: every implementation reproduces the single-device run.

Each world size runs in one spawned group (see dp_jobs.py): the losses and gradient norms of 4 steps
and the gradients of step 1 of every implementation against world size 1, bucket timing on every
rank, and every bad input. Single-process: the flat buffers that buckets and ZeRO's units share.
"""
from importlib import import_module

import pytest
import torch

from dp_jobs import BAD_INPUT_MESSAGES, GRAD_VARIANTS, VARIANTS, reference, world_results
from harness import assert_same_run, every_rank, ok

flat_buffers = import_module("01_data_parallel.flat_buffers")


@pytest.mark.parametrize("world", [2, 4])
def test_every_impl_reproduces_single_device_losses(world):
    ref = ok(reference()["losses"])
    res = world_results(world)
    for name in (n for n in VARIANTS if f"losses/{n}" in res):
        assert_same_run(res[f"losses/{name}"], ref, f"dp={world} {name}")


@pytest.mark.parametrize("world", [2, 4])
def test_every_impl_reproduces_single_device_gradients(world):
    """After one backward and the sync, every rank holds the single-device gradient of the whole batch."""
    res = world_results(world)
    for name in GRAD_VARIANTS:
        per_rank = res[f"grads/{name}"]
        for rank, (kind, value) in enumerate(per_rank):
            assert kind == "ok", f"{name} rank {rank}: {value}"
            # float32 sums in another order: differences are round-off, ~1e-7 of the largest entry
            assert value["max_abs_diff"] <= 1e-5 * value["max_abs_ref"], (name, rank, value)


def test_buckets_are_sent_during_backward():
    """With small buckets the first all-reduce starts while most gradients do not exist yet, on every rank."""
    for rank, value in enumerate(every_rank(world_results(2)["launches"])):
        log, n_params, n_buckets = value["launch_log"], value["n_params"], value["n_buckets"]
        assert n_buckets > 1 and len(log) == n_buckets, rank
        first_bucket, hooks_fired = log[0]
        assert first_bucket == 0 and hooks_fired < n_params / 4, (rank, log)
        assert [h for _, h in log] == sorted(h for _, h in log), (rank, log)


@pytest.mark.parametrize("kind", sorted(BAD_INPUT_MESSAGES))
def test_bad_input_fails_on_every_rank_with_one_message(kind):
    per_rank = world_results(2)[f"bad/{kind}"]
    messages = set()
    for rank, (status, message) in enumerate(per_rank):
        assert status == "config_error", f"rank {rank}: {status}: {message}"
        messages.add(message)
    assert len(messages) == 1, messages            # the same verdict everywhere
    assert BAD_INPUT_MESSAGES[kind] in messages.pop()


def test_groups_by_size_closes_each_group_at_the_size():
    """Buckets (and ZeRO's units without layers) are consecutive tensors closed as soon as they reach `mb`."""
    sizes = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]                                  # in units of 64 KiB
    named = [(f"t{i}", torch.zeros(n * 2**14)) for i, n in enumerate(sizes)]    # fp32: n × 64 KiB
    for mb in (0.25, 0.5, 1.0, 100.0):
        groups = flat_buffers.groups_by_size(named, mb)
        assert [pair for g in groups for pair in g] == named, mb             # every tensor once, in order
        for g in groups[:-1]:
            size = [t.numel() * 4 for _, t in g]
            assert sum(size) >= mb * 2**20 > sum(size[:-1]), (mb, size)      # closed by its last tensor
        assert sum(t.numel() * 4 for _, t in groups[-1]) > 0, mb


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_flat_layout_chunks_cover_every_element_once(world):
    """Tensors end to end, padded to a multiple of N: the ranks' chunks split every tensor into
    pieces that cover each of its elements exactly once, and the padding is zero."""
    tensors = [torch.arange(n, dtype=torch.float32).reshape(-1, 1) + 100 * i for i, n in enumerate([5, 1, 12, 3])]
    covered = [torch.zeros(t.numel()) for t in tensors]
    for rank in range(world):
        layout = flat_buffers.FlatLayout(tensors, world, rank, names=range(len(tensors)))
        assert layout.padded % world == 0 and 0 <= layout.padded - layout.numel < world
        flat = layout.flatten(tensors)                                     # (padded,)
        assert torch.equal(flat[layout.numel:], torch.zeros(layout.padded - layout.numel))
        assert all(torch.equal(v, t) for v, t in zip(layout.split(flat), tensors))
        mine = flat[layout.lo:layout.hi]                                   # (padded/N,)
        for i, a, b, ta, tb in layout.pieces():
            assert torch.equal(mine[a:b], tensors[i].reshape(-1)[ta:tb])
            covered[i][ta:tb] += 1
    assert all(torch.equal(c, torch.ones_like(c)) for c in covered)
