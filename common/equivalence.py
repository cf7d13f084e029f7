"""How far does each layout drift from the single device, step after step, in fp32 and in bf16?

    python -m common.equivalence                     # 50 steps, fp32 and bf16 (about 10 minutes on 2 cores)
    python -m common.equivalence --steps 20 --dtypes fp32

Every layout adds the same numbers in another order, so its loss is the single-device loss up to
round-off. The round-off does not stay put: AdamW divides each update by the running RMS of the
gradients, so a gradient that differs in its 7th digit moves the weights by a relative amount far
larger than 1e-7 where the RMS is small, and the next step's loss inherits it. This script measures
that growth: one reference run on one rank, then a data-parallel, a tensor-parallel, a pipeline and
the default 3D layout with the same flags, each compared with the reference by
`common.compare_metrics`. It prints, for each layout and dtype, the largest relative loss difference
over the first 10, 20, ... steps. The root README shows its table.

In bf16 (autocast: matmuls in bfloat16, 8 bits of mantissa) round-off is ~4e-3 relative per
operation instead of ~6e-8, and a layout that splits a matmul differently rounds differently, so the
differences are four to five orders of magnitude larger than in fp32.
"""
import argparse
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):          # run as `python common/equivalence.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.compare_metrics import compare  # noqa: E402
from common.launch import launch  # noqa: E402

REFERENCE = ("1 rank", "01_data_parallel/train_dp.py", 1, [])
LAYOUTS = [("DP 2 (bucketed)", "01_data_parallel/train_dp.py", 2, []),
           ("TP 4", "02_tensor_parallel/train_tp.py", 4, []),
           ("1F1B p=4", "03_pipeline_parallel/train_1f1b.py", 4, []),
           ("3D dp2×tp2×pp2", "04_3d_combined/train_3d.py", 8, ["--sample-tokens", "0"])]


def drift_table(steps: int, dtypes: list[str], out_dir: Path, marks: list[int]) -> list[list[str]]:
    """Rows of the table: layout, dtype, then the largest relative loss difference up to each mark."""
    rows = []
    for dtype in dtypes:
        files = []
        for label, script, nproc, flags in [REFERENCE] + LAYOUTS:
            metrics = out_dir / f"{dtype}_{label.split()[0]}_{nproc}.jsonl"
            launch(script, nproc, ["--steps", steps, "--dtype", dtype, "--quiet", "--metrics", metrics, *flags])
            files.append(metrics)
        result = compare(files)
        for (label, *_), per_step in zip(LAYOUTS, result["diffs"].values()):
            rows.append([label, dtype] + [f"{max(d for s, d in per_step.items() if s <= k):.1e}" for k in marks])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=50, help="steps of every run")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--out", default=None, help="keep the metrics files here (default: a temporary folder)")
    args = parser.parse_args()
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="equivalence_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    marks = [k for k in (5, 10, 20, 50, 100) if k < args.steps] + [args.steps]
    rows = drift_table(args.steps, args.dtypes, out_dir, marks)
    header = ["layout", "dtype"] + [f"max over steps 1–{k}" for k in marks]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\nrelative loss difference vs {REFERENCE[0]} ({REFERENCE[1]}); metrics files in {out_dir}")


if __name__ == "__main__":
    main()
