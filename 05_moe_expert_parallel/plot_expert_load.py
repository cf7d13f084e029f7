"""Expert load over training, drawn from metrics files (`expert_load`: per step, layers × experts).

    python 05_moe_expert_parallel/plot_expert_load.py OUT.png LABEL=run.jsonl [LABEL=run.jsonl ...]

One heat map per run: a row per (layer, expert), a column per step, the colour the expert's share of
its layer's slots relative to a uniform share (1 = balanced; log scale, so 1/4 and 4 are equally far
from white). Under them, max/mean load per step (mean over layers) for every run on one axis.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common.plots  # noqa: E402,F401  (first: it picks the plot backend, inline in Jupyter, files elsewhere)
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

from common.metrics import read_metrics  # noqa: E402
from common.plots import save_figure  # noqa: E402


def load_over_mean(rows: list[dict]) -> np.ndarray:
    """(L·E, steps): each expert's load divided by its layer's mean load, rows layer by layer."""
    load = np.array([r["expert_load"] for r in rows], dtype=float)        # (steps, L, E)
    ratio = load / load.mean(axis=2, keepdims=True)
    steps, L, E = ratio.shape
    return ratio.transpose(1, 2, 0).reshape(L * E, steps)


def draw_expert_load(runs: dict, note: str = ""):
    """runs: {label: metrics path}. Returns the figure."""
    data = {label: read_metrics(path) for label, path in runs.items()}
    n = len(data)
    fig = plt.figure(figsize=(4.2 * n, 7.2))
    grid = fig.add_gridspec(2, n, height_ratios=[3, 1.2])
    norm = LogNorm(vmin=1 / 8, vmax=8)
    image = None
    for i, (label, rows) in enumerate(data.items()):
        ax = fig.add_subplot(grid[0, i])
        ratio = np.clip(load_over_mean(rows), 1 / 8, 8)
        L, E = len(rows[0]["expert_load"]), len(rows[0]["expert_load"][0])
        image = ax.imshow(ratio, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest",
                          extent=(rows[0]["step"] - 0.5, rows[-1]["step"] + 0.5, L * E - 0.5, -0.5))
        for layer in range(1, L):
            ax.axhline(layer * E - 0.5, color="black", lw=0.5)
        ax.set_yticks([layer * E + E / 2 - 0.5 for layer in range(L)],
                      [f"layer {layer}" for layer in range(L)] if i == 0 else [], fontsize=7)
        ax.set_xlabel("step")
        ax.set_title(f"{label}\nmax/mean at the end: {rows[-1]['max_over_mean_load']:.2f}", fontsize=9)
    ticks = [1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8]
    bar = fig.colorbar(image, ax=fig.axes, shrink=0.6, label="expert load / layer mean (one row per expert)")
    bar.set_ticks(ticks, labels=["≤1/8", "1/4", "1/2", "1", "2", "4", "≥8"])
    bar.minorticks_off()
    ax = fig.add_subplot(grid[1, :])
    for label, rows in data.items():
        ax.plot([r["step"] for r in rows], [r["max_over_mean_load"] for r in rows], label=label)
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean load\n(mean over layers)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if note:
        fig.text(0.01, 0.005, note, fontsize=7, color="gray")
    return fig


def plot_expert_load(runs: dict, out_path, note: str = "") -> Path:
    """draw_expert_load, written to `out_path`."""
    return save_figure(draw_expert_load(runs, note), out_path)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    print(plot_expert_load(dict(arg.split("=", 1) for arg in sys.argv[2:]), sys.argv[1]))
