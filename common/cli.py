"""The command line every training script shares: the same flag names and defaults everywhere.

Because the defaults are the same in every chapter, the same flags describe the same run whatever
script runs it: `train_dp.py --steps 10` and `train_tp.py --steps 10` train the same model on the same
batches and print the same losses. Each script adds the degrees it teaches with `parser.add_argument`.
"""
import argparse

from common.errors import ConfigError, require
from common.model import PRESETS, describe_size


class _Parser(argparse.ArgumentParser):
    def error(self, message):           # one clear line and exit code 2, like every other bad input
        raise ConfigError(f"{message} (see --help)")


def base_parser(description: str) -> argparse.ArgumentParser:
    presets = ", ".join(f"{n} ({describe_size(c)})" for n, c in PRESETS.items())
    p = _Parser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=50, help="optimizer steps to run")
    p.add_argument("--seed", type=int, default=1337, help="seed for weights and batches")
    p.add_argument("--model", default="tiny", help=f"model preset: {presets}")
    p.add_argument("--global-batch", type=int, default=16,
                   help="sequences per optimizer step, summed over all data-parallel ranks")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--microbatches", type=int, default=1,
                   help="micro-batches per step on each data-parallel rank (gradient accumulation / pipeline)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=10, help="linear warmup steps before the cosine decay")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    p.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm (0: off)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="compute dtype (bf16 = autocast)")
    p.add_argument("--data", default=None, help="a UTF-8 text file to train on (default: bundled corpus)")
    p.add_argument("--metrics", default=None, help="write one JSON object per step to this .jsonl file")
    p.add_argument("--checkpoint-dir", default=None, help="directory for checkpoints")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if available")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a collective waits for a peer")
    p.add_argument("--quiet", action="store_true", help="no console output (tests)")
    return p


def check_common(args, dp: int = 1) -> None:
    """Checks every script needs. `dp` is the data-parallel degree the batch is split over."""
    require(args.model in PRESETS, f"unknown --model {args.model!r}; choose one of {', '.join(PRESETS)}")
    require(args.steps >= 1, "--steps must be at least 1")
    require(args.seq_len >= 2, "--seq-len must be at least 2")
    require(args.seq_len <= PRESETS[args.model].max_seq_len,
            f"--seq-len {args.seq_len} exceeds the {args.model} preset's max_seq_len "
            f"{PRESETS[args.model].max_seq_len}; use a shorter --seq-len")
    require(args.microbatches >= 1, "--microbatches must be at least 1")
    require(args.global_batch % (dp * args.microbatches) == 0,
            f"--global-batch {args.global_batch} does not split over {dp} data-parallel rank(s) × "
            f"{args.microbatches} micro-batch(es); use a multiple of {dp * args.microbatches}")
    require(args.checkpoint_every >= 0, "--checkpoint-every must be ≥ 0")
    require(not args.resume or args.checkpoint_dir, "--resume needs --checkpoint-dir")


def default_pipeline_microbatches(args, dp: int, pp: int) -> None:
    """Scripts with a pipeline leave --microbatches unset by default and take 2·pp micro-batches, so
    the schedule has work to overlap (1 when the batch does not split so). The losses do not depend
    on the micro-batch count: only the bubble and the activation memory do."""
    if args.microbatches is None:
        args.microbatches = 2 * pp if args.global_batch % (dp * 2 * pp) == 0 else 1

