"""Jobs for the chapter 01 data-parallel tests, and the one spawned group per world size that runs them.

test_dp.py reads each world's group from several tests; `world_results` runs each world's group once per
pytest session (starting ranks costs seconds on a 2-core machine).
"""
import functools
import os
import tempfile
from importlib import import_module
from pathlib import Path

import torch

from harness import run_group

TRAIN = "01_data_parallel.train_dp:main"
IMPLS = ["naive", "bucketed", "torch"]
STEPS = 4           # steps 2..4 use AdamW's moments
BASE = ["--steps", str(STEPS), "--seq-len", "32", "--global-batch", "8", "--quiet"]
VARIANTS = {impl: BASE + ["--impl", impl] for impl in IMPLS}
VARIANTS["bucketed+accumulation"] = BASE + ["--impl", "bucketed", "--microbatches", "2", "--bucket-mb", "0.5"]
GRAD_ARGS = ["--seq-len", "32", "--global-batch", "8", "--quiet"]
GRAD_VARIANTS = {"naive": ["--impl", "naive"], "bucketed": ["--impl", "bucketed", "--bucket-mb", "0.5"],
                 "torch": ["--impl", "torch", "--bucket-mb", "0.5"],
                 "bucketed+accumulation": ["--impl", "bucketed", "--bucket-mb", "0.5", "--microbatches", "2"]}
# The run that test_dp_cli.py kills and resumes under torchrun, and runs uninterrupted on 2 spawned ranks.
RESUME_ARGS = ["--steps", "10", "--checkpoint-every", "4", "--quiet"]


# --- jobs (run on every rank) ------------------------------------------------------------------------

def gradients_after_one_step(argv: list, reference_path: str | None = None):
    """One forward/backward of step 1 with the chosen DP implementation, then the gradient sync.

    Returns the flattened gradient (world size 1), or, given the reference file, the largest absolute
    difference from it and the reference's largest magnitude (so the result stays a few bytes).
    """
    train_dp = import_module("01_data_parallel.train_dp")
    from common.data import TextData, shard_rows
    from common.distributed import init_distributed, shutdown
    from common.model import PRESETS, build_model

    args = train_dp.parse_args(argv)
    rt = init_distributed("cpu")
    rank, world = rt.rank, rt.world_size
    model = build_model(PRESETS[args.model], args.seed)
    trainer = train_dp.build_trainer(args, model, torch.distributed.group.WORLD)
    x, y = TextData(args.data, args.seq_len, args.seed).global_batch(1, args.global_batch)
    x, y = shard_rows(x, rank, world), shard_rows(y, rank, world)
    for mb in range(args.microbatches):
        xm, ym = shard_rows(x, mb, args.microbatches), shard_rows(y, mb, args.microbatches)
        trainer.forward_backward(xm, ym, sync=mb == args.microbatches - 1)
    trainer.sync_gradients()
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    shutdown(rt)
    if reference_path is None:
        return flat.numpy()      # numpy pickles by value; a tensor would be shared through its sender
    ref = torch.load(reference_path)
    return {"max_abs_diff": (flat - ref).abs().max().item(), "max_abs_ref": ref.abs().max().item()}


def bucket_launches(bucket_mb: float) -> dict:
    """One backward with small buckets: when did each bucket's all-reduce start?"""
    data_parallel = import_module("01_data_parallel.data_parallel")
    from common.model import PRESETS, build_model, loss_sum
    model = build_model(PRESETS["tiny"], 1)
    wrapped = data_parallel.BucketedDataParallel(model, torch.distributed.group.WORLD, bucket_mb)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    loss_sum(wrapped(tokens), tokens).backward()
    wrapped.sync_gradients()
    return {"launch_log": list(wrapped.launch_log), "n_params": len(list(model.parameters())),
            "n_buckets": len(wrapped.buckets)}


# --- inputs for the bad-input jobs -------------------------------------------------------------------

def make_bad_inputs(directory: Path) -> dict:
    """A tiny-model checkpoint (written here, by one process, before any rank starts) and a corrupt one."""
    from common import checkpoint
    from common.model import PRESETS, build_model
    from common.training import run_identity
    train_dp = import_module("01_data_parallel.train_dp")
    args = train_dp.parse_args(["--quiet"])
    good, corrupt = directory / "tiny_ckpt", directory / "corrupt_ckpt"
    checkpoint.save(good, 1, build_model(PRESETS["tiny"], args.seed).state_dict(), {}, run_identity(args))
    corrupt.mkdir()
    (corrupt / "step_000004.pt").write_bytes(b"\x00not a checkpoint" * 64)
    (corrupt / "latest").write_text("step_000004.pt")
    dangling = directory / "dangling_ckpt"          # its pointer names a file that is gone
    dangling.mkdir()
    (dangling / "latest").write_text("step_000009.pt")
    return {
        "batch": ["--global-batch", "7"],
        "preset": ["--model", "nosuch"],
        "data": ["--data", str(directory / "missing.txt")],
        "corrupt": ["--resume", "--checkpoint-dir", str(corrupt)],
        "other_model": ["--model", "small", "--resume", "--checkpoint-dir", str(good)],
        "resume_no_dir": ["--resume"],
        "dangling": ["--resume", "--checkpoint-dir", str(dangling)],
    }


# What each bad input's message must contain (it names the problem and the fix).
BAD_INPUT_MESSAGES = {
    "batch": "use a multiple of",
    "preset": "--model nosuch: unknown preset",
    "data": "does not exist",
    "corrupt": "corrupt or unreadable",
    "other_model": "saved with model='tiny' but this run has model='small'",
    "resume_no_dir": "--resume needs --checkpoint-dir",
    "dangling": "names 'step_000009.pt', which is missing; restore it or remove --resume",
}


# --- one spawned group per world size, shared by the test files --------------------------------------

def scratch(prefix: str) -> Path:
    """A temporary folder for this test worker's shared groups (cached for every test file the worker runs, so no
    one test's tmp_path outlives them all): in the worker's own TMPDIR, removed when it exits (tests/conftest.py)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=os.environ["TMPDIR"]))


@functools.lru_cache(maxsize=None)
def reference() -> dict:
    """World size 1, spawned once: losses of the base run and step-1 gradients (saved to a file)."""
    tmp = scratch("dp_ref_")
    res = run_group(1, [(TRAIN, BASE), ("dp_jobs:gradients_after_one_step", GRAD_ARGS)])
    kind, flat = res[1][0]
    assert kind == "ok", flat
    torch.save(torch.from_numpy(flat), tmp / "grads.pt")
    return {"losses": res[0], "grads_path": str(tmp / "grads.pt")}


@functools.lru_cache(maxsize=None)
def world_results(world: int) -> dict:
    """Every check of chapter 01 DP at this world size, in one spawned group: {check name: per-rank results}."""
    ref = reference()
    tmp = scratch(f"dp_w{world}_")
    jobs = {f"losses/{name}": (TRAIN, argv) for name, argv in VARIANTS.items()}
    jobs.update({f"grads/{name}": ("dp_jobs:gradients_after_one_step", GRAD_ARGS + argv, ref["grads_path"])
                 for name, argv in GRAD_VARIANTS.items()})
    if world == 2:
        jobs["launches"] = ("dp_jobs:bucket_launches", 0.25)
        jobs.update({f"bad/{k}": (TRAIN, ["--steps", "2", "--quiet"] + argv)
                     for k, argv in make_bad_inputs(tmp).items()})
    names = list(jobs)
    results = run_group(world, [jobs[n] for n in names])
    results += [[("error", "not run: an earlier job failed")] * world] * (len(names) - len(results))
    return dict(zip(names, results)) | {"_ref": ref}
