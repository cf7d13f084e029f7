"""python -m common.exercises {list, make, grade, bug}: see this package's __init__."""
import argparse
import os
import sys
from pathlib import Path

from common.errors import ConfigError

from . import catalog, commands, copy_suite, museum, wrong_answers


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m common.exercises", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="one line per exercise: id, file, what grades it")
    mk = sub.add_parser("make", help="a student copy of the repository with the chapter's exercise bodies removed")
    mk.add_argument("--chapter", required=True, help=f"{', '.join(catalog.CHAPTERS)}, or 'all'")
    mk.add_argument("--out", required=True, type=Path)
    gr = sub.add_parser("grade", help="run each exercise's tests; one verdict line per exercise")
    gr.add_argument("--chapter", default=None, help=f"{', '.join(catalog.CHAPTERS)}, or 'all'")
    gr.add_argument("--repo", type=Path, default=None, help="the copy to grade (default: this repository)")
    gr.add_argument("--quick", action="store_true", help="the unit tests only, not the layout runs")
    gr.add_argument("--bug", default=None, help="grade a museum copy: are the tests that catch this bug green again?")
    bug = sub.add_parser("bug", help="the museum: 'bug list', 'bug ID --out DIR', 'bug --check'")
    bug.add_argument("bug_id", nargs="?", default=None, help="a bug's id, or 'list'")
    bug.add_argument("--out", type=Path, default=None)
    bug.add_argument("--check", action="store_true", help="plant every bug (or the one named) and run the tests that must catch it")
    wr = sub.add_parser("wrong", help="realistic wrong answers: 'wrong list', 'wrong ID --out DIR', 'wrong --check'")
    wr.add_argument("wrong_id", nargs="?", default=None, help="EXERCISE.NAME (e.g. 06.merge.no_max), or 'list'")
    wr.add_argument("--out", type=Path, default=None)
    wr.add_argument("--check", action="store_true", help="plant each wrong answer (or the one named) and grade it")
    cp = sub.add_parser("copies", help="a fresh student copy of each chapter against its own tests: "
                                       "does it fail only on its open exercises?")
    cp.add_argument("--chapter", default="all", help=f"{', '.join(catalog.CHAPTERS)}, or 'all' (the default)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    try:
        if args.command == "bug" or (args.command == "grade" and args.bug):
            return museum.main(args)
        if args.command == "wrong":
            return wrong_answers.main(args)
        if args.command == "copies":
            return copy_suite.main(args.chapter)
        return commands.main(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def run(argv=None) -> int:
    """`main` as a command: output piped into a reader that stops early (`bug list | head -1`) ends it
    quietly, as any command-line tool does, instead of in a BrokenPipeError."""
    try:
        code = main(argv)
        sys.stdout.flush()          # a write still buffered fails here, inside the try
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # the interpreter's final flush goes nowhere
        return 1


if __name__ == "__main__":
    sys.exit(run())
