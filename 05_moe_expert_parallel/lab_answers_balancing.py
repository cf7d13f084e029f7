"""Lab 05's answer key, part three (balancing and dropping: M9–M12), which lab_answers.py runs after
part two: part two's 50-step runs tell how far two runs part with no change at all (`spread`), the
yardstick for the losses of the balanced runs here.
"""
import statistics

from common.lab_key import Key, results_text, table, table_rows

GAMMAS = ("0.005", "0.02", "0.05")
M9_RUNS = ("for g in 0.005 0.02 0.05; do python 05_moe_expert_parallel/train_moe.py --steps 50 --seq-len 64 "
           "--global-batch 16 --aux-loss-coef 0 --router-bias-rate $g --metrics /tmp/m9_$g.jsonl --quiet; done")
M9_PLOT = ("python 05_moe_expert_parallel/plot_expert_load.py /tmp/m9_gamma.png "
           + " ".join(f"gamma{g}=/tmp/m9_{g}.jsonl" for g in GAMMAS))
BIAS_KEYS = ('python -c "import torch; print([k for k in torch.load(\'/tmp/ck5/step_000005.pt\')[\'model\'] '
             'if \'bias\' in k])"')


def loss_reading(load_md: str, spread: float) -> str:
    """M9: the balanced runs' losses against no balancing, weighed against how far runs part anyway."""
    rows = table_rows(load_md)
    column = next(h for h in rows[0] if h.startswith("loss at step"))
    base = float(rows[0][column])
    diffs = {row["run"]: float(row[column]) / base - 1 for row in rows[1:]}
    said = "; ".join(f"{run}: {d:+.1e}" for run, d in diffs.items())
    larger = [run for run, d in diffs.items() if abs(d) > spread]
    verdict = (f"{' and '.join(larger)} by more than that: a difference these runs really make, though one "
               f"50-step run per method says little about the method" if larger else
               "none by more than that: over 50 steps, neither way of balancing has a visible cost in loss")
    return (f"The {column}, relative to no balancing: {said}. M5's runs, which differ only in the order of "
            f"float32 additions, parted by up to {spread:.1e}; here {verdict}.")


def swing(rows: list[dict]) -> float:
    """How much an expert's load changes from one step to the next, in fair shares (the layer's mean
    load), averaged over layers, experts and the second half of the run."""
    half = rows[len(rows) // 2 - 1:]
    changes = [abs(a - b) / (sum(now) / len(now))
               for before, after in zip(half, half[1:])
               for was, now in zip(before["expert_load"], after["expert_load"]) for a, b in zip(now, was)]
    return statistics.mean(changes)


def gamma_reading(key: Key) -> str:
    """M9's γ sweep: how even the load ends, how fast it got there, how much it swings."""
    runs = {g: key.rows(f"/tmp/m9_{g}.jsonl") for g in GAMMAS}
    end = {g: statistics.mean(r["max_over_mean_load"] for r in rows[-10:]) for g, rows in runs.items()}
    early = {g: rows[9]["max_over_mean_load"] for g, rows in runs.items()}
    swings = {g: swing(rows) for g, rows in runs.items()}
    rows = [[g, f"{early[g]:.2f}", f"{end[g]:.2f}", f"{swings[g]:.2f}", f"{runs[g][-1]['loss']:.4f}"] for g in GAMMAS]
    grows = [swings[g] for g in GAMMAS] == sorted(swings.values())
    evenest = [g for g in GAMMAS if end[g] <= min(end.values()) + 0.05]          # within 0.05: a tie
    return (table(["γ", "max/mean at step 10", "max/mean, mean of the last 10 steps",
                   "step-to-step swing of an expert's load (fair shares)", "loss at step 50"], rows) + f"""

Most even over the last 10 steps: γ = {" and ".join(evenest)}{" (about equally)" * (len(evenest) > 1)};
the largest swing: γ = {max(swings, key=swings.get)}. """ +
            ("The swing grows with γ: every step moves each bias by ±γ whatever the size of the imbalance, so a "
             "larger γ overshoots further each time. A smaller γ swings less, but needs more steps to undo an "
             "imbalance: a bias moves by at most γ per step." if grows else
             "Here the swing does not grow steadily with γ: with 50 steps and one run each, how far a bias "
             "overshoots also depends on where the loads happen to be; the plot shows it expert by expert."))


def part_three(key: Key, spread: float) -> None:
    load = results_text(key.bench("python 05_moe_expert_parallel/bench_moe.py --only load",
                                  f"{key.chapter}/results/load_balance.md"))
    capacity = results_text(key.bench("python 05_moe_expert_parallel/bench_moe.py --only capacity",
                                      f"{key.chapter}/results/capacity.md"))
    key.run(M9_RUNS)
    key.run(M9_PLOT)
    key.section("M9 — collapse", f"""
What `bench_moe.py --only load` wrote:

{load}

Without balancing, routing collapses: an expert that wins a few tokens early gets trained on them,
becomes better at them, and wins more (rich get richer). The aux loss pushes the probability of
over-used experts down and keeps the load nearer even. {loss_reading(load, spread)}

The bias controller adds γ·sign(target − load) to each expert's selection bias every step: it never
settles, it moves around the target by ±γ, so an expert flips between over- and under-loaded from
step to step, hence the checkerboard. The three γ (`/tmp/m9_gamma.png` draws them as the benchmark's
plot does):

{gamma_reading(key)}""")
    key.section("M10 — dropped tokens", f"""
What `bench_moe.py --only capacity` wrote:

{capacity}

Capacity factor 1.0 is the fair share *per sequence and expert*: any expert that a sequence prefers
more than average overflows within that sequence, even when the load over the whole batch is
nearly even (another sequence under-uses it, but the capacity is not shared across sequences). The
dropped slots pass through on the residual, so the block does less work for them and the loss is
higher; the last column shows by how much at each factor over these 30 steps. At the larger factors
it is smaller than the ~1e-2 by which any two MoE runs part once they route one token differently
(M5), so its sign there means little.""")

    key.fresh("/tmp/ck5")
    key.run("torchrun --nproc_per_node=2 05_moe_expert_parallel/train_moe.py --steps 10 --seq-len 32 --global-batch 8 --router-bias-rate 0.01 --checkpoint-dir /tmp/ck5 --checkpoint-every 5 --metrics /tmp/m11_full.jsonl --quiet")
    key.run("echo step_000005.pt > /tmp/ck5/latest")
    key.run("torchrun --nproc_per_node=4 05_moe_expert_parallel/train_moe.py --steps 10 --seq-len 32 --global-batch 8 --router-bias-rate 0.01 --checkpoint-dir /tmp/ck5 --resume --metrics /tmp/m11_resumed.jsonl --quiet")
    resumed = key.run("python -m common.compare_metrics /tmp/m11_full.jsonl /tmp/m11_resumed.jsonl", check=False)
    keys = key.run(BIAS_KEYS).out.strip()
    key.section("M11 — resume in another layout", f"""
Comparison (steps 6–10): exit {resumed.code}; {resumed.line_with("m11_resumed.jsonl: max")}

Bias entries in the checkpoint's model state: `{keys[:400]}`

The router bias is a buffer, not a parameter: it is updated by the controller, not by AdamW, and
it changes which experts are chosen. It is saved in the model's state dict with the weights, so a
resumed run, in any layout, selects the same experts as the uninterrupted one.""")

    failures = key.failures([f"torchrun --nproc_per_node=4 05_moe_expert_parallel/train_moe.py {flags}" for flags in
                             ("--ep 3", "--ep 8", "--top-k 9", "--capacity-factor 0", "--aux-loss-coef -1",
                              "--model tiny --ep 2")], "train_moe.py")
    key.section("M12 — bad input", failures)
