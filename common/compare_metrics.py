"""Compare two or more metrics files step by step: do these runs give the same numbers?

    python -m common.compare_metrics runs/one.jsonl runs/tp4.jsonl runs/pp4.jsonl
    python -m common.compare_metrics a.jsonl b.jsonl --key grad_norm --tol 1e-6

The first file is the reference. For each other file and each step both files hold, it prints the
relative difference |x - x_ref| / |x_ref| of one key (`loss` unless `--key` says otherwise), then per
file the largest difference, the step where it occurs, and the first step where the difference
exceeds `--tol`. Exit status: 1 if any difference exceeds `--tol`, 0 if none does, 2 if a file is
missing, is not a metrics file or lacks the key, or a flag is out of its domain (one line naming the
file and line, or the flag); so a lab or a script can use it as a check. Steps are matched by their
`step` number, so a resumed run (steps 11..20) compares with the same steps of an uninterrupted one;
a step written twice (a restarted run appends the steps it re-runs) counts with its last row.
A NaN (a run that diverged) never compares as equal, not even to another NaN: its step counts as
above the tolerance, and the output names it.

How large a difference is honest? Two layouts add the same numbers in another order, so each step's
loss differs by float32 round-off (~1e-7 relative); AdamW divides each update by the running RMS of
the gradients, which turns tiny gradient differences into weight differences of relative size ~1e-7
to 1e-6, and the difference grows with the steps. The root README gives the measured growth.
"""
import math
import sys
from pathlib import Path

if __package__ in (None, ""):          # run as `python common/compare_metrics.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.cli import Parser  # noqa: E402
from common.domains import NON_NEGATIVE_REAL  # noqa: E402
from common.errors import ConfigError  # noqa: E402
from common.metrics import read_rows  # noqa: E402

def relative_difference(x: float, ref: float) -> float:
    """|x - ref| / |ref|; the absolute difference where the reference is 0 (nothing to scale by).
    A NaN on either side is infinitely different (NaN == NaN is False), so it is always above `--tol`."""
    if not (math.isfinite(x) and math.isfinite(ref)):
        return 0.0 if x == ref else math.inf
    return abs(x - ref) / abs(ref) if ref != 0 else abs(x - ref)


def values_by_step(rows: dict[int, tuple[int, dict]], key: str, path) -> dict[int, float]:
    """{step: value of `key`} for every row of a metrics file (`read_rows`) that carries `key`."""
    found = {}
    for step, (number, row) in rows.items():
        if key not in row or row[key] is None:
            continue
        if not isinstance(row[key], (int, float)):
            raise ConfigError(f"{path}, line {number}: `{key}` is not a number at step {step} "
                              f"({type(row[key]).__name__}); choose a scalar key with --key")
        found[step] = float(row[key])
    if not found:
        keys = sorted({k for _, row in rows.values() for k in row})
        raise ConfigError(f"{path} has no `{key}` values; its keys: {', '.join(keys)}")
    return found


def compare(paths: list, key: str = "loss") -> dict:
    """Per-step relative differences of `key` in each file against the first.

    Every file is read and checked before anything is compared. Returns {"steps": the reference's steps,
    "reference": {step: value}, "diffs": {path: {step: relative difference}} for the steps both files
    hold, "nan": {path: {"file": its steps of "diffs" where it holds NaN, "reference": those where the
    reference does}}}.
    """
    values = [values_by_step(read_rows(path), key, path) for path in paths]
    ref = values[0]
    diffs, nan = {}, {}
    for path, other in zip(paths[1:], values[1:]):
        common_steps = sorted(set(ref) & set(other))
        if not common_steps:
            raise ConfigError(f"{path} and {paths[0]} have no step in common "
                             f"({min(other)}..{max(other)} vs {min(ref)}..{max(ref)})")
        diffs[str(path)] = {s: relative_difference(other[s], ref[s]) for s in common_steps}
        nan[str(path)] = {"file": [s for s in common_steps if math.isnan(other[s])],
                          "reference": [s for s in common_steps if math.isnan(ref[s])]}
    return {"steps": sorted(ref), "reference": ref, "diffs": diffs, "nan": nan}


def summary(per_step: dict[int, float], tol: float) -> dict:
    """Largest difference, its step, and the first step above `tol` (None if there is none)."""
    worst = max(per_step, key=per_step.get)
    above = [s for s, d in per_step.items() if d > tol]
    return {"max": per_step[worst], "max_step": worst, "first_above_tol": min(above) if above else None,
            "steps": len(per_step)}


def _steps(steps: list[int]) -> str:
    """`step 3` / `3 steps (3, 4, 9)` / `12 steps (3, 4, 5, 6, 7, ...)`."""
    if len(steps) == 1:
        return f"step {steps[0]}"
    return f"{len(steps)} steps ({', '.join(map(str, steps[:5]))}{', ...' if len(steps) > 5 else ''})"


def main(argv=None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+",
                        help="metrics files (JSON Lines), at least two; the first is the reference (no default)")
    parser.add_argument("--key", default="loss", help="which metric to compare (any scalar key)")
    parser.add_argument("--tol", type=NON_NEGATIVE_REAL, default=1e-5,
                        help="relative difference above which a step counts as different (exit status 1)")
    try:
        args = parser.parse_args(argv)
        if len(args.files) < 2:
            parser.error("give at least two metrics files: the reference first, then the runs to compare with it")
        result = compare(args.files, args.key)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    names = [Path(p).name for p in args.files]
    print(f"{args.key}: relative difference vs {names[0]} (tolerance {args.tol:g})")
    print(f"{'step':>5} {names[0][:16]:>16} " + " ".join(f"{n[:12]:>12}" for n in names[1:]))
    for step in result["steps"]:
        cells = [f"{d[step]:12.2e}" if step in d else f"{'-':>12}" for d in result["diffs"].values()]
        print(f"{step:>5} {result['reference'][step]:16.8g} " + " ".join(cells))
    exceeded = False
    for name, path, per_step in zip(names[1:], args.files[1:], result["diffs"].values()):
        s = summary(per_step, args.tol)
        first = "none" if s["first_above_tol"] is None else f"step {s['first_above_tol']}"
        print(f"{name}: max {s['max']:.2e} at step {s['max_step']} over {s['steps']} steps; "
              f"first step above {args.tol:g}: {first}")
        nan = result["nan"][str(path)]
        where = [f"at {_steps(nan[side])} in {file}" for side, file in (("file", name), ("reference", names[0]))
                 if nan[side]]
        if where:
            print(f"{name}: {args.key} is NaN {' and '.join(where)}; a NaN equals nothing (not even a NaN), "
                  f"so each such step counts as above {args.tol:g}")
        exceeded |= s["first_above_tol"] is not None
    return 1 if exceeded else 0


if __name__ == "__main__":
    sys.exit(main())
