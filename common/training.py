"""Small pieces of the training loop that every chapter's script shares.

The loop itself stays in each chapter's train_*.py, in plain sight; what is here is bookkeeping:
the run's identity for checkpoints, AdamW state by parameter name, the global loss value, and the
guard that stops a run whose loss or gradient norm is no longer a number.
"""
import math
import os
import time

import torch
import torch.distributed as dist

from common import checkpoint
from common.errors import ConfigError, require
from common.moe_args import moe_model_config
from common.optim import AdamW, saved_step


def run_identity(args) -> dict:
    """What must match for a checkpoint to resume this run exactly (the layout need not match)."""
    return {"model": args.model, "model_config": moe_model_config(args).to_dict(), "seed": args.seed,
            "global_batch": args.global_batch, "seq_len": args.seq_len}


def optim_state_by_name(optimizer: AdamW, named_params, to_full=lambda name, t: t) -> dict:
    """AdamW's per-parameter state keyed by parameter name; `to_full` turns a local shard into the
    full tensor (identity when this rank holds whole tensors)."""
    out = {}
    for name, p in named_params:
        st = optimizer.state.get(p, {})
        if st:
            out[name] = {"step": st["step"].clone(), "exp_avg": to_full(name, st["exp_avg"]),
                         "exp_avg_sq": to_full(name, st["exp_avg_sq"])}
    return out


def consolidate_on_rank0(model, optimizer, named_params, is_writer: bool, to_full=lambda name, t: t,
                         moments: dict | None = None):
    """The single-device state dict and AdamW state by reference name, gathered on global rank 0.

    Each rank turns what it holds into full tensors (`to_full`: identity for whole tensors, a TP
    all-gather for shards; every rank of a TP group must call it), then only the *writers* send
    (one copy of each tensor: data-parallel replicas hold the same numbers). A pipeline's stages hold
    different names, so rank 0 merges the writers' dicts. Returns (model, optim), None elsewhere.
    `moments`: AdamW's state by name when `optimizer` does not hold it whole (ZeRO gathers it first).
    """
    weights = {name: to_full(name, t.detach()).cpu() for name, t in model.state_dict().items()}
    if moments is None:
        moments = optim_state_by_name(optimizer, named_params)
    moments = {n: {"step": s["step"].cpu(), "exp_avg": to_full(n, s["exp_avg"]).cpu(),
                   "exp_avg_sq": to_full(n, s["exp_avg_sq"]).cpu()} for n, s in moments.items()}
    mine = (weights, moments) if is_writer else ({}, {})
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if parts is None:
        return None, None
    full_model, full_optim = {}, {}
    for w, o in parts:
        full_model.update(w)
        full_optim.update(o)
    return full_model, full_optim


def load_optim_state_by_name(optimizer, named_params, states: dict, to_local=lambda name, t: t) -> None:
    """The reverse: give each local tensor its slice (`to_local`) of the full saved state."""
    for name, p in named_params:
        if name in states:
            s = states[name]
            optimizer.state[p] = {"step": saved_step(optimizer, s["step"], p.device),
                                  "exp_avg": to_local(name, s["exp_avg"]).to(p.device, p.dtype).clone(),
                                  "exp_avg_sq": to_local(name, s["exp_avg_sq"]).to(p.device, p.dtype).clone()}


def resume_state(args, identity: dict | None = None) -> dict | None:
    """The checkpoint to resume from (every rank loads it, so every rank can fail alike), or None.
    `identity`: what must match (default: run_identity(args)).

    `--resume` with a directory that holds no checkpoint yet starts at step 1 (saying so, once): the same
    command line then starts a run and resumes it, which is what `torchrun --max-restarts N` needs, as it
    re-runs the very command that failed."""
    if not args.resume:
        return None
    if not checkpoint.has_checkpoint(args.checkpoint_dir):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"--resume: no checkpoint in {args.checkpoint_dir!r} yet, so this run starts at step 1", flush=True)
        return None
    path = checkpoint.latest_path(args.checkpoint_dir)
    state = checkpoint.load(path, identity or run_identity(args))
    require(state["step"] < args.steps,
            f"the checkpoint {str(path)!r} is at step {state['step']} and --steps is {args.steps}: nothing is "
            f"left to train; pass --steps greater than {state['step']} to train on from it")
    return state


def start_rng(args, resume: dict | None) -> None:
    """torch's global random generator as the first step must find it: seeded from --seed in a fresh
    run, the checkpoint's saved state in a resumed one (so a draw at step k+1 is the uninterrupted run's).

    Call it just before the loop, after the model is built: building modules draws from this generator
    (each layer's default initialisation, before init_weights overwrites it by name), so a state set
    before the build would be spent by the time the first step runs."""
    torch.manual_seed(args.seed)                 # CPU and every GPU
    if resume is not None:
        torch.set_rng_state(resume["rng"])
        if "cuda_rng" in resume and torch.cuda.is_available():
            torch.cuda.set_rng_state(resume["cuda_rng"])


def stop_if_not_finite(step: int, loss: float, grad_norm: float, args) -> None:
    """Stop the run at this step if its loss or gradient norm is inf or nan.

    Both values are global (summed over every rank that holds a part), so every rank sees the same
    verdict at the same step and stops without waiting for the others. Called before the step's
    checkpoint is written, so the last checkpoint on disk is the last one with finite numbers.
    """
    bad = [f"the {name} is {value}" for name, value in (("loss", loss), ("gradient norm", grad_norm))
           if not math.isfinite(value)]
    if not bad:
        return
    # What was seen and what to try, in that order: the program cannot know why (a learning rate too high, an
    # overflow, or a stale gradient buffer in the layout's code all look the same here), so it names no cause.
    seen, tries = [f"--lr {args.lr:g}"], [f"a lower --lr (e.g. --lr {args.lr / 10:g})"]
    if args.clip == 0:
        seen.append("--clip 0 (no clipping)")
        tries.append("--clip 1.0")
    if args.dtype == "bf16":
        seen.append("--dtype bf16")
        tries.append("--dtype fp32")
    tries.append("the same flags on one device (world size 1): if that run stays finite, look at the layout's code")
    kept = (f"; checkpoints in {args.checkpoint_dir!r} are from earlier steps, untouched"
            if args.checkpoint_dir else "")
    raise ConfigError(f"step {step}: {' and '.join(bad)} with {', '.join(seen)}, so training stopped here{kept}; "
                      f"to try: {'; or '.join(tries)}")


def should_save(args, step: int) -> bool:
    return bool(args.checkpoint_dir) and (
        step == args.steps or (args.checkpoint_every > 0 and step % args.checkpoint_every == 0))


def global_sum(value: torch.Tensor, group=None) -> float:
    """Sum a scalar over a group (for the printed loss: each rank holds its tokens' share)."""
    value = value.detach().double().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
    return value.item()


class StepTimer:
    """Wall time of one step, synchronised on CUDA so queued kernels are counted."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.start
