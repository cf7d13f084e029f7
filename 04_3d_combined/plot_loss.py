"""Draw the loss curve (training and validation) of one or more runs from their metrics files.

    python 04_3d_combined/plot_loss.py runs/3d/metrics.jsonl                       # → runs/3d/loss.png
    python 04_3d_combined/plot_loss.py a.jsonl b.jsonl --labels 1-rank 8-rank --out cmp.png
"""
import argparse
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.plots import plot_loss_curves  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", nargs="+", help="metrics .jsonl files written with --metrics")
    p.add_argument("--labels", nargs="*", default=None, help="one label per file (default: the file names)")
    p.add_argument("--out", default=None, help="PNG to write (default: loss.png beside the first file)")
    p.add_argument("--title", default="3D parallel pretraining: loss", help="figure title")
    args = p.parse_args(argv)
    labels = args.labels or ([""] if len(args.metrics) == 1 else [str(Path(m).with_suffix("")) for m in args.metrics])
    out = Path(args.out) if args.out else Path(args.metrics[0]).with_name("loss.png")
    note = f"{platform.machine()} CPU, {platform.system()}; from {', '.join(args.metrics)}"
    print(plot_loss_curves(dict(zip(labels, args.metrics)), out, args.title, note))


if __name__ == "__main__":
    main()
