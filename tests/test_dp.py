"""Chapter 01 data parallelism: every implementation reproduces the single-device run."""
import pytest

from harness import losses, max_rel_diff, ok, run_group

STEPS = 10
BASE = ["--steps", str(STEPS), "--seq-len", "32", "--global-batch", "8", "--quiet"]
IMPLS = ["naive", "bucketed", "torch"]


@pytest.fixture(scope="module")
def reference():
    (res,) = run_group(1, [("01_data_parallel.train_dp:main", BASE)])
    return losses(ok(res))


@pytest.mark.parametrize("world", [2, 4])
def test_every_impl_matches_single_device(reference, world):
    jobs = [("01_data_parallel.train_dp:main", BASE + ["--impl", impl]) for impl in IMPLS]
    jobs += [("01_data_parallel.train_dp:main", BASE + ["--impl", "bucketed", "--microbatches", "2",
                                                       "--bucket-mb", "0.5"])]
    results = run_group(world, jobs)
    for impl, res in zip(IMPLS + ["bucketed+accumulation"], results):
        assert max_rel_diff(losses(ok(res)), reference) <= 1e-5, impl
