# %% [markdown]
# # Chapter 01, part two — ZeRO: memory per rank by stage, from real runs
#
# We launch `train_zero.py` under `torchrun` for each ZeRO stage, read each run's metrics file
# (`param_bytes`, `grad_bytes`, `optim_bytes`: what rank 0 holds at rest), and draw them stacked
# next to the formulas DP = M(1+1+α), stage 1 = 2M + αM/N, stage 2 = M + (1+α)M/N,
# stage 3 = (1+1+α)M/N, with α = 2 (AdamW's two fp32 moments).
#
# `NOTEBOOK_QUICK=1` runs 2 ranks and 2 steps (headless tests); otherwise 4 ranks.

# %%
import json
import os
import sys
import tempfile
from pathlib import Path

import matplotlib
if os.environ.get("NOTEBOOK_QUICK"):
    matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path.cwd() if (Path.cwd() / "common").is_dir() else Path.cwd().parent
sys.path.insert(0, str(ROOT))
from common.launch import launch  # noqa: E402

QUICK = bool(os.environ.get("NOTEBOOK_QUICK"))
N, STEPS = (2, 2) if QUICK else (4, 5)
out_dir = Path(tempfile.mkdtemp())

# %% [markdown]
# ## One run per stage

# %%
rows = {}
for stage in (1, 2, 3):
    metrics = out_dir / f"zero{stage}.jsonl"
    launch("01_data_parallel/train_zero.py", N,
           ["--zero-stage", stage, "--steps", STEPS, "--seq-len", "64", "--quiet", "--metrics", metrics])
    rows[stage] = [json.loads(line) for line in metrics.read_text().splitlines()][-1]
    print(f"stage {stage}: loss {rows[stage]['loss']:.4f}",
          {k: rows[stage][k] for k in ("param_bytes", "grad_bytes", "optim_bytes", "comm_bytes_sent")})

# %% [markdown]
# ## Measured vs formula

# %%
M = 1_640_576 * 4            # the tiny preset's parameters in fp32
formula = {0: 4 * M, 1: 2 * M + 2 * M / N, 2: M + 3 * M / N, 3: 4 * M / N}
labels = ["DP (formula)"] + [f"stage {s}" for s in (1, 2, 3)]
params = [M] + [rows[s]["param_bytes"] for s in (1, 2, 3)]
grads = [M] + [rows[s]["grad_bytes"] for s in (1, 2, 3)]
optim = [2 * M] + [rows[s]["optim_bytes"] for s in (1, 2, 3)]
mib = lambda xs: [x / 2**20 for x in xs]
fig, ax = plt.subplots(figsize=(7, 4))
ax.bar(labels, mib(params), label="params")
ax.bar(labels, mib(grads), bottom=mib(params), label="grads")
ax.bar(labels, mib(optim), bottom=[a + b for a, b in zip(mib(params), mib(grads))], label="optimizer")
ax.scatter(labels, mib([formula[s] for s in (0, 1, 2, 3)]), color="k", marker="_", s=600, label="formula", zorder=3)
ax.set_ylabel("MiB per rank at rest")
ax.set_title(f"ZeRO memory per rank, N = {N} (measured)")
ax.legend()
plt.show()

# %%
for s in (1, 2, 3):
    total = rows[s]["param_bytes"] + rows[s]["grad_bytes"] + rows[s]["optim_bytes"]
    print(f"stage {s}: measured {total / 2**20:.3f} MiB, formula {formula[s] / 2**20:.3f} MiB "
          f"(excess {total - formula[s]:.0f} B: padding to a multiple of N, if any)")
