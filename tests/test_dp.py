"""Chapter 01 data parallelism: every implementation reproduces the single-device run.

Each world size runs in one spawned group (see dp_jobs.py): the losses and gradient norms of 10 steps
and the gradients of step 1 of every implementation against world size 1, bucket timing on every
rank, and every bad input.
"""
import pytest

from dp_jobs import BAD_INPUT_MESSAGES, GRAD_VARIANTS, VARIANTS, reference, world_results
from harness import assert_same_run, every_rank, ok


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
