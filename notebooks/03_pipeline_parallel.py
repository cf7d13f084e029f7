# %% [markdown]
# # Chapter 03 — pipeline parallelism
#
# The model is cut into stages (one per rank), micro-batches flow through them. This notebook
# (1) shows how the stages are balanced, (2) prints a schedule, (3) trains the same model with
# each schedule under `torchrun` and plots how far its loss is from the single-device run, and
# (4) compares the activation memory of GPipe and 1F1B per stage.
#
# `make notebooks` executes it into `notebooks/03_pipeline_parallel.ipynb`; every plot is also saved
# under `notebooks/figures/`. `NOTEBOOK_QUICK=1` keeps it short (2 stages, m = 4, 2 steps, GPipe and
# 1F1B only) for the tests; otherwise 4 stages, m = 8, and every schedule.

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

from common.launch import launch  # noqa: E402
from common.metrics import read_metrics  # noqa: E402
from common.model import PRESETS  # noqa: E402

QUICK = bool(os.environ.get("NOTEBOOK_QUICK"))
P, M, STEPS = (2, 4, 2) if QUICK else (4, 8, 10)    # m > p: 1F1B's memory saving shows on stage 0
pipeline_stages = import_module("03_pipeline_parallel.pipeline_stages")
pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")
schedule_simulator = import_module("03_pipeline_parallel.schedule_simulator")
out_dir = Path(tempfile.mkdtemp(prefix="nb03_"))

# %% [markdown]
# ## 1. Stages balanced by cost
# Every decoder layer costs the same; the embedding (first stage) is a lookup, the head (last
# stage) a D×V matmul plus the softmax. Three stages of eight layers: the last one gets fewer layers.

# %%
for n in (2, 3, 4):
    specs = pipeline_stages.stage_specs(PRESETS["tiny"], n, 1, 128)
    for row in pipeline_stages.partition_table(PRESETS["tiny"], specs, n, 128):
        print(n, row)

# %% [markdown]
# ## 2. A schedule is a list of actions per rank

# %%
print(schedule_simulator.format_schedule(pipeline_schedules.build_schedule("1f1b", P, M), P))

# %% [markdown]
# ## 3. Every schedule gives the single-device losses
# The same global batch of 8 sequences, cut into m micro-batches of 8/m, on 1 rank and on p stages.
# The plot is the relative loss difference per step: float32 round-off, far below the tolerance.

# %%
def run(nproc, *flags):
    metrics = out_dir / f"m{nproc}_{'_'.join(flags)}.jsonl"
    launch("03_pipeline_parallel/train_pp.py", nproc,
           ["--steps", STEPS, "--seq-len", "32", "--global-batch", "8", "--quiet", "--metrics", metrics, *flags])
    return read_metrics(metrics)

reference = run(1)
mb = ["--microbatches", str(M)]
runs = {f"gpipe m={M}": run(P, "--schedule", "gpipe", *mb), f"1f1b m={M}": run(P, "--schedule", "1f1b", *mb)}
if not QUICK:                      # the quick run (the tests) leaves these to the chapter's tests
    runs[f"zb-h1 m={M}"] = run(P, "--schedule", "zb-h1", *mb)
    runs[f"interleaved v=2 m={M}"] = run(P, "--schedule", "interleaved", "--virtual-stages", "2", *mb)
for label, rows in runs.items():
    diff = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(rows, reference))
    print(f"{label:>22}: max relative loss difference vs one device {diff:.1e}")
fig, ax = plt.subplots(figsize=(7, 4))
plot_relative_difference(ax, reference, runs)
ax.set_title(f"p = {P}: every schedule's loss vs one device")
show(fig, "03_pp_loss_difference")

# %% [markdown]
# ## 4. Activation memory per stage: GPipe keeps m micro-batches, 1F1B at most p - r
# Stage r of 1F1B runs `p - r - 1` warm-up forwards, then alternates one forward and one backward,
# so it never holds more than `min(p - r, m)` micro-batches' activations; GPipe holds all m. With
# m = 2p, stage 0 holds half of GPipe's; the last stage holds one micro-batch (plus the logits).

# %%
fig, ax = plt.subplots(figsize=(7, 4))
width = 0.4
for i, name in enumerate(("gpipe", "1f1b")):
    peaks = runs[f"{name} m={M}"][-1]["peak_activation_bytes"]       # one value per stage
    bars = ax.bar([s + (i - 0.5) * width for s in range(P)], [b / 2**20 for b in peaks], width, label=name)
    held = [M if name == "gpipe" else min(P - s, M) for s in range(P)]
    ax.bar_label(bars, [f"{h} mb" for h in held], fontsize=7)
ax.set_xticks(range(P), [f"stage {s}" for s in range(P)])
ax.set_ylabel("peak saved activations (MiB)")
ax.set_title(f"p = {P}, m = {M}: micro-batches held at the peak written on each bar")
ax.legend()
show(fig, "03_pp_activation_memory")
