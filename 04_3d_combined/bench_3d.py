"""Throughput of every DP × TP × PP factorisation of 8 ranks, and of the same run on 1 rank; with
--model tiny-moe, of the 4D layouts DP·EP × TP × PP of the mixture of experts.

    python 04_3d_combined/bench_3d.py                     # → 04_3d_combined/results/3d_bench.md, ~4 min on 2 cores
    python 04_3d_combined/bench_3d.py --model tiny-moe    # → 04_3d_combined/results/3d_moe_bench.md, ~4½ min
    python 04_3d_combined/bench_3d.py --rounds 2 --steps 12

Each layout trains the same model on the same batches (so the losses agree, checked here too);
only the time differs. Layouts run one after another in each round (rounds interleave the
layouts, so slow drift of the machine spreads over all of them); the table reports the median
step time over the steady steps (step 1 holds start-up costs) of all rounds, and the bytes each
rank sent in the last step, per group (dp includes the experts' EDP all-reduce; ep is the
all-to-alls of dispatch and combine).
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

# (dp, ep, tp, pp): ep divides dp (the EP group is drawn from the data-parallel ranks)
LAYOUTS = {"tiny": [(8, 1, 1, 1), (4, 1, 2, 1), (4, 1, 1, 2), (2, 1, 4, 1), (2, 1, 2, 2), (2, 1, 1, 4), (1, 1, 8, 1),
                    (1, 1, 4, 2), (1, 1, 2, 4), (1, 1, 1, 8)],
           "tiny-moe": [(8, 8, 1, 1), (8, 4, 1, 1), (8, 2, 1, 1), (4, 4, 2, 1), (4, 4, 1, 2), (4, 2, 1, 2), (2, 2, 2, 2),
                        (2, 2, 1, 4)]}
GROUPS = {"tiny": ("dp", "tp", "pp"), "tiny-moe": ("dp", "tp", "pp", "ep")}


def run(model, dp, ep, tp, pp, steps, extra, out: Path) -> list[dict]:
    degrees = ["--dp", dp, "--tp", tp, "--pp", pp] + (["--ep", ep] if model != "tiny" else [])
    launch(HERE / "train_3d.py", dp * tp * pp, ["--model", model, *degrees, "--steps", steps, "--quiet",
                                                "--sample-tokens", "0", "--val-every", "0", "--metrics", out, *extra],
           echo=False, quiet=True)
    return [json.loads(line) for line in out.read_text().splitlines()]


def name(model, dp, ep, tp, pp) -> str:
    return f"{dp} × {tp} × {pp}" if model == "tiny" else f"{dp}·ep{ep} × {tp} × {pp}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=sorted(LAYOUTS))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=None, help="default: results/3d_bench.md, or 3d_moe_bench.md for tiny-moe")
    p.add_argument("--machine", default=None, help="the machine line of the table (default: cores and architecture)")
    args = p.parse_args()
    out = Path(args.out or HERE / "results" / ("3d_bench.md" if args.model == "tiny" else "3d_moe_bench.md"))
    extra = ["--global-batch", "16", "--seq-len", "128"]
    layouts = [(1, 1, 1, 1)] + LAYOUTS[args.model]
    times = {l: [] for l in layouts}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for dp, ep, tp, pp in layouts:
                m = ["--microbatches", str(2 * pp)] if 16 % (dp * 2 * pp) == 0 else ["--microbatches", str(16 // dp)]
                hist = run(args.model, dp, ep, tp, pp, args.steps, extra + m, Path(tmp) / f"{dp}{ep}{tp}{pp}_{r}.jsonl")
                times[(dp, ep, tp, pp)] += [h["step_time_s"] for h in hist[1:]]
                rows[(dp, ep, tp, pp)] = hist
                print(f"round {r + 1}: {name(args.model, dp, ep, tp, pp)}: "
                      f"median {statistics.median(times[(dp, ep, tp, pp)]):.3f} s/step", flush=True)
    ref = [h["loss"] for h in rows[(1, 1, 1, 1)]]
    tokens = rows[(1, 1, 1, 1)][0]["tokens"]
    groups = GROUPS[args.model]
    machine = args.machine or (f"Machine: {os.cpu_count()}-core {platform.machine()} CPU, gloo, threads per rank = "
                               f"cores ÷ ranks (at least 1: the 1-rank run uses {os.cpu_count()})")
    lines = [f"{machine}; model {args.model}, global batch 16 × 128 tokens, micro-batches 2·pp (or as many as rows "
             f"allow), 1F1B; {args.rounds} round(s) × {args.steps} steps, median over steps 2..{args.steps}.",
             f"Command: `python 04_3d_combined/bench_3d.py --model {args.model} --rounds {args.rounds} --steps {args.steps}`",
             "", f"| {'dp × tp × pp' if args.model == 'tiny' else 'dp·ep × tp × pp'} | ranks | median step (s) | tokens/s "
             f"| vs 1 rank | max loss rel. diff vs 1 rank | comm MiB/step per rank ({' / '.join(groups)}) |",
             "|---|---|---|---|---|---|---|"]
    base = statistics.median(times[(1, 1, 1, 1)])
    for l in layouts:
        med = statistics.median(times[l])
        diff = max(abs(a["loss"] - b) / b for a, b in zip(rows[l], ref))
        last = rows[l][-1]
        comm = " / ".join(f"{last.get(f'comm_bytes_{g}', 0) / 2**20:.2f}" for g in groups)
        lines.append(f"| {name(args.model, *l)} | {l[0] * l[2] * l[3]} | {med:.3f} | {tokens / med:,.0f} | "
                     f"{base / med:.2f}× | {diff:.1e} | {comm} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
