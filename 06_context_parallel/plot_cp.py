"""Chapter 06's plots (bench_cp.py draws them into results/): who computes which part of the causal mask,
activation memory as S and cp grow, and the ring's timeline of compute and waits.

    python 06_context_parallel/plot_cp.py --mask 32 4 --out mask.png     # the mask plot alone, no runs needed
"""
import argparse
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters

import matplotlib

if __name__ == "__main__":
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from common.plots import save_figure  # noqa: E402

cp_split = import_module("06_context_parallel.cp_split")      # this chapter: who holds which positions

SPAN_COLORS = {"compute": "#4c72b0", "post": "#8172b3", "wait": "#c44e52"}
SPAN_LABELS = {"compute": "compute on the held K/V block", "post": "posting the next hop",
               "wait": "waiting for the next block (the transfer not hidden)"}


def mask_owners(split) -> np.ndarray:
    """(S, S): for each (query, key) score entry, the CP rank that computes it (the query's rank, in the pairs
    split.pairs gives it), or −1 where no rank computes it (a skipped pair: every key after every query)."""
    owner = np.full((split.seq_len, split.seq_len), -1)
    pos = [split.positions(r).numpy() for r in range(split.cp)]          # global position of each local row
    for q_rank in range(split.cp):
        for k_rank in range(split.cp):
            for p in split.pairs(q_rank, k_rank):
                owner[np.ix_(pos[q_rank][p.q_rows], pos[k_rank][p.k_rows])] = q_rank
    return owner


def draw_mask(ax, split) -> None:
    """The S × S score matrix, query rows down, key columns across: each computed entry in its rank's
    colour; entries above the diagonal (computed inside a cut-through pair, then masked) pale."""
    owner = mask_owners(split)
    colors = plt.get_cmap("tab10")(np.arange(split.cp))
    S = split.seq_len
    img = np.ones((S, S, 4))
    causal = np.tril(np.ones((S, S), dtype=bool))
    for r in range(split.cp):
        img[(owner == r) & causal] = colors[r]
        img[(owner == r) & ~causal] = [*colors[r][:3], 0.25]
    ax.imshow(img, interpolation="nearest")
    edges = sorted({b for r in range(split.cp) for _, b in split.chunks(r)})[:-1]
    for e in edges:                                                   # the chunk boundaries
        ax.axhline(e - 0.5, color="black", lw=0.6)
        ax.axvline(e - 0.5, color="black", lw=0.6)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_xticks([0, S - 1])
    ax.set_yticks([0, S - 1])


def draw_work(ax, split) -> None:
    """Each rank's score entries (split.work, what attn_work_imbalance compares), as bars."""
    work = [split.work(r) for r in range(split.cp)]
    colors = plt.get_cmap("tab10")(np.arange(split.cp))
    ax.bar(range(split.cp), work, color=colors)
    ax.set_xticks(range(split.cp), [f"rank {r}" for r in range(split.cp)])
    ax.set_ylabel("score entries per head and row")
    ax.set_title(f"max / min = {max(work) / min(work):.2f}", fontsize=9)


def plot_causal_mask(out, seq_len: int, cp: int, note: str = "") -> Path:
    """Contiguous and zig-zag side by side: the causal mask cut into the ranks' blocks, and each rank's work."""
    fig, axes = plt.subplots(2, 2, figsize=(9, 8.2), gridspec_kw={"height_ratios": [3, 1.2]}, layout="constrained")
    for col, name in enumerate(("contiguous", "zigzag")):
        split = cp_split.SequenceSplit(seq_len, cp, name)
        draw_mask(axes[0, col], split)
        axes[0, col].set_title(f"{name}: " + "  ".join(
            f"r{r} " + "+".join(f"{a}–{b - 1}" for a, b in split.chunks(r)) for r in range(cp)), fontsize=8)
        draw_work(axes[1, col], split)
    axes[1, 1].sharey(axes[1, 0])                                     # one scale: the bars compare across splits
    fig.suptitle(f"Causal attention, S = {seq_len}, cp = {cp}: who computes which scores (pale: computed, then "
                 "masked; white: skipped)", fontsize=10)
    return save_figure(fig, out, note)


def plot_memory(out, series: dict, note: str = "") -> Path:
    """series: {label: [(x label, bytes)]}, one bar group per x label (the same labels in every series)."""
    labels = [x for x, _ in next(iter(series.values()))]
    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.8 / len(series)
    for i, (name, points) in enumerate(series.items()):
        xs = np.arange(len(labels)) + (i - (len(series) - 1) / 2) * width
        bars = ax.bar(xs, [b / 2**20 for _, b in points], width, label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("peak activation MiB per rank")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("Activation memory per rank: the ring keeps it flat as S and cp double together", fontsize=10)
    return save_figure(fig, out, note)


def plot_ring_timeline(out, timelines: dict, titles: dict, note: str = "") -> Path:
    """timelines: {c: events} (each a list of common/timeline events with `ring_step`), one panel per c, a row
    per rank, on the one clock of common/timeline.py (the gaps between forwards are the barriers)."""
    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 1.3 + 1.4 * len(timelines)), squeeze=False)
    for ax, (c, events) in zip(axes[:, 0], timelines.items()):
        ranks = sorted({e["rank"] for e in events})
        for e in events:
            ax.barh(e["rank"], (e["end"] - e["start"]) * 1e3, left=e["start"] * 1e3, color=SPAN_COLORS[e["kind"]],
                    edgecolor="white", linewidth=0.5)
            if e["kind"] == "compute":
                ax.text((e["start"] + e["end"]) / 2 * 1e3, e["rank"], f"t{e['ring_step']}", ha="center",
                        va="center", fontsize=6, color="white")
        ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
        ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)
        ax.set_xlabel("time (ms)", fontsize=8)
        ax.set_title(titles[c], fontsize=9, loc="left")
    fig.tight_layout()
    fig.legend([plt.Rectangle((0, 0), 1, 1, color=SPAN_COLORS[k]) for k in SPAN_COLORS],
               [SPAN_LABELS[k] for k in SPAN_COLORS], loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=8)
    return save_figure(fig, out, note)




if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mask", nargs=2, type=int, metavar=("S", "CP"), required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    print(plot_causal_mask(a.out, *a.mask))
