"""Plots made from real runs' metrics files (JSON Lines, one object per step), and how the notebooks
show them: inline in Jupyter, and always also as a PNG file, so a headless run keeps every plot.

The PNGs go to `notebooks/figures/` (or the folder named by the NOTEBOOK_FIGURES environment
variable: the tests send them to a temporary folder).
"""
import os
import sys
from pathlib import Path

import matplotlib

if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")   # files, not windows: works headless (CI, SSH, notebooks run as scripts)
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from common.compare_metrics import relative_difference  # noqa: E402
from common.metrics import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIT_EQUAL_FLOOR = 1e-10     # a relative difference of exactly 0 is drawn here (a log axis has no 0)


def figures_dir() -> Path:
    """Where notebooks save their plots: $NOTEBOOK_FIGURES, else notebooks/figures/."""
    path = Path(os.environ.get("NOTEBOOK_FIGURES") or ROOT / "notebooks" / "figures")
    path.mkdir(parents=True, exist_ok=True)
    return path


def show(fig, name: str) -> Path:
    """Save `fig` as figures_dir()/name.png, close it, and show that PNG inline (in Jupyter).

    The notebook shows the PNG itself rather than calling `plt.show()`: that draws nothing under a
    non-interactive backend, and MPLBACKEND=Agg is common on headless servers and in containers
    (the kernel then never uses its inline backend). Closing the figure first keeps an inline backend
    from drawing it a second time at the end of the cell."""
    path = figures_dir() / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return show_png(path, name)


def show_png(png, name: str) -> Path:
    """Show a PNG another tool drew (e.g. a timeline) the same way: copied into figures_dir(), then
    displayed inline in Jupyter."""
    path = figures_dir() / f"{name}.png"
    if Path(png).resolve() != path.resolve():
        path.write_bytes(Path(png).read_bytes())
    if "ipykernel" in sys.modules:      # in a notebook's kernel
        from IPython.display import Image, display
        display(Image(filename=str(path)))
    else:
        print("plot saved:", path)
    return path


def save_figure(fig, out, note: str = "") -> Path:
    """Write `fig` to `out` (its folder made if needed), with an optional grey note at the bottom, and
    close it: what a chapter's plot command does last."""
    if note:
        fig.text(0.01, 0.005, note, fontsize=7, color="gray")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def plot_relative_difference(ax, reference: list[dict], runs: dict, key: str = "loss", tol: float = 1e-5):
    """Per step, |x - x_ref| / |x_ref| of `key` for every run against `reference` (rows of metrics
    files), on a log axis with the tolerance drawn as a line: two equal curves drawn on top of each
    other hide their difference; this shows its size. Bit-equal steps sit on the floor (1e-10)."""
    ref = {r["step"]: r[key] for r in reference}
    for label, rows in runs.items():
        steps = [r["step"] for r in rows if r["step"] in ref]
        diffs = [max(relative_difference(r[key], ref[r["step"]]), BIT_EQUAL_FLOOR) for r in rows if r["step"] in ref]
        ax.plot(steps, diffs, "o-", ms=3, lw=1.2, label=label)
    ax.axhline(tol, color="red", ls="--", lw=1, label=f"tolerance {tol:g}")
    ax.set_yscale("log")
    ax.set_ylim(BIT_EQUAL_FLOOR / 2, max(10 * tol, ax.get_ylim()[1]))
    ax.text(0.01, BIT_EQUAL_FLOOR, "bit-equal", transform=ax.get_yaxis_transform(), va="bottom",
            fontsize=7, color="gray")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"relative {key} difference vs 1 device")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)


def plot_loss_curves(runs: dict, out_path, title: str = "loss", note: str = "") -> Path:
    """runs: {label: metrics.jsonl path}. Draws training loss per step, and the validation loss
    (rows that carry `val_loss`) as markers of the same colour."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, path in runs.items():
        rows = read_metrics(path)
        line, = ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=f"{label} train".strip(), lw=1.2)
        val = [r for r in rows if r.get("val_loss") is not None]
        if val:
            ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", color=line.get_color(),
                    label=f"{label} validation".strip(), ms=4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="gray")
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path
