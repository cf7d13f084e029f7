# %% [markdown]
# # Chapter 01 — data parallelism
#
# Every rank holds the whole model and trains on its slice of the global batch; an all-reduce
# sums the gradients so every replica takes the same step. This notebook
# 1. checks the one identity the chapter rests on, in this process: the sum of the slices'
#    gradients is the gradient of the whole batch (when the loss is divided by the *global* token count),
# 2. trains on 1 rank and on 2 ranks under `torchrun` and plots how far apart their losses are,
#    step by step: float32 round-off, nothing more,
# 3. reads the bytes each rank communicated per step from the metrics file and compares them with
#    the ring all-reduce formula 2(N-1)/N·M.
#
# `make notebooks` executes it into `notebooks/01_data_parallel.ipynb`; every plot is also saved under
# `notebooks/figures/`. `NOTEBOOK_QUICK=1` keeps it to a few steps (the tests run it that way).

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

from common.data import TextData, shard_rows  # noqa: E402
from common.launch import launch  # noqa: E402
from common.metrics import read_metrics  # noqa: E402
from common.model import PRESETS, build_model, loss_sum  # noqa: E402

QUICK = bool(os.environ.get("NOTEBOOK_QUICK"))
STEPS = 5 if QUICK else 40
SHAPE = ["--seq-len", "32", "--global-batch", "8"] if QUICK else []     # default: 16 × 128 tokens
out_dir = Path(tempfile.mkdtemp(prefix="nb01_"))
print("metrics files in", out_dir)

# %% [markdown]
# ## 1. Why summing gradients is exact
# Split a batch of 8 sequences into two halves ("ranks"). Each half's loss is its *summed*
# cross-entropy divided by the token count of the whole batch. Backward on each half and add the
# gradients: that is exactly the gradient of the whole batch's mean loss. (Had each half divided by
# its own token count — a local mean — the sum would be twice too large, and with unequal halves
# it would weigh tokens unequally.)

# %%
model = build_model(PRESETS["tiny"], seed=1337)
x, y = TextData(None, seq_len=32, seed=1337).global_batch(1, 8)          # (8, 32) each
n_tokens = x.numel()

model.zero_grad()
(loss_sum(model(x), y) / n_tokens).backward()
whole = torch.cat([p.grad.flatten() for p in model.parameters()])

summed = torch.zeros_like(whole)
for rank in range(2):
    model.zero_grad()
    xs, ys = shard_rows(x, rank, 2), shard_rows(y, rank, 2)             # (4, 32): this rank's rows
    (loss_sum(model(xs), ys) / n_tokens).backward()                      # divide by the GLOBAL count
    summed += torch.cat([p.grad.flatten() for p in model.parameters()])  # what the all-reduce does
print(f"max |sum of halves - whole batch| = {(summed - whole).abs().max():.2e} "
      f"(largest gradient entry {whole.abs().max():.2e})")

# %% [markdown]
# ## 2. One rank and two ranks train identically
# The same flags on 1 and 2 ranks. World size 1 is a plain `python` run; 2 ranks go through
# `torchrun`. Every rank builds the same weights from the seed and the same global batch, keeps its
# half of the rows, and the bucketed all-reduce sums the gradients.
#
# The left plot is the loss; the right one is how far each layout's loss is from it, step by step,
# relative (`python -m common.compare_metrics` prints the same numbers for any metrics files).
# Two loss curves drawn on top of each other would hide a difference of 1e-3 as well as one of 1e-7.

# %%
def train(nproc: int, impl: str) -> list[dict]:
    metrics = out_dir / f"dp_{impl}_{nproc}.jsonl"
    launch("01_data_parallel/train_dp.py", nproc,
           ["--steps", STEPS, "--impl", impl, "--quiet", "--metrics", metrics, *SHAPE])
    return read_metrics(metrics)

runs = {"1 rank": train(1, "bucketed"), "2 ranks, bucketed": train(2, "bucketed")}
if not QUICK:
    runs["2 ranks, naive"] = train(2, "naive")
    runs["2 ranks, torch DDP"] = train(2, "torch")

reference = [r["loss"] for r in runs["1 rank"]]
for label, rows in runs.items():
    diff = max(abs(r["loss"] - ref) / ref for r, ref in zip(rows, reference))
    print(f"{label:>20}: final loss {rows[-1]['loss']:.4f}, max relative difference vs 1 rank {diff:.1e}")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
ax1.plot([r["step"] for r in runs["1 rank"]], reference, lw=2, label="1 rank")
ax1.set_xlabel("optimizer step"); ax1.set_ylabel("training loss (nats / byte)"); ax1.grid(alpha=0.3)
ax1.set_title("the loss of the single-device run")
plot_relative_difference(ax2, runs["1 rank"], {k: v for k, v in runs.items() if k != "1 rank"})
ax2.set_title("every layout: its distance from that curve")
show(fig, "01_dp_loss_difference")

# %% [markdown]
# ## 3. Bytes per step against the formula
# `comm_bytes` in the metrics file is what this rank sent **plus** received, counted as a ring
# all-reduce moves it: 2(N-1)/N·M each way, M = the gradient bytes. So the file shows twice the
# one-direction formula.

# %%
M = sum(p.numel() * p.element_size() for p in model.parameters())
N = 2
row = runs["2 ranks, bucketed"][-1]
print(f"M = {M / 2**20:.2f} MiB of fp32 gradients")
print(f"formula 2(N-1)/N·M, one direction : {2 * (N - 1) / N * M / 2**20:.2f} MiB")
print(f"measured comm_bytes_sent          : {row['comm_bytes_sent'] / 2**20:.2f} MiB")
print(f"measured comm_bytes (sent + recv) : {row['comm_bytes'] / 2**20:.2f} MiB")

# %% [markdown]
# Next: `01_data_parallel/bench_dp.py` measures throughput of the three implementations at 1, 2
# and 4 ranks, and `01_data_parallel/LAB.md` has the exercises.
