"""Plots made from real runs' metrics files (JSON Lines, one object per step)."""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")   # files, not windows: works headless (CI, SSH, notebooks run as scripts)
import matplotlib.pyplot as plt  # noqa: E402

from common.metrics import read_metrics  # noqa: E402


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
