"""The domains of the course's flags: the values each accepts, checked where argparse reads the text.

A `Domain` is a flag's `type=`: argparse calls it on what the user typed, and it returns the value or
raises one ConfigError line that names the flag, the value and the fix. Here: whole and real numbers in
a range, a readable UTF-8 text file, a writable output file or directory (asked of the file system by
trying), and a model preset. common/cli.py builds the parser that uses them.
"""
import math
import shlex
import tempfile
from pathlib import Path

from common.errors import ConfigError
from common.model import PRESETS


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
