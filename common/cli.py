"""The command line every training script shares: the same flags, defaults and domains everywhere.

Because the defaults are the same in every chapter, the same flags describe the same run whatever
script runs it: `train_dp.py --steps 10` and `train_tp.py --steps 10` train the same model on the same
batches and print the same losses. Each script adds the degrees it teaches with `parser.add_argument`.

Every flag declares its *domain* where it is defined: `type=POSITIVE_INT`, `type=TEXT_FILE`, ... (a
`Domain`), or `choices=[...]`. argparse calls the domain on the text the user typed, inside
`parse_args`, so a value outside it is refused on every rank before any process group exists, with one
line that names the flag, the value and the fix (a ConfigError: `run_main` prints it, exit code 2):
`--lr must be a finite number > 0, got inf; e.g. --lr 0.003 (the default)`.
Paths are checked the same way: a data file must be a readable, non-empty UTF-8 text file; an output
directory or file must be creatable and writable. That is found out now, not at the first checkpoint
after the training time is spent. A test walks every flag of every train_*.py through its domain.
"""
import argparse
import math
import shlex
import tempfile
from pathlib import Path

from common import checkpoint, preset_training
from common.data import DEFAULT_CORPUS, check_length
from common.compile import BACKENDS as COMPILE_BACKENDS, check_compile
from common.errors import ConfigError, require
from common.model import PRESETS, describe_size
from common.recompute import MODES as RECOMPUTE_MODES


class Domain:
    """The values one flag accepts: `rule` says which (shown by --help); `check(domain, text)` returns
    the value or raises `Refused(why, fix)`. The parser tells the domain its flag's name and default,
    so every message can name them."""

    def __init__(self, kind: str, rule: str, check, low=None, high=None, flag: str = "", default=None):
        self.kind, self.rule, self.check, self.low, self.high = kind, rule, check, low, high
        self.flag, self.default = flag, default

    def named(self, flag: str, default) -> "Domain":
        return Domain(self.kind, self.rule, self.check, self.low, self.high, flag, default)

    def __call__(self, text: str):
        try:
            return self.check(self, text)
        except Refused as refused:
            why, fix = refused.args
            if why.startswith("must be"):        # a number: `--lr must be a finite number > 0, got inf; ...`
                raise ConfigError(f"{self.flag} {why}, got {shlex.quote(text)}; {fix}") from None
            raise ConfigError(f"{self.flag} {shlex.quote(text)}: {why}; {fix}") from None

    def example(self) -> str:
        """The fix for a number out of range: the default, or how to get it."""
        if self.default is None:
            return f"leave {self.flag} out to use its default"
        return f"e.g. {self.flag} {self.default} (the default)"


class Refused(Exception):
    """(why the value is refused, how to fix it)"""


# --- numbers ------------------------------------------------------------------------------------------

def _number(domain: Domain, text: str):
    convert = int if domain.kind.startswith("int") else float
    try:
        value = convert(text)
    except ValueError:
        raise Refused(f"must be {domain.rule}", domain.example()) from None
    strict = domain.kind.startswith("real>")
    if not (math.isfinite(value) and (value > domain.low if strict else value >= domain.low)
            and (domain.high is None or value <= domain.high)):
        raise Refused(f"must be {domain.rule}", domain.example())
    return value


def whole(low: int, high: int | None = None) -> Domain:
    return Domain(f"int≥{low}", f"a whole number ≥ {low}" + (f" and ≤ {high}" if high is not None else ""),
                  _number, low, high)


def real(low: float, strict: bool, high: float | None = None) -> Domain:
    sign = ">" if strict else "≥"
    return Domain(f"real{sign}{low:g}", f"a finite number {sign} {low:g}" + (f" and ≤ {high:g}" if high else ""),
                  _number, low, high)


POSITIVE_INT, NON_NEGATIVE_INT = whole(1), whole(0)
POSITIVE_REAL, NON_NEGATIVE_REAL = real(0, strict=True), real(0, strict=False)
# A collective timeout also bounds the start-up rendezvous, and ranks start seconds apart on a busy
# machine: below 10 s the start itself fails; above a day, Python's timedelta arithmetic gives up.
TIMEOUT_S = real(10, strict=False, high=86_400)


# --- paths --------------------------------------------------------------------------------------------

def read_utf8(path: Path, fix: str, what: str = "a text file") -> str:
    """The text of a file, or Refused(why, fix): missing, a directory, unreadable, binary (NUL bytes), not
    UTF-8. Every file the course reads from a user goes through it (--data, the metrics files compared)."""
    if not path.exists():
        raise Refused("does not exist", fix)
    if path.is_dir():
        raise Refused(f"is a directory, not {what}", fix)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise Refused(f"cannot be read ({err.strerror})", fix) from None
    if b"\0" in raw:
        raise Refused(f"holds NUL bytes (the first at byte {raw.index(0)}): a binary file, not text", fix)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise Refused(f"is not UTF-8 text (invalid byte at offset {err.start})", fix) from None


def _text_file(domain: Domain, text: str) -> str:
    fix = f"pass {domain.flag} PATH to a UTF-8 text file, or leave {domain.flag} out (the bundled corpus)"
    if not read_utf8(Path(text), fix):
        raise Refused("the file is empty", fix)
    return text


def _writable(domain: Domain, text: str, want_dir: bool) -> str:
    """A directory / file we can create or write. The file system is asked by doing it: a file is
    created (and removed) where the run will write, because the permission bits do not tell
    (`os.access` says yes to root everywhere, also under /proc or /sys, which refuse every new file).
    Nothing is left behind: an existing file is opened for appending and closed unchanged, and a
    missing folder is not created yet (its nearest existing parent must accept new entries)."""
    what = "a directory (created if missing)" if want_dir else "a file path (its folders are created if missing)"
    fix = f"give {domain.flag} {what} in a writable place"
    path = Path(text)
    if not text:
        raise Refused("is empty", fix)
    if path.exists():
        if want_dir and not path.is_dir():
            raise Refused("is a file, not a directory", fix)
        if not want_dir and path.is_dir():
            raise Refused("is a directory, not a file", fix)
        _probe(path, fix, "is not writable", folder=want_dir)
        return text
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise Refused(f"{str(parent)!r} is a file, so nothing can be created under it", fix)
    _probe(parent, fix, f"cannot be created: {str(parent)!r} refuses new files", folder=True)
    return text


def _probe(path: Path, fix: str, refused: str, folder: bool) -> None:
    """Write access, tried: `folder`: create a file in `path` and remove it (a name of its own: every
    rank probes at once); else open the file `path` for appending and close it (its content unchanged)."""
    try:
        if folder:
            tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-").close()
        else:
            open(path, "a").close()
    except OSError as err:
        raise Refused(f"{refused} ({err.strerror})", fix) from None


def _preset(domain: Domain, text: str) -> str:
    if text not in PRESETS:
        raise Refused("unknown preset", f"choose one of {', '.join(PRESETS)}")
    return text


TEXT_FILE = Domain("text file", "a readable, non-empty UTF-8 text file", _text_file)
OUTPUT_DIR = Domain("output directory", "a writable directory, created if missing",
                    lambda d, t: _writable(d, t, want_dir=True))
OUTPUT_FILE = Domain("output file", "a writable file; its folders are created if missing",
                     lambda d, t: _writable(d, t, want_dir=False))
PRESET = Domain("preset", "", _preset)


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


def check_common(args, dp: int = 1, microbatches: int | None = None, cfg=None) -> None:
    """Checks across flags that every script needs. `dp` is the data-parallel degree the batch is split
    over, `microbatches` the count each of its ranks cuts its rows into (default: --microbatches);
    `cfg` the model's configuration (default: the --model preset's; the layout planner passes a published shape)."""
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
    check_compile(args)
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
    fits = [m for m in range(step, rows + 1, step) if rows % m == 0]
    if args.microbatches is not None and args.microbatches % step == 0:
        return args.microbatches
    if args.microbatches is None and [m for m in fits if m <= 2 * pp]:
        return max(m for m in fits if m <= 2 * pp)
    given = "" if args.microbatches is None else f", got --microbatches {args.microbatches}"
    need = (f"the interleaved schedule needs --microbatches to be a multiple of --pp ({pp}) that splits the "
            f"{rows} sequences of each data-parallel rank{given}")
    if fits:
        raise ConfigError(f"{need}; use --microbatches {' or '.join(str(m) for m in fits[:3])}")
    batch = -(-args.global_batch // (dp * pp)) * dp * pp          # the next multiple of dp·pp
    raise ConfigError(f"{need}, and none does; use --global-batch {batch} --microbatches {pp}")
