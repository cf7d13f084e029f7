# %% [markdown]
# # Chapter 04 — DP × TP × PP on one mesh
#
# The full pretraining run composes the three chapters: each rank holds one TP shard of one
# pipeline stage of one data-parallel replica. This notebook (1) prints the rank grid for 8 ranks,
# (2) runs the same training in several layouts under `torchrun` and checks that the losses are the
# single-device losses, and (3) plots the loss curve (training and validation), how far each layout
# is from it step by step, and the bytes each group moved.
#
# `make notebooks` executes it into `notebooks/04_3d_combined.ipynb`; every plot is also saved under
# `notebooks/figures/`. `NOTEBOOK_QUICK=1` keeps it short (one 4-rank layout, 2 steps) for the tests.

# %%
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path.cwd() if (Path.cwd() / "common").is_dir() else Path.cwd().parent   # repository root or notebooks/
sys.path.insert(0, str(ROOT))
from common.plots import plot_relative_difference, show  # noqa: E402  (first: it picks the plot backend)
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from common.launch import launch  # noqa: E402
from common.metrics import read_metrics  # noqa: E402

QUICK = bool(os.environ.get("NOTEBOOK_QUICK"))
STEPS = 2 if QUICK else 30
out_dir = Path(tempfile.mkdtemp(prefix="nb04_"))

# %% [markdown]
# ## 1. The grid: `arange(world).view(dp, pp, tp)`
# TP varies fastest, so a TP group is consecutive ranks (one node); DP is the outermost dimension.

# %%
grid = torch.arange(8).view(2, 2, 2)           # (dp, pp, tp)
for d in range(2):
    for p in range(2):
        print(f"dp={d} pp={p}: tp group {grid[d, p].tolist()}")
print("pp groups:", [grid[d, :, t].tolist() for d in range(2) for t in range(2)])
print("dp groups:", [grid[:, p, t].tolist() for p in range(2) for t in range(2)])

# %% [markdown]
# ## 2. Same losses in every layout

# %%
def run(nproc, *flags):
    metrics = out_dir / f"m{nproc}_{'_'.join(flags)}.jsonl"
    launch("04_3d_combined/train_3d.py", nproc,
           ["--steps", STEPS, "--seq-len", "32", "--global-batch", "8", "--val-every", "2", "--sample-tokens", "0",
            "--quiet", "--metrics", metrics, *flags])
    return read_metrics(metrics)


runs = {"1 rank": run(1)}
layouts = [("--dp", "1", "--tp", "2", "--pp", "2")]
if not QUICK:
    layouts += [("--dp", "2", "--tp", "1", "--pp", "2"), ("--dp", "2", "--tp", "2", "--pp", "2"),
                ("--dp", "1", "--tp", "2", "--pp", "4")]
for flags in layouts:
    nproc = int(flags[1]) * int(flags[3]) * int(flags[5])
    runs[f"dp{flags[1]} tp{flags[3]} pp{flags[5]}"] = run(nproc, *flags)
ref = [r["loss"] for r in runs["1 rank"]]
for name, hist in runs.items():
    diff = max(abs(r["loss"] - x) / x for r, x in zip(hist, ref))
    print(f"{name:>16}: losses {[round(r['loss'], 4) for r in hist]}  max rel diff {diff:.1e}")

# %% [markdown]
# ## 3. The loss, each layout's distance from it, and who talks how much

# %%
fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
one = runs["1 rank"]
ax1.plot([r["step"] for r in one], [r["loss"] for r in one], label="train")
val = [r for r in one if r.get("val_loss") is not None]
ax1.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", ms=4, label="validation")
ax1.set_xlabel("step"); ax1.set_ylabel("loss (nats / byte)"); ax1.legend(); ax1.set_title("1 rank: the reference")
names = [n for n in runs if n != "1 rank"]
plot_relative_difference(ax2, one, {n: runs[n] for n in names})
ax2.set_title("every layout vs 1 rank")
for i, g in enumerate(("dp", "tp", "pp")):
    ax3.bar([x + 0.25 * i for x in range(len(names))], [runs[n][-1][f"comm_bytes_{g}"] / 2**20 for n in names],
            width=0.25, label=g)
ax3.set_xticks([x + 0.25 for x in range(len(names))], names); ax3.set_ylabel("MiB per step, rank 0"); ax3.legend()
ax3.set_title("bytes sent + received by rank 0, by group")
fig.tight_layout()
show(fig, "04_3d_loss_difference_and_bytes")
