"""Throughput of every DP × TP × PP factorisation of 8 ranks, and of the same run on 1 rank.

    python 04_3d_combined/bench_3d.py                 # → 04_3d_combined/results/3d_bench.md, ~6 min on 2 cores
    python 04_3d_combined/bench_3d.py --rounds 2 --steps 12

Each layout trains the same model on the same batches (so the losses agree, checked here too);
only the time differs. Layouts run one after another in each round (rounds interleave the
layouts, so slow drift of the machine spreads over all of them); the table reports the median
step time over the steady steps (step 1 holds start-up costs) of all rounds.
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

LAYOUTS = [(8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 4, 1), (2, 2, 2), (2, 1, 4), (1, 8, 1), (1, 4, 2), (1, 2, 4), (1, 1, 8)]


def run(dp, tp, pp, steps, extra, out: Path) -> list[dict]:
    world = dp * tp * pp
    launch(HERE / "train_3d.py", world, ["--dp", dp, "--tp", tp, "--pp", pp, "--steps", steps, "--quiet",
                                         "--sample-tokens", "0", "--val-every", "0", "--metrics", out, *extra],
           echo=False, quiet=True)
    return [json.loads(line) for line in out.read_text().splitlines()]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=str(HERE / "results" / "3d_bench.md"))
    args = p.parse_args()
    extra = ["--global-batch", "16", "--seq-len", "128"]
    layouts = [(1, 1, 1)] + LAYOUTS
    times = {l: [] for l in layouts}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for dp, tp, pp in layouts:
                m = ["--microbatches", str(2 * pp)] if 16 % (dp * 2 * pp) == 0 else ["--microbatches", str(16 // dp)]
                hist = run(dp, tp, pp, args.steps, extra + m, Path(tmp) / f"{dp}{tp}{pp}_{r}.jsonl")
                times[(dp, tp, pp)] += [h["step_time_s"] for h in hist[1:]]
                rows[(dp, tp, pp)] = hist
                print(f"round {r + 1}: dp {dp} tp {tp} pp {pp}: median {statistics.median(times[(dp, tp, pp)]):.3f} s/step",
                      flush=True)
    ref = [h["loss"] for h in rows[(1, 1, 1)]]
    tokens = rows[(1, 1, 1)][0]["tokens"]
    lines = [f"Machine: {os.cpu_count()}-core {platform.machine()} CPU, gloo, threads per rank = cores ÷ ranks "
             f"(at least 1: the 1-rank run uses {os.cpu_count()}); model tiny, "
             f"global batch 16 × 128 tokens, micro-batches 2·pp (or as many as rows allow), 1F1B; "
             f"{args.rounds} round(s) × {args.steps} steps, median over steps 2..{args.steps}.",
             f"Command: `python 04_3d_combined/bench_3d.py --rounds {args.rounds} --steps {args.steps}`", "",
             "| dp × tp × pp | ranks | median step (s) | tokens/s | vs 1 rank | max loss rel. diff vs 1 rank | comm MiB/step per rank (dp / tp / pp) |",
             "|---|---|---|---|---|---|---|"]
    base = statistics.median(times[(1, 1, 1)])
    for l in layouts:
        med = statistics.median(times[l])
        diff = max(abs(a["loss"] - b) / b for a, b in zip(rows[l], ref))
        last = rows[l][-1]
        comm = " / ".join(f"{last.get(f'comm_bytes_{g}', 0) / 2**20:.2f}" for g in ("dp", "tp", "pp"))
        lines.append(f"| {l[0]} × {l[1]} × {l[2]} | {l[0] * l[1] * l[2]} | {med:.3f} | {tokens / med:,.0f} | "
                     f"{base / med:.2f}× | {diff:.1e} | {comm} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
