"""The command line every training script shares: the same flags, defaults and domains everywhere.

Because the defaults are the same in every chapter, the same flags describe the same run whatever
script runs it: `train_dp.py --steps 10` and `train_tp.py --steps 10` train the same model on the same
batches and print the same losses. Each script adds the degrees it teaches with `parser.add_argument`.

Every flag declares its *domain* where it is defined: `type=POSITIVE_INT`, `type=TEXT_FILE`, ... (a
`Domain`, common/domains.py), or `choices=[...]`. argparse calls the domain on the text the user typed, inside
`parse_args`, so a value outside it is refused on every rank before any process group exists, with one
line that names the flag, the value and the fix (a ConfigError: `run_main` prints it, exit code 2):
`--lr must be a finite number > 0, got inf; e.g. --lr 0.003 (the default)`.
Paths are checked the same way: a data file must be a readable, non-empty UTF-8 text file; an output
directory or file must be creatable and writable. That is found out now, not at the first checkpoint
after the training time is spent. A test walks every flag of every train_*.py through its domain.
"""
import argparse
from pathlib import Path

from common import checkpoint, preset_training
from common.data import DEFAULT_CORPUS, check_length
from common.compile import BACKENDS as COMPILE_BACKENDS, check_compile
from common.domains import (NON_NEGATIVE_INT, NON_NEGATIVE_REAL, OUTPUT_DIR, OUTPUT_FILE, POSITIVE_INT,
                            POSITIVE_REAL, PRESET, TEXT_FILE, TIMEOUT_S, Domain, whole)
from common.errors import ConfigError, require
from common.model import PRESETS, describe_size
from common.recompute import MODES as RECOMPUTE_MODES


# --- the parser ---------------------------------------------------------------------------------------

class _HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its domain and its default (unless the help states the default's rule)."""

    def _get_help_string(self, action):
        text = action.help or ""
        rule = action.type.rule if isinstance(action.type, Domain) else ""
        says_default = action.nargs == 0 or "default" in text or action.default is argparse.SUPPRESS
        extra = [part for part in (rule, "" if says_default else "default: %(default)s") if part]
        return f"{text} ({'; '.join(extra)})" if extra else text


class Parser(argparse.ArgumentParser):
    """The course's parser: each Domain knows its flag's name, --help shows each domain, and a bad value
    or flag is one ConfigError line (exit code 2). Every command of the course parses with it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=_HelpFormatter, **kwargs)

    def error(self, message):           # one clear line and exit code 2, like every other bad input
        if message.endswith("expected one argument"):      # `--lr -inf`: argparse reads -inf as a flag
            message += f" (a value that starts with '-' is written {message.split()[1].rstrip(':')}=VALUE)"
        raise ConfigError(f"{message} (see --help)")

    def parse_known_args(self, args=None, namespace=None):
        for action in self._actions:    # each domain learns its flag's name and default
            if isinstance(action.type, Domain) and not action.type.flag:
                action.type = action.type.named(action.option_strings[0], action.default)
        return super().parse_known_args(args, namespace)


class TrainingParser(Parser):
    """The parser of a training script: `--lr` and `--warmup` left out take the --model preset's values."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        lr, warmup = preset_training.training_defaults(parsed.model)
        parsed.lr = lr if parsed.lr is None else parsed.lr
        parsed.warmup = warmup if parsed.warmup is None else parsed.warmup
        return parsed, rest


def base_parser(description: str, pipeline: bool = False) -> Parser:
    """The shared flags. `pipeline`: the script runs a pipeline, whose --microbatches default is a rule."""
    presets = ", ".join(f"{n} ({describe_size(c)})" for n, c in PRESETS.items())
    p = TrainingParser(description=description)
    p.add_argument("--steps", type=POSITIVE_INT, default=50, help="optimizer steps to run")
    p.add_argument("--seed", type=whole(0, 2**32 - 1), default=1337, help="seed for weights and batches")
    p.add_argument("--model", type=PRESET, default="tiny", help=f"model preset: {presets}")
    p.add_argument("--global-batch", type=POSITIVE_INT, default=16,
                   help="sequences per optimizer step, summed over all data-parallel ranks")
    p.add_argument("--seq-len", type=whole(2), default=128, help="tokens per sequence (at most the preset's max_seq_len)")
    if pipeline:
        p.add_argument("--microbatches", type=POSITIVE_INT, default=None,
                       help="micro-batches per step on each data-parallel rank (default: the largest count ≤ 2·pp "
                            "that splits the rank's rows; interleaved: a multiple of pp)")
    else:
        p.add_argument("--microbatches", type=POSITIVE_INT, default=1,
                       help="micro-batches per step on each data-parallel rank (gradient accumulation)")
    p.add_argument("--lr", type=POSITIVE_REAL, default=None,
                   help="peak learning rate (AdamW); default: the preset's (common/preset_training.py): "
                        f"{preset_training.describe()} (lr/warm-up)")
    p.add_argument("--warmup", type=NON_NEGATIVE_INT, default=None,
                   help="linear warmup steps before the cosine decay (default: the preset's, as for --lr)")
    p.add_argument("--weight-decay", type=NON_NEGATIVE_REAL, default=0.1, help="AdamW weight decay (matrices only)")
    p.add_argument("--clip", type=NON_NEGATIVE_REAL, default=1.0, help="clip gradients to this global norm (0: off)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="compute dtype (bf16 = autocast)")
    p.add_argument("--recompute", default="none", choices=list(RECOMPUTE_MODES),
                   help="activation recomputation in every block: none; selective (the norms and SwiGLU's "
                        "silu rebuilt in backward); full (only each block's input kept, its forward rerun "
                        "in backward)")
    p.add_argument("--recompute-layers", type=POSITIVE_INT, default=None,
                   help="apply --recompute to the first K blocks of each pipeline stage only, keep the rest "
                        "(default: every block)")
    p.add_argument("--compile", nargs="?", const="inductor", default="none", choices=list(COMPILE_BACKENDS),
                   help="torch.compile each transformer block (common/compile.py): --compile alone is inductor; "
                        "--compile aot_eager compiles in seconds with no speed-up, to check the losses")
    p.add_argument("--data", type=TEXT_FILE, default=None,
                   help=f"the text to train on (default: the bundled corpus, common/corpus/{DEFAULT_CORPUS.name})")
    p.add_argument("--metrics", type=OUTPUT_FILE, default=None,
                   help="write one JSON object per step to this .jsonl file (default: none)")
    p.add_argument("--checkpoint-dir", type=OUTPUT_DIR, default=None, help="directory for checkpoints (default: none)")
    p.add_argument("--checkpoint-every", type=NON_NEGATIVE_INT, default=0, help="save every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if available, else cpu")
    p.add_argument("--timeout", type=TIMEOUT_S, default=60.0,
                   help="seconds a collective (and the start-up rendezvous) waits for a peer")
    p.add_argument("--quiet", action="store_true", help="no console output (tests)")
    p.add_argument("--no-activation-meter", action="store_true",
                   help="do not count the activation bytes autograd saves (peak_activation_bytes null): its "
                        "Python hook per saved tensor costs 1-4 %% of a CPU step (make overhead)")
    return p


def measurement_parser(description: str, rows: int, rows_help: str, model_help: str) -> argparse.ArgumentParser:
    """The flags of a script that measures on a few ranks and writes one JSON file (chapter 02's overlap_tp.py,
    chapter 06's overlap_cp.py): the file rank 0 writes, the model preset, the batch's rows. Each adds its own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, help="the JSON file written by rank 0")
    p.add_argument("--model", default="small", choices=sorted(PRESETS), help=f"{model_help} (default small)")
    p.add_argument("--rows", type=int, default=rows, help=f"{rows_help} (default {rows})")
    return p


def check_common(args, dp: int = 1, microbatches: int | None = None, cfg=None, split_w: bool = False) -> None:
    """Checks across flags that every script needs. `dp` is the data-parallel degree the batch is split
    over, `microbatches` the count each of its ranks cuts its rows into (default: --microbatches);
    `cfg` the model's configuration (default: the --model preset's; the layout planner passes a published shape);
    `split_w`: the pipeline schedule splits the backward into B and W (pipeline_schedules.SCHEDULES)."""
    m = microbatches or args.microbatches
    max_seq_len = (cfg or PRESETS[args.model]).max_seq_len
    require(args.seq_len <= max_seq_len,
            f"--seq-len {args.seq_len} exceeds the {args.model} preset's max_seq_len {max_seq_len}; "
            f"use a shorter --seq-len")
    require(args.global_batch % (dp * m) == 0,
            f"--global-batch {args.global_batch} does not split over {dp} data-parallel rank(s) × "
            f"{m} micro-batch(es); use a multiple of {dp * m}")
    require(not args.resume or args.checkpoint_dir, "--resume needs --checkpoint-dir")
    require(args.recompute_layers is None or args.recompute != "none",
            f"--recompute-layers {args.recompute_layers} chooses blocks to recompute; add --recompute full (or selective)")
    require(not args.no_activation_meter or getattr(args, "impl", None) != "torch",
            "--no-activation-meter is for the course's own --impl: PyTorch's (--impl torch) meters no "
            "activations; drop the flag")
    check_compile(args, split_w)
    if args.checkpoint_dir and not args.resume:
        checkpoint.refuse_fresh_run_over(args.checkpoint_dir)     # another run's checkpoints are kept
    data = Path(args.data) if args.data else DEFAULT_CORPUS
    check_length(data, data.stat().st_size, args.seq_len)       # bytes = tokens (byte-level tokenizer)


def pipeline_microbatches(args, dp: int, pp: int) -> int:
    """The micro-batch count of a pipeline run: --microbatches if given, else the largest count ≤ 2·pp
    that splits the rows of each data-parallel rank, so the schedule has work to overlap. The
    interleaved schedule also needs a multiple of pp; a count that cannot work is refused with one that
    does. The losses do not depend on the micro-batch count: only the bubble and the memory do."""
    if args.global_batch % dp:
        return args.microbatches or 1        # check_common refuses the batch split, with its own fix
    rows, step = args.global_batch // dp, pp if args.schedule == "interleaved" else 1
    if args.microbatches is not None and args.microbatches % step == 0:
        return args.microbatches
    fits = [m for m in range(step, rows + 1, step) if rows % m == 0]
    if args.microbatches is None and [m for m in fits if m <= 2 * pp]:
        return max(m for m in fits if m <= 2 * pp)
    given = "" if args.microbatches is None else f", got --microbatches {args.microbatches}"
    need = (f"the interleaved schedule needs --microbatches to be a multiple of --pp ({pp}) that splits the "
            f"{rows} sequences of each data-parallel rank{given}")
    if fits:
        raise ConfigError(f"{need}; use --microbatches {' or '.join(str(m) for m in fits[:3])}")
    batch = -(-args.global_batch // (dp * pp)) * dp * pp          # the next multiple of dp·pp
    raise ConfigError(f"{need}, and none does; use --global-batch {batch} --microbatches {pp}")
