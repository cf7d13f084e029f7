"""Throughput of every DP × TP × PP factorisation of 8 ranks, and of the same run on 1 rank.

    python 04_3d_combined/bench_3d.py                     # → 04_3d_combined/results/3d_bench.md, ~4 min on 2 cores
    python 04_3d_combined/bench_3d.py --rounds 2 --steps 12

Each layout trains the same model on the same batches (so the losses agree, checked here too);
only the time differs. Layouts run one after another in each round (rounds interleave the
layouts, so slow drift of the machine spreads over all of them); the table reports the median
step time over the steady steps (step 1 holds start-up costs) of all rounds, and the bytes each
rank sent in the last step, per group. Times and tokens/s vary by machine and from run to run;
bytes and the loss differences at these 12 steps do not. Chapter 05's bench_4d.py measures the
4D layouts with the same functions.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from common.launch import launch  # noqa: E402

# {layout name: (ranks, degree flags)}: the 1-rank reference first
LAYOUTS = {"1 × 1 × 1": (1, {"dp": 1, "tp": 1, "pp": 1})} | {
    f"{dp} × {tp} × {pp}": (8, {"dp": dp, "tp": tp, "pp": pp})
    for dp, tp, pp in [(8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 4, 1), (2, 2, 2), (2, 1, 4), (1, 8, 1), (1, 4, 2),
                       (1, 2, 4), (1, 1, 8)]}
BATCH = ["--global-batch", "16", "--seq-len", "128"]


def microbatches(degrees: dict) -> list[str]:
    """2·pp micro-batches where the 16 rows allow it, else as many as each data-parallel rank has rows."""
    dp, pp = degrees["dp"], degrees["pp"]
    return ["--microbatches", str(2 * pp if 16 % (dp * 2 * pp) == 0 else 16 // dp)]


def measure_layouts(script: Path, layouts: dict, flags: list[str], rounds: int, steps: int) -> tuple[dict, dict]:
    """Run every layout `rounds` times (interleaved); returns ({name: steady step times}, {name: last history})."""
    times, rows = {name: [] for name in layouts}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for i, (name, (ranks, degrees)) in enumerate(layouts.items()):
                out = Path(tmp) / f"{i}_{r}.jsonl"
                argv = [*flags, *BATCH, *microbatches(degrees), *(x for k, v in degrees.items() for x in (f"--{k}", v)),
                        "--steps", steps, "--quiet", "--sample-tokens", "0", "--val-every", "0", "--metrics", out]
                launch(script, ranks, argv, echo=False, quiet=True)
                rows[name] = [json.loads(line) for line in out.read_text().splitlines()]
                times[name] += [h["step_time_s"] for h in rows[name][1:]]
                print(f"round {r + 1}: {name}: median {statistics.median(times[name]):.3f} s/step", flush=True)
    return times, rows


def table(layouts: dict, times: dict, rows: dict, groups: tuple, header: str, context: str, command: str) -> list[str]:
    """The Markdown table: median step, tokens/s, against 1 rank, loss agreement, bytes by group."""
    ref_name = next(iter(layouts))
    ref, tokens, base = [h["loss"] for h in rows[ref_name]], rows[ref_name][0]["tokens"], statistics.median(times[ref_name])
    machine = (f"Machine: {os.cpu_count()}-core {platform.machine()} CPU, gloo, threads per rank = cores ÷ ranks "
               f"(at least 1: the 1-rank run uses {os.cpu_count()})")
    lines = [f"{machine}; {context}", f"Command: `{command}`", "",
             f"| {header} | ranks | median step (s) | tokens/s | vs 1 rank | max loss rel. diff vs 1 rank "
             f"| comm MiB/step per rank ({' / '.join(groups)}) |", "|---|---|---|---|---|---|---|"]
    for name, (ranks, _) in layouts.items():
        med = statistics.median(times[name])
        diff = max(abs(a["loss"] - b) / b for a, b in zip(rows[name], ref))
        comm = " / ".join(f"{rows[name][-1].get(f'comm_bytes_{g}', 0) / 2**20:.2f}" for g in groups)
        lines.append(f"| {name} | {ranks} | {med:.3f} | {tokens / med:,.0f} | {base / med:.2f}× | {diff:.1e} | {comm} |")
    return lines


def bench_args(description: str):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=None, help="the Markdown table's path (default: the chapter's results/)")
    return p.parse_args()


def write(out: Path, lines: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    args = bench_args(__doc__.splitlines()[0])
    times, rows = measure_layouts(HERE / "train_3d.py", LAYOUTS, ["--model", "tiny"], args.rounds, args.steps)
    context = (f"model tiny, global batch 16 × 128 tokens, micro-batches 2·pp (or as many as rows allow), 1F1B; "
               f"{args.rounds} round(s) × {args.steps} steps, median over steps 2..{args.steps}.")
    command = f"python 04_3d_combined/bench_3d.py --rounds {args.rounds} --steps {args.steps}"
    write(Path(args.out or HERE / "results" / "3d_bench.md"),
          table(LAYOUTS, times, rows, ("dp", "tp", "pp"), "dp × tp × pp", context, command))


if __name__ == "__main__":
    main()
