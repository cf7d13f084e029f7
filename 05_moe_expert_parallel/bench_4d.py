"""Throughput and bytes of the 4D layouts dp (= edp × ep) × tp × pp of 8 ranks, and of the same run on 1 rank.

    python 05_moe_expert_parallel/bench_4d.py           # → 05_moe_expert_parallel/results/4d_bench.md, ~4½ min on 2 cores

Chapter 04's layout benchmark (04_3d_combined/bench_3d.py: interleaved rounds, the median steady step,
bytes of the last step per group) run on train_4d.py with the mixture of experts. `dp` includes the
experts' all-reduce over edp; `ep` is the all-to-alls of dispatch and combine. Bytes are the same on
every machine; times and tokens/s are not.
"""
import sys
from importlib import import_module
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
bench_3d = import_module("04_3d_combined.bench_3d")      # chapter 04: measure_layouts, table

# (dp, ep, tp, pp): ep divides dp (the EP group is drawn from the data-parallel ranks)
LAYOUTS = {f"{dp} = {dp // ep}·ep{ep} × {tp} × {pp}": (dp * tp * pp, {"dp": dp, "ep": ep, "tp": tp, "pp": pp})
           for dp, ep, tp, pp in [(1, 1, 1, 1), (8, 8, 1, 1), (8, 4, 1, 1), (8, 2, 1, 1), (4, 4, 2, 1), (4, 4, 1, 2),
                                  (4, 2, 1, 2), (2, 2, 2, 2), (2, 2, 1, 4)]}


def main():
    args = bench_3d.bench_args(__doc__.splitlines()[0])
    times, rows = bench_3d.measure_layouts(HERE / "train_4d.py", LAYOUTS, ["--model", "tiny-moe"], args.rounds, args.steps)
    context = (f"model tiny-moe, global batch 16 × 128 tokens, micro-batches 2·pp (or as many as rows allow), 1F1B; "
               f"{args.rounds} round(s) × {args.steps} steps, median over steps 2..{args.steps}.")
    command = f"python 05_moe_expert_parallel/bench_4d.py --rounds {args.rounds} --steps {args.steps}"
    bench_3d.write(Path(args.out or HERE / "results" / "4d_bench.md"),
                   bench_3d.table(LAYOUTS, times, rows, ("dp", "tp", "pp", "ep"), "dp = edp·ep × tp × pp", context, command))


if __name__ == "__main__":
    main()
