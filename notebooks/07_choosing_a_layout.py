# %% [markdown]
# # Chapter 07 — choosing a layout
#
# The planner enumerates every layout the chapters' scripts accept, predicts each one's memory, bytes,
# bubble and step time from the earlier chapters' formulas, and ranks them. This notebook (1) plans the
# tiny model on 8 ranks of this CPU and draws the first layouts' memory by component, (2) checks one of
# them against a real run, byte for byte, and (3) draws where the time of Llama 3 405B's published layout
# goes, against the planner's first choice.
#
# `make notebooks` executes it into `notebooks/07_choosing_a_layout.ipynb`; every plot is also saved
# under `notebooks/figures/`. `NOTEBOOK_QUICK=1` (the tests) skips part 2's run and plans torchtitan's
# Llama 3.1 8B on 8 H100s in part 3 instead of Llama 3 405B on 16,384 H100s (a minute of planning).

# %%
import os
import sys
import tempfile
from importlib import import_module
from pathlib import Path

ROOT = Path.cwd() if (Path.cwd() / "common").is_dir() else Path.cwd().parent   # repository root or notebooks/
sys.path.insert(0, str(ROOT))
from common.plots import show  # noqa: E402  (first: it picks the plot backend)
import matplotlib.pyplot as plt  # noqa: E402

from common.launch import launch  # noqa: E402
from common.metrics import read_metrics  # noqa: E402

choose_layout = import_module("07_choosing_a_layout.choose_layout")
check_layouts = import_module("07_choosing_a_layout.check_layouts")
out_dir = Path(tempfile.mkdtemp(prefix="nb07_"))
QUICK = bool(os.environ.get("NOTEBOOK_QUICK"))

# %% [markdown]
# ## 1. The tiny model on 8 ranks: what each of the first layouts holds
# Every row is a layout `train_3d.py` (or `train_4d.py`, `train_5d.py`) accepts; the bar is its fullest
# pipeline rank at the peak of a step, by component.

# %%
rows = choose_layout.main(["--model", "tiny", "--world", "8", "--device", "cpu", "--top", "5", "--why", "1"])
shown = rows[:8]
fig, ax = plt.subplots(figsize=(10, 4.5))
check_layouts.memory_bars(ax, shown, [choose_layout.describe(r) for r in shown], unit=2**20)
ax.set_xlabel("MiB on the fullest pipeline rank")
ax.set_title("the planner's first layouts for tiny on 8 CPU ranks")
ax.legend(fontsize=8)
fig.tight_layout()
show(fig, "07_first_layouts_memory")

# %% [markdown]
# ## 2. One of them, run: the bytes by group, predicted and measured
# dp 4 × pp 2 (1F1B, 4 micro-batches), two steps; rank 0's bytes per group in the last step.

# %%
mine = next(r for r in rows if (r["dp"], r["tp"], r["pp"], r["zero_stage"], r["recompute"], r["schedule"],
                                r["microbatches"]) == (4, 1, 2, 0, "none", "1f1b", 4))
metrics = out_dir / "dp4pp2.jsonl"
if not QUICK:      # the quick mode (the tests) leaves the run to tests/test_choose_layout.py and chapter 07's LAB
    launch("04_3d_combined/train_3d.py", 8, ["--dp", 4, "--tp", 1, "--pp", 2, "--microbatches", 4, "--global-batch",
                                             16, "--seq-len", 128, "--steps", 2, "--quiet", "--sample-tokens", 0,
                                             "--metrics", metrics])
    last = read_metrics(metrics)[-1]
    for g in ("dp", "tp", "pp"):
        print(f"{g}: predicted {mine['comm_bytes'][g]:>12,}   measured {last[f'comm_bytes_{g}']:>12,}")

# %% [markdown]
# ## 3. A published run: where the step goes
# Llama 3 405B on 16,384 H100s (Llama 3.1 8B on 8 H100s in the quick mode): the published layout against
# the planner's first choice, each step split into its parts.

# %%
published = import_module("07_choosing_a_layout.published")
run = published.BY_NAME["torchtitan-llama3-8b" if QUICK else "llama3-405b-8k-16384gpu"]
planned = choose_layout.main(["--explain", run.name, "--top", "3", "--why", "1"])
pub = next(r for r in planned if published.matches(r, run.layout))
first = [r for r in planned if r["fits"]][0]
fig, ax = plt.subplots(figsize=(10, 3))
for i, r in enumerate((first, pub)):      # the parts in the same order on both bars
    at = 0.0
    for k, t in r["time_parts_s"].items():
        ax.barh(i, t, left=at, label=k.replace("_", " ") if i == 0 else None)
        at += t
ax.set_yticks([0, 1], ["planner's first: " + choose_layout.describe(first), "published: " + choose_layout.describe(pub)],
              fontsize=7)
ax.set_xlabel("predicted seconds per step")
ax.legend(fontsize=8, ncol=4)
fig.tight_layout()
show(fig, "07_published_run_time")
