# %% [markdown]
# # Chapter 01, part two — ZeRO: memory per rank by stage, from real runs
#
# We launch `train_zero.py` under `torchrun` for each ZeRO stage, read each run's metrics file
# (`param_bytes`, `grad_bytes`, `optim_bytes`: what rank 0 holds at rest), and draw them stacked
# next to the formulas DP = M(1+1+α), stage 1 = 2M + αM/N, stage 2 = M + (1+α)M/N,
# stage 3 = (1+1+α)M/N, with α = 2 (AdamW's two fp32 moments).
#
# `make notebooks` executes it into `notebooks/01_zero.ipynb`; the plot is also saved under
# `notebooks/figures/`. `NOTEBOOK_QUICK=1` (the tests) runs stage 3 alone on 2 ranks for 2 steps;
# otherwise every stage on 4 ranks.

# %%
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path.cwd() if (Path.cwd() / "common").is_dir() else Path.cwd().parent   # repository root or notebooks/
sys.path.insert(0, str(ROOT))
from common.plots import show  # noqa: E402  (first: it picks the plot backend)
import matplotlib.pyplot as plt  # noqa: E402

from common.launch import launch  # noqa: E402
from common.metrics import read_metrics  # noqa: E402
from common.model import PRESETS, count_parameters  # noqa: E402

QUICK = bool(os.environ.get("NOTEBOOK_QUICK"))
N, STEPS, STAGES = (2, 2, (3,)) if QUICK else (4, 5, (1, 2, 3))
out_dir = Path(tempfile.mkdtemp(prefix="nb01z_"))

# %% [markdown]
# ## One run per stage

# %%
rows = {}
for stage in STAGES:
    metrics = out_dir / f"zero{stage}.jsonl"
    launch("01_data_parallel/train_zero.py", N,
           ["--zero-stage", stage, "--steps", STEPS, "--seq-len", "64", "--quiet", "--metrics", metrics])
    rows[stage] = read_metrics(metrics)[-1]
    print(f"stage {stage}: loss {rows[stage]['loss']:.4f}",
          {k: rows[stage][k] for k in ("param_bytes", "grad_bytes", "optim_bytes", "comm_bytes_sent")})

# %% [markdown]
# ## Measured vs formula
# Bars: what rank 0 holds, measured. Black marks: the formula. Plain DP is drawn from its formula
# (every rank holds everything: M + M + 2M).

# %%
M = count_parameters(PRESETS["tiny"]) * 4            # the tiny preset's parameters in fp32 (bytes)
formula = {0: 4 * M, 1: 2 * M + 2 * M / N, 2: M + 3 * M / N, 3: 4 * M / N}
labels = ["DP (formula)"] + [f"stage {s}" for s in STAGES]
params = [M] + [rows[s]["param_bytes"] for s in STAGES]
grads = [M] + [rows[s]["grad_bytes"] for s in STAGES]
optim = [2 * M] + [rows[s]["optim_bytes"] for s in STAGES]
mib = lambda xs: [x / 2**20 for x in xs]  # noqa: E731
fig, ax = plt.subplots(figsize=(7, 4))
ax.bar(labels, mib(params), label="params")
ax.bar(labels, mib(grads), bottom=mib(params), label="grads")
ax.bar(labels, mib(optim), bottom=[a + b for a, b in zip(mib(params), mib(grads))], label="optimizer")
ax.scatter(labels, mib([formula[s] for s in (0, *STAGES)]), color="k", marker="_", s=600, label="formula", zorder=3)
ax.set_ylabel("MiB per rank at rest")
ax.set_title(f"ZeRO memory per rank, N = {N} (measured)")
ax.legend()
show(fig, "01_zero_memory")

# %%
for s in STAGES:
    total = rows[s]["param_bytes"] + rows[s]["grad_bytes"] + rows[s]["optim_bytes"]
    print(f"stage {s}: measured {total / 2**20:.3f} MiB, formula {formula[s] / 2**20:.3f} MiB "
          f"(excess {total - formula[s]:.0f} B: padding to a multiple of N, if any)")
