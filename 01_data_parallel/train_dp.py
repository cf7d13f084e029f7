"""Chapter 01 — data parallelism. Every rank trains the whole model on its slice of the batch.

    python 01_data_parallel/train_dp.py                              # world size 1: the reference
    torchrun --nproc_per_node=4 01_data_parallel/train_dp.py         # 4 data-parallel ranks
    torchrun --nproc_per_node=4 01_data_parallel/train_dp.py --impl naive|bucketed|torch

The DP degree is the world size. The same flags give the same losses in every case.
"""
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters

import torch

from common import activation_ledger, checkpoint, comm
from common.activation_meter import MeasuredActivations
from common.cli import base_parser, check_common
from common.domains import POSITIVE_REAL
from common.data import TextData, shard_rows
from common.distributed import env_world_size, init_distributed, shutdown
from common.errors import run_main
from common.mesh import Mesh
from common.metrics import RunLog, format_bytes
from common.model import build_model, count_parameters, dense_preset
from common.optim import lr_at
from common.training import (StepTimer, global_sum, resume_state, run_identity, should_save, start_rng,
                             stop_if_not_finite)

dp_trainer = import_module("01_data_parallel.dp_trainer")
replicated_adamw = import_module("01_data_parallel.replicated_adamw")


def parse_args(argv=None):
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--impl", default="bucketed", choices=["naive", "bucketed", "torch"],
                   help="naive: all-reduce after backward; bucketed: overlapped buckets; torch: DDP")
    # DDP's own default is 25 MB: the whole tiny model (6.3 MB) would be one bucket, sent only when
    # backward is over, with nothing left to overlap. 1 MB gives the tiny model 6 buckets.
    p.add_argument("--bucket-mb", type=POSITIVE_REAL, default=25.0,
                   help="bucket size for bucketed and torch DDP (tiny is 6.3 MB: try 1 to see several buckets)")
    args = p.parse_args(argv)
    check_common(args, dp=env_world_size())
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    cfg = dense_preset(args.model, "05_moe_expert_parallel/train_moe.py")   # a mixture of experts is chapter 05's
    rt = init_distributed(args.device, args.timeout)
    mesh = Mesh(rt.rank, rt.world_size, dp=rt.world_size)
    dp_group, dp_rank, dp = mesh.group("dp"), mesh.coord("dp"), mesh.size("dp")
    data = TextData(args.data, args.seq_len, args.seed)
    resume = resume_state(args)

    # --- the model: a full replica on every rank -------------------------------------------------
    model = build_model(cfg, args.seed, rt.device, args.recompute, args.compile, args.recompute_layers)
    start = resume["step"] if resume else 0
    if resume:
        model.load_state_dict(resume["model"], strict=True)
    trainer = build_trainer(args, model, dp_group)            # naive | bucketed | DDP, the same verbs
    # the bytes autograd keeps, measured beside the ledger's prediction (`memory()`; ours only)
    predicted = activation_ledger.predicted_bytes(cfg, args, args.global_batch // dp // args.microbatches)
    trainer = MeasuredActivations(trainer, model, predicted,
                                  measure=args.impl != "torch" and not args.no_activation_meter)
    if resume:
        trainer.load_optim_state(resume["optim"])

    log = RunLog(rt.rank, args.steps, args.metrics, args.quiet, append=args.resume)
    log.track_mfu(cfg, args.seq_len, args.dtype, rt)          # `mfu` in every row (common/mfu.py)
    log.config_table(f"data parallel — {args.impl}", config_rows(args, cfg, model, rt, data.describe(), start))
    if rt.world_size == 1:
        log.print("world size 1: the single-device reference. More ranks: "
                  "torchrun --nproc_per_node=4 01_data_parallel/train_dp.py")

    tokens_per_step = args.global_batch * args.seq_len
    start_rng(args, resume)                   # torch's generator: seeded, or as the checkpoint left it
    log.start(start + 1)
    for step in range(start + 1, args.steps + 1):
        comm.COUNTER.reset()
        lr = lr_at(step, args.lr, args.warmup, args.steps)
        trainer.set_lr(lr)
        with StepTimer(rt.device) as timer:
            x, y = data.global_batch(step, args.global_batch)                 # (global_batch, S)
            x, y = shard_rows(x, dp_rank, dp), shard_rows(y, dp_rank, dp)     # (global_batch/dp, S)
            x, y = x.to(rt.device), y.to(rt.device)
            local_loss = torch.zeros((), device=rt.device)
            for mb in range(args.microbatches):
                xm, ym = shard_rows(x, mb, args.microbatches), shard_rows(y, mb, args.microbatches)
                # Gradient accumulation: only the last micro-batch's backward communicates (sync=True).
                local_loss += trainer.forward_backward(xm, ym, sync=mb == args.microbatches - 1)
            trainer.sync_gradients()        # naive: all-reduce every gradient now; bucketed, DDP: wait
            grad_norm = trainer.clip_grad_norm(args.clip)   # every replica holds the full gradient
            trainer.step()
            trainer.zero_grad()
        loss_value = global_sum(local_loss, dp_group)
        stop_if_not_finite(step, loss_value, grad_norm, args)
        log.log_step(step, loss_value, lr, tokens_per_step, timer.seconds, grad_norm=grad_norm,
                     **trainer.comm_bytes(), **trainer.memory())
        if should_save(args, step):
            model_state, optim_state = trainer.full_state()
            if rt.is_main:
                path = checkpoint.save(args.checkpoint_dir, step, model_state, optim_state, run_identity(args))
                log.note(f"checkpoint saved: {path}")
    log.finish()
    shutdown(rt)
    return log.history


def config_rows(args, cfg, model, rt, data: str, start: int) -> dict:
    """The configuration table printed at start: the replicas, the batch split, the all-reduce volume."""
    dp, M = rt.world_size, sum(p.numel() * p.element_size() for p in model.parameters())
    tokens = args.global_batch * args.seq_len
    return {
        "world size (= DP degree)": dp, "device / backend": f"{rt.device} / {rt.backend}", "data": data,
        "model": f"{args.model}: {count_parameters(cfg):,} parameters ({format_bytes(M)} fp32)",
        "global batch": f"{args.global_batch} seq × {args.seq_len} tokens = {tokens:,} tokens",
        "per rank": f"{args.global_batch // dp} seq in {args.microbatches} micro-batch(es)",
        "all-reduce volume per rank": f"2(N-1)/N·M = {format_bytes(2 * (dp - 1) / dp * M)} sent "
                                      "(and as much received)",
        "resumed from step": start or "-"}


def build_trainer(args, model, group):
    """The trainer of `--impl`, chosen once: ours (dp_trainer.py) or PyTorch's DDP (torch_dp.py)."""
    kw = dict(tokens_per_step=args.global_batch * args.seq_len, bf16=args.dtype == "bf16")
    # the optimizer, passed in: AdamW on the whole model, on every replica (the trainer sums the gradients)
    adamw = replicated_adamw.ReplicatedAdamW(model.named_parameters(), args.lr, args.weight_decay)
    if args.impl == "naive":
        return dp_trainer.NaiveDP(model, group, adamw, **kw)
    if args.impl == "bucketed":
        return dp_trainer.BucketedDP(model, group, adamw, bucket_mb=args.bucket_mb, **kw)
    # PyTorch's DDP is imported only when asked for: its DTensor machinery costs every rank ~0.8 s of CPU
    torch_dp = import_module("01_data_parallel.torch_dp")
    return torch_dp.TorchDDP(model, group, adamw, bucket_mb=args.bucket_mb, **kw)


if __name__ == "__main__":
    run_main(main)
