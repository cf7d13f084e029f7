# %% [markdown]
# # Chapter 05 — mixture of experts and expert parallelism
#
# Each block's MLP becomes E experts and a router that sends every token to k of them; expert
# parallelism puts E/ep experts on each rank and moves the tokens with an all-to-all. This notebook
# (1) routes one batch through one MoE layer in this process and shows the balance loss at uniform
# routing, (2) trains on 1 rank and with expert parallelism under `torchrun` and plots how far the
# losses are apart, step by step, (3) plots the expert load per step (layers × experts) with no
# balancing, with the aux loss and with the aux-loss-free bias, and (4) measures the dropped share
# against the capacity factor and the all-to-all bytes against the formula.
#
# `make notebooks` executes it into `notebooks/05_moe_expert_parallel.ipynb`; every plot is also
# saved under `notebooks/figures/`. `NOTEBOOK_QUICK=1` keeps it short (2 ranks, a few steps) for the
# tests; otherwise 4 ranks and enough steps to see the load settle.

# %%
import os
import shutil
import sys
import tempfile
from importlib import import_module
from pathlib import Path

ROOT = Path.cwd() if (Path.cwd() / "common").is_dir() else Path.cwd().parent   # repository root or notebooks/
sys.path.insert(0, str(ROOT))
from common.plots import plot_relative_difference, show  # noqa: E402  (first: it picks the plot backend)
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from common.launch import launch  # noqa: E402
from common.metrics import read_metrics  # noqa: E402
from common.model import PRESETS, MoEFeedForward, count_parameters  # noqa: E402
from common.moe_routing import route  # noqa: E402

plot_expert_load = import_module("05_moe_expert_parallel.plot_expert_load")
QUICK = bool(os.environ.get("NOTEBOOK_QUICK"))
N = 2 if QUICK else 4
LOAD_STEPS = 3 if QUICK else 50
SEQ, BATCH = (32, 8) if QUICK else (64, 16)
SHAPE = ["--seq-len", SEQ, "--global-batch", BATCH]
out_dir = Path(tempfile.mkdtemp(prefix="nb05_"))


def train(name: str, nproc: int, *flags, steps: int = LOAD_STEPS) -> list[dict]:
    metrics = out_dir / f"{name}.jsonl"
    launch("05_moe_expert_parallel/train_moe.py", nproc,
           ["--steps", steps, *SHAPE, "--quiet", "--metrics", metrics, *flags])
    return read_metrics(metrics)


# %% [markdown]
# ## 1. One MoE layer, in this process
# `tiny-moe` has the same *active* parameters per token as `tiny` (2 experts of hidden 192 instead of
# one MLP of 384) and about three times the parameters. The router is a linear map D → E, softmax,
# top-k; the k gates are renormalised to sum to 1. At initialisation the router is nearly uniform,
# so the balance term E·Σᵢ fᵢPᵢ of each sequence starts near 1 (exactly 1 for uniform routing).

# %%
cfg = PRESETS["tiny-moe"]
print(f"tiny:     {count_parameters(PRESETS['tiny']):>10,} parameters")
print(f"tiny-moe: {count_parameters(cfg):>10,} parameters, {count_parameters(cfg, active=True):,} active per token")
torch.manual_seed(0)
layer = MoEFeedForward(cfg)
x = torch.randn(4, 32, cfg.dim)                                   # (B, S, D): 4 sequences of 32 tokens
r = route(x, layer.router, layer.selection_bias, cfg.top_k)
print("experts of the first 4 tokens:", r.experts[:4].tolist())
print("their gates (sum to 1):       ", [[round(g, 3) for g in row] for row in r.gates[:4].tolist()])
print("slots per expert (4·32·2 = 256):", r.load.tolist())
print(f"E·Σ fP per sequence: {r.aux_sum.item() / 4:.4f}  (uniform routing: 1)")

# %% [markdown]
# ## 2. The same losses with the experts spread over ranks — until routing meets a near-tie
# One rank, then ep = N (each rank holds 8/N experts of every layer), and with 4 ranks also
# dp 4 = edp 2 × ep 2. Dense gradients are summed over dp (all ranks), expert gradients over edp (the
# ranks that hold the same experts). The plot shows the relative difference from the single device, per step.
#
# The first steps match to round-off (about 1e-7). Later a line can jump by orders of magnitude: a
# token whose 2nd- and 3rd-best experts score the same to within round-off goes to another expert,
# and from then on the runs differ by more than round-off. When depends on the CPU: in the full
# mode's 10 steps, one x86 CPU saw dp 4 = edp 2 × ep 2 cross the 1e-5 line at step 9, another saw both EP
# lines jump to about 4e-6 at step 10. The full mode also draws the control, one rank with its batch
# in 2 micro-batches (no parallelism at all, the same sums in another order): it meets such ties
# too, and over README section 8's 50 steps it parts at about the same step as the layouts.

# %%
steps = 3 if QUICK else 10
runs = {"1 rank": train("ref", 1, steps=steps), f"ep {N}": train(f"ep{N}", N, "--ep", N, steps=steps)}
if not QUICK:
    runs["dp 4 = edp 2 × ep 2"] = train("ep2dp2", 4, "--ep", 2, steps=steps)
    runs["control: 2 micro-batches"] = train("mb2", 1, "--microbatches", 2, steps=steps)    # 1 rank
for label, rows in runs.items():
    print(f"{label:<24} losses {[round(r['loss'], 5) for r in rows]}  all-to-all bytes/step (rank 0) "
          f"{rows[-1]['comm_bytes_ep']:,}")
fig, ax = plt.subplots(figsize=(7, 3.8))
plot_relative_difference(ax, runs["1 rank"], {k: v for k, v in runs.items() if k != "1 rank"})
ax.set_title("loss vs 1 rank: round-off, until routing near-ties part the runs\n"
             "(when depends on the CPU; the no-parallelism control meets them too)", fontsize=10)
show(fig, "05_moe_loss_difference")

# %% [markdown]
# ## 3. Expert load per step
# Without balancing, routing is rich-get-richer: a few experts per layer take most tokens. The aux
# loss (α = 0.01, the default) and the aux-loss-free bias (γ, selection only) spread them. Each row
# of a heat map is one expert of one layer; white = its fair share, red = crowded, blue = idle.

# %%
load_runs = {"no balancing": ["--aux-loss-coef", "0"], "aux loss α=0.01": [],
             "bias γ=0.02, no aux": ["--aux-loss-coef", "0", "--router-bias-rate", "0.02"]}
if QUICK:           # the tests: the default's alone, section 2's run (chapter 05's tests train the other two)
    load_runs = {"aux loss α=0.01": []}
for i, (label, flags) in enumerate(load_runs.items()):
    if not flags and LOAD_STEPS == steps:           # the quick mode: section 2's 1-rank run is this very run
        shutil.copy(out_dir / "ref.jsonl", out_dir / f"load{i}.jsonl")
    rows = read_metrics(out_dir / f"load{i}.jsonl") if (out_dir / f"load{i}.jsonl").exists() else \
        train(f"load{i}", 1, *flags)
    print(f"{label:<20} max/mean load: first step {rows[0]['max_over_mean_load']:.2f}, "
          f"last step {rows[-1]['max_over_mean_load']:.2f}")
fig = plot_expert_load.draw_expert_load({label: out_dir / f"load{i}.jsonl" for i, label in enumerate(load_runs)})
show(fig, "05_moe_expert_load")

# %% [markdown]
# ## 4. Capacity: dropped slots against the capacity factor, and the bytes of the all-to-all
# Each expert takes at most ⌈CF·S·k/E⌉ slots of a sequence; the rest are dropped (residual only).
# Then the all-to-all bytes of the EP run against the formula for routing that ignores where a token
# lives: per layer 4 exchanges of (ep−1)/ep·T·k rows of D floats out and as many in, plus the counts.

# %%
roomy = cfg.n_experts / cfg.top_k       # CF = E/k: ⌈CF·S·k/E⌉ = S slots, room for every token of a sequence
factors = [roomy] if QUICK else [0.5, 0.75, 1.0, 1.25, 1.5, 2.0]     # quick: section 2's run (the tests train CF 1)
dropped = []
for cf in factors:
    if cf == roomy:       # the quick mode: nothing can be dropped, so section 2's dropless 1-rank run is this run
        rows, note = runs["1 rank"], "  (= E/k: no slot can be dropped; section 2's 1-rank run, dropless)"
    else:
        rows, note = train(f"cf{cf}", 1, "--capacity-factor", cf, steps=steps), ""
    dropped.append(sum(r["dropped_fraction"] for r in rows) / len(rows))
    print(f"capacity factor {cf}: {100 * dropped[-1]:.1f}% of slots dropped, final loss {rows[-1]['loss']:.4f}{note}")
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(factors, [100 * d for d in dropped], "o-")
ax.set_xlabel("capacity factor")
ax.set_ylabel("dropped slots (%)")
ax.set_title("the fuller the experts may get, the fewer tokens are dropped")
ax.grid(alpha=0.3)
show(fig, "05_moe_dropped_vs_capacity")

rows = runs[f"ep {N}"]
T, L, D, E, k = BATCH * SEQ // N, cfg.n_layers, cfg.dim, cfg.n_experts, cfg.top_k     # T: tokens per rank
formula = L * (8 * (N - 1) / N * T * k * D * 4 + 16 * (N - 1) * E // N)
measured = sum(r["comm_bytes_ep"] for r in rows) / len(rows)
print(f"all-to-all bytes per step on rank 0: measured {measured:,.0f}, formula {formula:,.0f}, "
      f"ratio {measured / formula:.3f} (routing is not exactly uniform over ranks)")
