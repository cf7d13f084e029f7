# %% [markdown]
# # Pipeline bubbles, on paper and for real
#
# A pipeline of p stages with m micro-batches idles `(p-1)/(m+p-1)` of its time (GPipe, 1F1B),
# `(p-1)/(v·m+p-1)` with v interleaved chunks per rank, less again with zero-bubble's split backward.
# Part 1 draws the schedules from unit costs (no processes). Part 2 runs them with `torchrun`
# `--timeline` and draws what really happened.
#
# `make notebooks` executes it into `notebooks/pipeline_bubbles.ipynb`; every plot is also saved under
# `notebooks/figures/`. `NOTEBOOK_QUICK=1` keeps it short (2 ranks, 2 steps, ZB-H1 alone) for the
# tests; otherwise 4 ranks and four schedules.

# %%
import os
import sys
import tempfile
from importlib import import_module
from pathlib import Path

ROOT = Path.cwd() if (Path.cwd() / "common").is_dir() else Path.cwd().parent   # repository root or notebooks/
sys.path.insert(0, str(ROOT))
from common.plots import show, show_png  # noqa: E402  (first: it picks the plot backend)
import matplotlib.pyplot as plt  # noqa: E402

from common.launch import launch  # noqa: E402
from common.timeline import load_trace  # noqa: E402

QUICK = bool(os.environ.get("NOTEBOOK_QUICK"))
P, STEPS = (2, 2) if QUICK else (4, 3)
pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")
schedule_simulator = import_module("03_pipeline_parallel.schedule_simulator")
plot_timeline = import_module("03_pipeline_parallel.plot_timeline")
out_dir = Path(tempfile.mkdtemp(prefix="nb_bubbles_"))

# %% [markdown]
# ## 1. The bubble as m grows
# Solid: the GPipe and 1F1B theory `(p-1)/(m+p-1)` (their simulations give the same numbers); dotted:
# ZB-H1 simulated with unit costs.

# %%
ms = [1, 2, 4, 8, 16, 32]
fig, ax = plt.subplots(figsize=(7, 4))
for p in (2, 4, 8):
    theory = [pipeline_schedules.theory_bubble("1f1b", p, m) for m in ms]
    zb_h1 = [schedule_simulator.simulate(pipeline_schedules.build_schedule("zb-h1", p, m), p)["bubble"] for m in ms]
    line, = ax.plot(ms, theory, "o-", label=f"GPipe/1F1B theory (p−1)/(m+p−1), p={p}")
    ax.plot(ms, zb_h1, "x:", color=line.get_color(), label=f"ZB-H1 p={p} (simulated)")
ax.set_xscale("log", base=2); ax.set_xlabel("micro-batches m"); ax.set_ylabel("bubble fraction")
ax.legend(fontsize=7); ax.grid(alpha=0.3)
show(fig, "bubbles_vs_m")

# %% [markdown]
# ## 2. Four schedules on paper, p = 4, m = 8

# %%
print(schedule_simulator.format_schedule(pipeline_schedules.build_schedule("1f1b", 4, 8), 4))
panels = [plot_timeline.simulated_events(n, 4, 8, v) for n, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]]
show_png(plot_timeline.plot(panels, out_dir / "simulated.png", "units"), "bubbles_simulated_p4_m8")

# %% [markdown]
# ## 3. The same schedules for real (`torchrun ... --timeline`)
#
# The measured bubble is not the theory's: the message passing adds gaps the theory has not, and
# with more ranks than cores (4 ranks on a 2-core laptop) a rank that waits lends its core to the
# others, so the measurement is waiting time, not capacity lost.

# %%
traces = []
SCHEDULES = [("zb-h1", 1)] if QUICK else [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]
for name, v in SCHEDULES:
    trace = out_dir / f"{name}.json"
    launch("03_pipeline_parallel/train_pp.py", P,
           ["--schedule", name, "--virtual-stages", v, "--microbatches", "4", "--global-batch", "8",
            "--seq-len", "64", "--steps", STEPS, "--quiet", "--timeline", trace])
    events, meta = load_trace(trace)
    traces.append((plot_timeline.step_of(events, None), meta))
show_png(plot_timeline.plot(traces, out_dir / "real.png", "ms", f"p = {P}, real runs"), f"bubbles_real_p{P}")
