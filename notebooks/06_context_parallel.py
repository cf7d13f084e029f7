# %% [markdown]
# # Chapter 06 — context parallelism
#
# Each rank of a CP group holds S/cp positions of every sequence; attention, the one layer that
# mixes positions, passes the K/V blocks around a ring of the CP ranks. This notebook (1) draws which
# rank computes which entries of the causal attention matrix with the contiguous and the zig-zag
# split, and each rank's work, (2) trains on 1 rank and with CP under `torchrun` and plots how far the
# losses are apart, step by step, with the ring's bytes against the formula, and (3) measures the
# activation bytes per rank as S grows, on one rank and with S and cp doubling together.
#
# `make notebooks` executes it into `notebooks/06_context_parallel.ipynb`; every plot is also saved
# under `notebooks/figures/`. `NOTEBOOK_QUICK=1` keeps it short (2 ranks, a few steps) for the tests;
# otherwise 4 ranks.

# %%
import os
import sys
import tempfile
from importlib import import_module
from pathlib import Path

ROOT = Path.cwd() if (Path.cwd() / "common").is_dir() else Path.cwd().parent   # repository root or notebooks/
sys.path.insert(0, str(ROOT))
from common.plots import plot_relative_difference, show  # noqa: E402  (first: it picks the plot backend)
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from common.launch import launch  # noqa: E402
from common.metrics import read_metrics  # noqa: E402
from common.model import PRESETS  # noqa: E402

cp_split = import_module("06_context_parallel.cp_split")
attention_bookkeeping = import_module("06_context_parallel.attention_bookkeeping")
QUICK = bool(os.environ.get("NOTEBOOK_QUICK"))
N = 2 if QUICK else 4
STEPS = 3 if QUICK else 10
SEQ, BATCH = (64, 4) if QUICK else (128, 8)      # S = 32·N: section 3 reuses section 2's runs at S = SEQ
out_dir = Path(tempfile.mkdtemp(prefix="nb06_"))


def train(name: str, nproc: int, *flags, steps: int = STEPS, seq: int = SEQ) -> list[dict]:
    metrics = out_dir / f"{name}.jsonl"
    launch("06_context_parallel/train_cp.py", nproc,
           ["--steps", steps, "--seq-len", seq, "--global-batch", BATCH, "--quiet", "--metrics", metrics, *flags])
    return read_metrics(metrics)


# %% [markdown]
# ## 1. Who computes which part of the causal mask
# The causal attention matrix of one sequence (query position down, key position across), S = 16,
# cp = 4. Each computed entry is coloured by the rank whose queries it belongs to; white above the
# diagonal: skipped pairs (every key after every query) and masked entries. With the contiguous
# split rank r computes r+1 blocks, so the last rank does cp times the first's work; zig-zag gives
# rank r chunks r and 2cp−1−r, and every rank computes 2cp+1 chunk pairs.

# %%
S, CP = 16, 4
fig, axes = plt.subplots(1, 3, figsize=(12, 4), gridspec_kw={"width_ratios": [1, 1, 1.1]})
colours = plt.get_cmap("tab10")
work = {}
for ax, name in zip(axes, ("contiguous", "zigzag")):
    split = cp_split.SequenceSplit(S, CP, name)
    owner = np.full((S, S), np.nan)                       # rank computing (query i, key j), NaN: not computed
    for r in range(CP):
        q_pos = split.positions(r)
        for k_rank in range(CP):
            k_pos = split.positions(k_rank)
            for p in split.pairs(r, k_rank):
                for i in q_pos[p.q_rows].tolist():
                    for j in k_pos[p.k_rows].tolist():
                        if j <= i:                        # the causal mask keeps j ≤ i
                            owner[i, j] = r
    ax.imshow(owner, cmap=plt.matplotlib.colors.ListedColormap([colours(r) for r in range(CP)]), vmin=-0.5,
              vmax=CP - 0.5)
    ax.set_title(f"{name}: rank of each computed entry")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    work[name] = [split.work(r) for r in range(CP)]
axes[0].legend(handles=[plt.matplotlib.patches.Patch(color=colours(r), label=f"rank {r}") for r in range(CP)],
               loc="upper right", fontsize=8)
x = np.arange(CP)
for i, (name, shade) in enumerate(zip(work, ("silver", "dimgray"))):
    axes[2].bar(x + (i - 0.5) * 0.4, work[name], 0.4, color=shade,
                label=f"{name} (max/min {max(work[name]) / min(work[name]):.0f})")
axes[2].set_xticks(x, [f"rank {r}" for r in range(CP)])
axes[2].set_ylabel("score entries per head and sequence")
axes[2].set_title("attention work per rank")
axes[2].legend(fontsize=8)
fig.tight_layout()
for name, w in work.items():
    print(f"{name:<10} work per rank {w}  (computed whole: masked halves of diagonal pairs included)")
show(fig, "06_cp_attention_work")

# %% [markdown]
# ## 2. The same losses with the sequence split over ranks
# One rank (plain `scaled_dot_product_attention`), then CP = N with the ring (zig-zag), and in the
# full mode also the contiguous split, the all-gather variant and CP 2 × DP 2. The plot shows each
# run's relative loss difference from the single device, per step: round-off (about 1e-7). Below it,
# the ring's bytes per step against the formula (attention_bookkeeping.cp_bytes × 8 layers), and the work
# imbalance each run measured.

# %%
runs = {"1 rank": train("ref", 1), f"cp {N} ring zigzag": train(f"cp{N}", N)}
if not QUICK:
    runs[f"cp {N} contiguous"] = train(f"cp{N}c", N, "--cp-split", "contiguous")
    runs[f"cp {N} allgather"] = train(f"cp{N}ag", N, "--cp-attention", "allgather")
    runs["cp 2 × dp 2"] = train("cp2dp2", N, "--cp", 2)
cfg = PRESETS["tiny"]
for label, rows in runs.items():
    last = rows[-1]
    formula = cfg.n_layers * attention_bookkeeping.cp_bytes(last["cp_attention"], BATCH // last["dp"], SEQ, last["cp"],
                                                     cfg.n_kv_heads, cfg.head_dim, 4)
    print(f"{label:<20} losses {[round(r['loss'], 5) for r in rows[:4]]}...  cp bytes/step {last['comm_bytes_cp']:,} "
          f"(formula {formula:,})  work max/min {last['attn_work_imbalance']}")
fig, ax = plt.subplots(figsize=(7, 3.8))
plot_relative_difference(ax, runs["1 rank"], {k: v for k, v in runs.items() if k != "1 rank"})
ax.set_title("loss vs 1 rank: context parallelism changes only the order of float32 additions", fontsize=10)
show(fig, "06_cp_loss_difference")

# %% [markdown]
# ## 3. Activation bytes per rank: flat as S and cp double together
# `peak_activation_bytes` is what autograd saves for the backward on a rank. On one rank it grows
# with S; with CP each rank holds S/cp positions and the ring saves only its own K/V block, so at a
# fixed S/cp = 32 the bytes stay where S = 32 on one rank puts them.

# %%
lengths = [32 * 2 ** i for i in range(N.bit_length())]          # 32, 64 (, 128): cp = S/32 up to N
one_rank, with_cp = [], []
for s in lengths:      # at S = SEQ (cp = N) section 2's runs have the same shape: their first step is this one
    first = runs["1 rank"][0] if s == SEQ else train(f"act_s{s}_cp1", 1, steps=1, seq=s)[0]
    one_rank.append(first["peak_activation_bytes"])
    cp = s // 32
    if cp == 1:
        with_cp.append(one_rank[-1])
    else:
        first = runs[f"cp {N} ring zigzag"][0] if s == SEQ else train(f"act_s{s}_cp{cp}", cp, steps=1, seq=s)[0]
        with_cp.append(first["peak_activation_bytes"])
    print(f"S {s:>3}: one rank {one_rank[-1] / 2**20:6.2f} MiB   cp {cp}: {with_cp[-1] / 2**20:6.2f} MiB per rank")
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(lengths, [b / 2**20 for b in one_rank], "o-", label="one rank")
ax.plot(lengths, [b / 2**20 for b in with_cp], "s-", label="cp = S/32 (32 positions per rank)")
ax.set_xscale("log", base=2)
ax.set_xticks(lengths, [str(s) for s in lengths])
ax.set_xlabel("sequence length S")
ax.set_ylabel("peak activation MiB (rank 0)")
ax.set_title(f"activations per rank, {BATCH} sequences per step")
ax.set_ylim(bottom=0)
ax.legend()
ax.grid(alpha=0.3)
show(fig, "06_cp_activation_bytes")
