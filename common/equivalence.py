"""How far does each layout drift from the single device, step after step, in fp32 and in bf16?

    python -m common.equivalence --out runs/equivalence       # 50 steps, fp32 and bf16
    python -m common.equivalence --steps 20 --dtypes fp32
    python -m common.equivalence --out runs/equivalence --reuse --key grad_norm   # the same runs, another metric

Every layout adds the same numbers in another order, so its loss is the single-device loss up to
round-off. The round-off does not stay put: AdamW divides each update by the running RMS of the
gradients, so a gradient that differs in its 7th digit moves the weights by a relative amount far
larger than 1e-7 where the RMS is small, and the next step's loss inherits it. This script measures
that growth: one reference run on one rank, then a data-parallel, a tensor-parallel, a pipeline and
the default 3D layout with the same flags (in bf16: data and tensor parallelism), each compared
with the reference by `common.compare_metrics`. It prints, for each layout and dtype, the largest
relative loss difference over the first 5, 10, 20, ... steps. The root README shows its table.

In bf16 (autocast: matmul results rounded to 8 bits of mantissa) one rounding costs up to
2⁻⁹ ≈ 2e-3 relative instead of fp32's 6e-8, and a layout that splits a sum (DP's half-batch weight
gradients, TP's partial products) rounds the parts instead of the whole, so its differences are
orders of magnitude larger than in fp32.
"""
import argparse
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):          # run as `python common/equivalence.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.compare_metrics import compare  # noqa: E402
from common.launch import launch  # noqa: E402
from common.metrics import read_metrics  # noqa: E402

REFERENCE = ("1 rank", "01_data_parallel/train_dp.py", 1, [])
LAYOUTS = [("DP 2 (bucketed)", "01_data_parallel/train_dp.py", 2, []),
           ("TP 4", "02_tensor_parallel/train_tp.py", 4, []),
           ("1F1B p=4", "03_pipeline_parallel/train_1f1b.py", 4, []),
           ("3D dp2×tp2×pp2", "04_3d_combined/train_3d.py", 8, ["--sample-tokens", "0"])]
BF16_LAYOUTS = LAYOUTS[:2]      # bf16 autocast is slow on CPU: two layouts show the size of its differences


def run_once(script: str, nproc: int, args: list, metrics: Path, steps: int, reuse: bool) -> None:
    """Launch one run, unless `reuse` and its metrics file already holds all `steps` steps."""
    if reuse and metrics.exists() and len(read_metrics(metrics)) == steps:
        print("reusing", metrics)
        return
    launch(script, nproc, [*args, "--metrics", metrics])


def drift_table(steps: int, dtypes: list[str], out_dir: Path, marks: list[int], reuse: bool,
                key: str = "loss") -> list[list[str]]:
    """Rows of the table: layout, dtype, then the largest relative difference of `key` up to each mark."""
    rows = []
    for dtype in dtypes:
        layouts = LAYOUTS if dtype == "fp32" else BF16_LAYOUTS
        files = []
        for label, script, nproc, flags in [REFERENCE] + layouts:
            metrics = out_dir / f"{dtype}_{label.split()[0]}_{nproc}.jsonl"
            run_once(script, nproc, ["--steps", steps, "--dtype", dtype, "--quiet", *flags], metrics, steps, reuse)
            files.append(metrics)
        result = compare(files, key)
        for (label, *_), per_step in zip(layouts, result["diffs"].values()):
            rows.append([label, dtype] + [f"{max(d for s, d in per_step.items() if s <= k):.1e}" for k in marks])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=50, help="steps of every run")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--out", default=None, help="keep the metrics files here (default: a temporary folder)")
    parser.add_argument("--reuse", action="store_true", help="skip runs whose metrics file in --out is complete")
    parser.add_argument("--key", default="loss", help="which metric to compare (loss, grad_norm, ...)")
    args = parser.parse_args()
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="equivalence_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    marks = [k for k in (5, 10, 20, 50, 100) if k < args.steps] + [args.steps]
    rows = drift_table(args.steps, args.dtypes, out_dir, marks, args.reuse, args.key)
    header = ["layout", "dtype"] + [f"max over steps 1–{k}" for k in marks]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\nrelative {args.key} difference vs {REFERENCE[0]} ({REFERENCE[1]}); metrics files in {out_dir}")


if __name__ == "__main__":
    main()
