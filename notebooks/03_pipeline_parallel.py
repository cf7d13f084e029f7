# %% [markdown]
# # Chapter 03 — pipeline parallelism
#
# The model is cut into stages (one per rank), micro-batches flow through them. This notebook
# (1) shows how the stages are balanced, (2) prints a schedule, (3) trains the same model with
# each schedule under `torchrun` and checks the losses equal the single-device run, and
# (4) compares the activation memory of GPipe and 1F1B per stage.
#
# `NOTEBOOK_QUICK=1` keeps it short (2 ranks, 3 steps) for the headless tests; otherwise 4 ranks.

# %%
import json
import os
import sys
import tempfile
from importlib import import_module
from pathlib import Path

import matplotlib
if os.environ.get("NOTEBOOK_QUICK"):
    matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path.cwd() if (Path.cwd() / "common").is_dir() else Path.cwd().parent
sys.path.insert(0, str(ROOT))
QUICK = bool(os.environ.get("NOTEBOOK_QUICK"))
P, STEPS = (2, 3) if QUICK else (4, 10)
stages = import_module("03_pipeline_parallel.pipeline_stages")
sched = import_module("03_pipeline_parallel.pipeline_schedules")
from common.launch import launch  # noqa: E402
from common.model import PRESETS  # noqa: E402
out_dir = Path(tempfile.mkdtemp())

# %% [markdown]
# ## 1. Stages balanced by cost
# Every decoder layer costs the same; the embedding (first stage) is a lookup, the head (last
# stage) a D×V matmul plus the softmax. Three stages of eight layers: the last one gets fewer layers.

# %%
for n in (2, 3, 4):
    specs = stages.stage_specs(PRESETS["tiny"], n, 1, 128)
    for row in stages.partition_table(PRESETS["tiny"], specs, n, 128):
        print(n, row)

# %% [markdown]
# ## 2. A schedule is a list of actions per rank

# %%
print(sched.format_schedule(sched.build_schedule("1f1b", P, 2 * P), P))

# %% [markdown]
# ## 3. Every schedule gives the single-device losses

# %%
def run(nproc, *flags):
    metrics = out_dir / f"m{abs(hash((nproc,) + flags))}.jsonl"
    launch("03_pipeline_parallel/train_pp.py", nproc,
           ["--steps", STEPS, "--seq-len", "32", "--global-batch", "8", "--quiet", "--metrics", metrics, *flags])
    return [json.loads(line) for line in metrics.read_text().splitlines()]

reference = run(1)
runs = {"gpipe m=4": run(P, "--schedule", "gpipe", "--microbatches", "4"),
        "1f1b m=4": run(P, "--schedule", "1f1b", "--microbatches", "4"),
        "zb-h1 m=4": run(P, "--schedule", "zb-h1", "--microbatches", "4")}
if not QUICK:                      # the quick run (the tests) leaves interleaving to the chapter's tests
    runs["interleaved v=2 m=4"] = run(P, "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "4")
for label, rows in runs.items():
    diff = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(rows, reference))
    print(f"{label:>22}: max relative loss difference vs one device {diff:.1e}")
plt.plot([r["loss"] for r in reference], "k-", lw=3, label="1 device")
for label, rows in runs.items():
    plt.plot([r["loss"] for r in rows], "--", label=label)
plt.xlabel("step"); plt.ylabel("loss"); plt.legend(fontsize=7); plt.show()

# %% [markdown]
# ## 4. Activation memory per stage: GPipe keeps m micro-batches, 1F1B at most p - r

# %%
width = 0.4
for i, name in enumerate(("gpipe", "1f1b")):
    peaks = runs[f"{name} m=4"][-1]["peak_activation_bytes"]
    plt.bar([s + i * width for s in range(len(peaks))], [b / 2**20 for b in peaks], width, label=name)
plt.xlabel("stage"); plt.ylabel("peak saved activations (MiB)"); plt.legend(); plt.show()
