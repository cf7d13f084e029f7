# %% [markdown]
# # Chapter 02 — tensor parallelism
#
# Every rank holds a slice of every weight matrix. This notebook (1) shows which slice each rank
# holds, (2) trains the same model with one rank, with TP, and with TP + sequence parallelism under
# `torchrun`, and checks the losses agree, and (3) plots how far each layout's loss is from the
# single device, step by step, and the bytes each layout communicates per step.
#
# `make notebooks` executes it into `notebooks/02_tensor_parallel.ipynb`; every plot is also saved
# under `notebooks/figures/`. `NOTEBOOK_QUICK=1` keeps it short (2 ranks, 2 steps, one TP layout) for the tests;
# otherwise 4 ranks.

# %%
import json
import os
import sys
import tempfile
from importlib import import_module
from pathlib import Path

ROOT = Path.cwd() if (Path.cwd() / "common").is_dir() else Path.cwd().parent   # repository root or notebooks/
sys.path.insert(0, str(ROOT))
from common.plots import plot_relative_difference, show, show_png  # noqa: E402  (first: it picks the plot backend)
import matplotlib.pyplot as plt  # noqa: E402

from common.launch import launch  # noqa: E402
from common.metrics import read_metrics  # noqa: E402
from common.model import PRESETS  # noqa: E402

QUICK = bool(os.environ.get("NOTEBOOK_QUICK"))
N, STEPS = (2, 2) if QUICK else (4, 20)
out_dir = Path(tempfile.mkdtemp(prefix="nb02_"))

# %% [markdown]
# ## What each rank holds
# The split dimension follows from the parameter's name: column-parallel layers (wq, wk, wv,
# w_gate, w_up, the LM head, the embedding table) keep rows, row-parallel layers (wo, w_down) keep
# columns, norms are whole on every rank.

# %%
tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")
cfg = PRESETS["tiny"]
full_shapes = {"tok_emb.weight": (cfg.vocab_size, cfg.dim), "layers.0.attn.wq.weight": (cfg.dim, cfg.dim),
               "layers.0.attn.wk.weight": (cfg.n_kv_heads * cfg.head_dim, cfg.dim),
               "layers.0.attn.wo.weight": (cfg.dim, cfg.dim), "layers.0.mlp.w_up.weight": (cfg.ffn_hidden, cfg.dim),
               "layers.0.mlp.w_down.weight": (cfg.dim, cfg.ffn_hidden), "layers.0.attn_norm.weight": (cfg.dim,),
               "lm_head.weight": (cfg.vocab_size, cfg.dim)}
for name, shape in full_shapes.items():
    dim = tensor_parallel.split_dim(name)
    local = list(shape)
    if dim is not None:
        local[dim] //= N
    print(f"{name:<28} full {str(shape):<12} -> rank-local {str(tuple(local)):<12} "
          f"({'replicated' if dim is None else f'split along dim {dim}'})")

# %% [markdown]
# ## Three runs, one loss
# World size 1 is the reference; TP=N, TP=N with sequence parallelism, and the same with `--tp-overlap`
# (its all-gathers and reduce-scatters as ring steps under the matmuls' chunks) must give the same losses.

# %%
runs = {"1 rank": (1, []), f"TP={N}": (N, []), f"TP={N} + SP": (N, ["--sequence-parallel"]),
        f"TP={N} + SP, overlap": (N, ["--sequence-parallel", "--tp-overlap"])}
if QUICK:           # the tests: one TP run, the overlapped one (chapter 02's tests run the others)
    runs = {k: v for k, v in runs.items() if k in ("1 rank", f"TP={N} + SP, overlap")}
history = {}
for label, (n, flags) in runs.items():
    metrics = out_dir / f"{label.replace(' ', '_').replace('=', '').replace('+', '')}.jsonl"
    launch("02_tensor_parallel/train_tp.py", n,
           ["--steps", STEPS, "--seq-len", "64", "--global-batch", "8", "--quiet", "--metrics", metrics, *flags])
    history[label] = read_metrics(metrics)
ref = [r["loss"] for r in history["1 rank"]]
for label, rows in history.items():
    diff = max(abs(r["loss"] - x) / x for r, x in zip(rows, ref))
    print(f"{label:<12} final loss {rows[-1]['loss']:.5f}   max relative difference vs 1 rank: {diff:.1e}   "
          f"TP bytes/step (rank 0): {rows[-1]['comm_bytes_tp']:,}   params on rank 0: {rows[-1]['param_bytes']:,}")

# %% [markdown]
# Left: the relative loss difference of each TP layout from the single device, per step (round-off
# only). Right: the bytes rank 0 sent and received per step for TP's collectives; SP's pairs move the
# all-reduces' bytes, and each column-parallel entrance all-gathers its input again in backward
# (it keeps only the sequence shard: the README's §4 "Keep the shard, gather it again").

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
plot_relative_difference(ax1, history["1 rank"], {k: v for k, v in history.items() if k != "1 rank"})
ax1.set_title("same losses in every layout, up to round-off")
labels = [k for k in history if k != "1 rank"]
ax2.bar(labels, [history[k][-1]["comm_bytes_tp"] / 2**20 for k in labels])
ax2.set_ylabel("MiB sent + received per step (rank 0)")
ax2.set_title("TP communication: SP adds an all-gather per gathered input")
fig.tight_layout()
show(fig, "02_tp_loss_difference_and_bytes")

# %% [markdown]
# ## The ring under the matmuls: `--tp-overlap`'s timeline
# One forward + backward of every rank, plain sequence parallelism above and `--tp-overlap` below
# (`02_tensor_parallel/overlap_tp.py`, the README's §4 "Hide it under the matmuls"): red, a blocking
# all-gather or reduce-scatter; blue, a ring step's chunk matmuls; grey and orange, posting the next hop and
# waiting for it (what the matmuls did not cover). On this CPU gloo's hops need the same cores as the
# matmuls, and other work on the machine stretches every span: the README says what a GPU changes.

# %%
overlap_tp_report = import_module("02_tensor_parallel.overlap_tp_report")
size = ["--model", "tiny", "--rows", "2", "--seq-len", "64"] if QUICK else []
trace = out_dir / "overlap_tp.json"
launch("02_tensor_parallel/overlap_tp.py", N, ["--out", trace, "--steps", "2", *size])
run = json.loads(trace.read_text())
print(overlap_tp_report.table([run], f"torchrun --nproc_per_node={N} 02_tensor_parallel/overlap_tp.py"))
show_png(overlap_tp_report.plot_timeline([run], out_dir / "tp_timeline.png"), "02_tp_overlap_timeline")
