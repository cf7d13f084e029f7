"""Lab 02's answer key: runs every command of LAB.md and writes LAB_ANSWERS.md from what they print.

    python 02_tensor_parallel/lab_answers.py          # runs every command of LAB.md
"""
import json
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common`
from common.exercises.museum import key_section  # noqa: E402
from common.lab_key import ROOT, Edit, Key, table  # noqa: E402
from common.model import PRESETS, count_parameters  # noqa: E402

overlap_tp_report = import_module("02_tensor_parallel.overlap_tp_report")

CH = "02_tensor_parallel"


def main() -> None:
    key = Key(CH, "Lab 02 — tensor parallelism")
    key.names(f"{CH}/dtensor_tp.py", "def settle_grads")
    key.names(f"{CH}/tensor_parallel.py", "def sync_replicated_kv_grads")
    cfg = PRESETS["tiny"]
    L, D = cfg.n_layers, cfg.dim

    # 1. -------------------------------------------------------------------------------------------
    key.run("python 02_tensor_parallel/train_tp.py --steps 10 --seq-len 32 --global-batch 8 --metrics runs/lab02/tp1.jsonl --quiet")
    key.run("torchrun --nproc_per_node=4 02_tensor_parallel/train_tp.py --steps 10 --seq-len 32 --global-batch 8 --metrics runs/lab02/tp4.jsonl --quiet")
    key.run("torchrun --nproc_per_node=4 02_tensor_parallel/train_tp.py --steps 10 --seq-len 32 --global-batch 8 --tp 2 --metrics runs/lab02/tp2dp2.jsonl --quiet")
    cmp = key.run("python -m common.compare_metrics runs/lab02/tp1.jsonl runs/lab02/tp4.jsonl runs/lab02/tp2dp2.jsonl", check=False)
    rows = []
    for name in ("tp4", "tp2dp2"):
        w = key.worst("runs/lab02/tp1.jsonl", f"runs/lab02/{name}.jsonl")
        step1 = abs(key.rows(f"runs/lab02/{name}.jsonl")[0]["loss"] / key.rows("runs/lab02/tp1.jsonl")[0]["loss"] - 1)
        rows.append([name, f"{step1:.1e}", f"{w['max']:.1e} (step {w['max_step']})", w["first_above_tol"] or "none"])
    key.section("1. Same losses, different layouts", f"""
{table(["layout", "step 1", "max over 10 steps", "first step above 1e-5"], rows)}

`compare_metrics` exit status: **{cmp.code}**. Round-off only, or nothing: a layout that adds the
same numbers in another order (TP sums partial matmuls across ranks; DP sums two halves of the
batch) differs by float32 round-off (~1e-7), and the difference grows slowly over the steps because AdamW divides each update by
the running RMS of the gradients: a 1e-7 difference in a gradient whose RMS is small becomes a
larger relative difference in the weights. The root README's equivalence table shows how far it
grows over 50 steps in fp32 and in bf16. These digits are round-off on this machine: on another CPU
a student sees other ones, of the same order, possibly at other steps; every step within 1e-5 (exit
status 0) holds on every machine.

**If step 1 differs**, the forward is wrong, before any gradient exists: the first suspects are
the loss normalisation (a local token count instead of the global one), a missing g (an
all-reduce of partial sums after a row-parallel layer), or a shard taken along the wrong
dimension. A difference that starts at step 2 points at the backward: a missing f, or an
unsynchronised replicated gradient (§4).""")

    # 2. and 3. --------------------------------------------------------------------------------------
    key.run("torchrun --nproc_per_node=2 02_tensor_parallel/train_tp.py --steps 2 --seq-len 64 --global-batch 4 --metrics runs/lab02/c2.jsonl --quiet")
    key.run("torchrun --nproc_per_node=2 02_tensor_parallel/train_tp.py --steps 2 --seq-len 64 --global-batch 4 --sequence-parallel --metrics runs/lab02/c2sp.jsonl --quiet")
    tp_bytes = key.rows("runs/lab02/c2.jsonl")[-1]["comm_bytes_tp"]
    sp_bytes = key.rows("runs/lab02/c2sp.jsonl")[-1]["comm_bytes_tp"]
    predicted = (4 * L + 2) * 2 * 4 * 64 * D * 4 + 3 * 2 * 4 * 64 * 4
    norms = (2 * L + 1) * D * 4 * 2                       # all-reduce over N = 2: n sent + n received
    key.section("2. Count the all-reduces", f"""
Predicted (4L + 2) · 2·2(N−1)/N · B·S·D·4 + 3·2·2(N−1)/N·B·S·4 = {predicted:,} bytes; measured
`comm_bytes_tp` at step 2: **{tp_bytes:,}** bytes ({'equal' if tp_bytes == predicted else f'differs by {tp_bytes - predicted:,}'}).

Per block: forward, one g after attention's wo and one after the MLP's w_down; backward, one f
before attention's column-parallel wq/wk/wv and one before the MLP's w_gate/w_up: 4L. The
vocab-parallel embedding adds a g (forward), the column-parallel head an f (backward): + 2. The
vocab-parallel loss all-reduces three (B, S) tensors: the max logit, the sum of exponentials and
the target's logit.""")
    regathers = (2 * L + 1) * 4 * 64 * D * 4              # all-gather over N = 2: n/2 sent + n/2 received
    tp_kept, sp_kept = (key.rows(f"runs/lab02/{f}.jsonl")[-1]["peak_activation_bytes"] for f in ("c2", "c2sp"))
    key.section("3. Sequence parallelism: more bytes, less memory", f"""
`comm_bytes_tp` with `--sequence-parallel`: **{sp_bytes:,}** bytes, {sp_bytes - tp_bytes:+,} against §2.
Each all-reduce became a reduce-scatter + an all-gather, each moving (N−1)/N of the tensor each way:
the same total. The column-parallel entrances' second all-gather, in backward, predicts (2L + 1) ·
2(N−1)/N · B·S·D·4 = {regathers:,} bytes, the norms' gradient all-reduce (2L + 1) · D · 4 B · 2 (sent +
received at N = 2) = {norms:,} bytes: {regathers + norms:,} together{' — exactly the difference' if sp_bytes - tp_bytes == regathers + norms else ''}.
What they buy: `peak_activation_bytes` {tp_kept:,} without SP, **{sp_kept:,}** with it
({1 - sp_kept / tp_kept:.0%} less). The norms' inputs and outputs, the residual stream and the
column-parallel layers' inputs are kept as (B, S/N, D) per rank instead of (B, S, D); the layers
all-gather their input again in backward, where the weight gradients need all S positions.""")

    # 4. -------------------------------------------------------------------------------------------
    outcome = {}
    for name, edit, run, compares in [
            ("a", Edit(f"{CH}/tp_layers.py", "return tp_operators.copy_to_tp_region(x, self.group)", "return x"),
             "torchrun --nproc_per_node=2 02_tensor_parallel/train_tp.py --steps 3 --seq-len 32 --global-batch 8 --metrics runs/lab02/no_f.jsonl --quiet",
             ["python -m common.compare_metrics runs/lab02/tp1.jsonl runs/lab02/no_f.jsonl"]),
            ("b", Edit(f"{CH}/tp_trainer.py", "tensor_parallel.sync_tp_gradients(self.model, self.tp_group)", "pass"),
             "torchrun --nproc_per_node=2 02_tensor_parallel/train_tp.py --steps 10 --seq-len 32 --global-batch 8 --sequence-parallel --metrics runs/lab02/no_sync.jsonl --quiet",
             ["python -m common.compare_metrics runs/lab02/tp1.jsonl runs/lab02/no_sync.jsonl",
              "python -m common.compare_metrics runs/lab02/tp1.jsonl runs/lab02/no_sync.jsonl --key grad_norm"])]:
        with key.broken(edit) as root:
            key.run(run, root=root)
            (root / "runs/lab02/tp1.jsonl").write_bytes((ROOT / "runs/lab02/tp1.jsonl").read_bytes())   # the good reference
            outcome[name] = [key.run(c, root=root, check=False) for c in compares]
    (a,), (b_loss, b_grad) = outcome["a"], outcome["b"]
    key.section("4. Break it on purpose", f"""
(a) without f, `loss`: exit status {a.code}, first step above 1e-5: **{a.first_above()}** ({a.line_with("no_f.jsonl: max")}).
(b) without the replicated-gradient sync, under SP, 10 steps: `loss` exit status {b_loss.code}, first step
above 1e-5: **{b_loss.first_above()}** ({b_loss.line_with("no_sync.jsonl: max")}); `grad_norm` exit status
{b_grad.code}, first step above 1e-5: **{b_grad.first_above()}** ({b_grad.line_with("no_sync.jsonl: max")}).

Step 1's loss is equal in both: f is the identity in the forward, and the norm gains' gradients
only act through the update, so the first loss (computed before any update) cannot see either bug.
(a) f's backward is the all-reduce that sums each rank's contribution to the gradient of a
column-parallel layer's input; without it every rank propagates only its own part, every gradient
below the first column-parallel layer is wrong, and step 2's loss differs.
(b) under SP each rank's norm gains see only its slice of the sequence, so without the all-reduce
their gradients are partial sums, and each rank updates its copy of the gains differently. The
gradient norm counts these gradients, but they are a tiny part of it (17 vectors of 128 among 1.6 M
parameters), so even it moves by less than 1e-5 until {b_grad.first_above()}. The loss notices later still: AdamW divides each
gradient by its own running RMS, so a gradient that is about half the right one, with the right
sign, produces nearly the same update; the replicas drift apart slowly. A bug that the loss hides
for many steps is why the tests compare gradients (and every rank's copy of a replicated tensor),
not only losses. Machine dependence: (a) is a large error and starts at step 2 on any CPU;
the step at which (b)'s small drift passes 1e-5 comes from round-off amplified by AdamW and can come
a step or two earlier or later on another machine.""")

    # 5. -------------------------------------------------------------------------------------------
    key.run("torchrun --nproc_per_node=8 02_tensor_parallel/train_tp.py --steps 5 --seq-len 32 --global-batch 8 --metrics runs/lab02/tp8.jsonl --quiet")
    measured = key.rows("runs/lab02/tp8.jsonl")[-1]["param_bytes"]
    full = count_parameters(cfg) * 4
    norms = (2 * L + 1) * D
    kv = cfg.n_kv_heads * cfg.head_dim * D                   # wk (and wv): (K·hd, D)
    predicted = ((count_parameters(cfg) - norms - 2 * L * kv) / 8 + norms + 2 * L * kv / cfg.n_kv_heads) * 4
    key.section("5. Fewer KV heads than ranks", f"""
`param_bytes` on rank 0: **{measured:,}** bytes, against full/8 = {full / 8:,.0f} bytes
({measured / (full / 8):.3f}×). Predicted from the layout: the matrices split 8 ways, except wk and
wv, which hold one whole KV head each (hd × D = {cfg.head_dim} × {D}) instead of half a head, and the
{2 * L + 1} norm vectors of D, which every rank holds whole: {predicted:,.0f} bytes{' (equal)' if abs(predicted - measured) < 1 else ''}.

With 4 KV heads on 8 ranks, ranks 2k and 2k+1 hold KV head k (each serves its own query heads), so
`sync_replicated_kv_grads` sums head 0's gradient over ranks 0 and 1: each computed it from its own
query heads only.""")

    # 6. -------------------------------------------------------------------------------------------
    failures = key.failures(["torchrun --nproc_per_node=4 02_tensor_parallel/train_tp.py --tp 3",
                             "torchrun --nproc_per_node=4 02_tensor_parallel/train_tp.py --sequence-parallel --seq-len 30"],
                            "train_tp.py")
    key.section("6. Bad inputs", f"""
{failures}

Both are checked on every rank before any communication, so nobody waits for a peer that has
already given up. The script prints the one line and no traceback; what follows it on the screen is
torchrun's own report (its launcher's traceback, ending in `ChildFailedError`, and the table of
failed ranks).""")

    # 7. -------------------------------------------------------------------------------------------
    key.run("torchrun --nproc_per_node=2 02_tensor_parallel/train_tp.py --steps 10 --seq-len 32 --global-batch 8 --impl torch --metrics runs/lab02/dt.jsonl --quiet")
    dt = key.run("python -m common.compare_metrics runs/lab02/tp1.jsonl runs/lab02/dt.jsonl", check=False)
    key.section("7. Ours vs DTensor", f"""
`compare_metrics` exit status **{dt.code}**: {dt.line_with("dt.jsonl: max")}

DTensor leaves the embedding's gradient as `Replicate` (the whole V × D table on every rank, as it
came out of the backward of the vocab-parallel lookup) while the parameter is `Shard(0)`; the SP
norms' gradients come out `Partial`. Computing the norm of the *local* gradients then counts the
embedding's whole table on every rank (N times too much) and the norms' partial sums instead of
their sum. `settle_grads` redistributes each gradient to its parameter's placement: Replicate →
Shard is a local slice, Partial → Replicate an all-reduce. `comm_bytes_tp` in `dt.jsonl`:
**{json.dumps(key.rows("runs/lab02/dt.jsonl")[-1]["comm_bytes_tp"])}** (not measured: DTensor's collectives
bypass the counter). Throughput: the ratio columns of
`results/throughput.md` (from `python 02_tensor_parallel/bench_tp.py`); times and their ratios are
the measuring machine's and vary by CPU and load.""")
    # 8. -------------------------------------------------------------------------------------------
    overlap_section(key)
    key.section(*key_section("02"))      # the museum's bugs of this chapter: how each is found
    key.write()


def overlap_section(key) -> None:
    """§8: --tp-overlap against one device, and the exposed TP time of overlap_tp.py at tp 2 and 4."""
    key.run("torchrun --nproc_per_node=2 02_tensor_parallel/train_tp.py --steps 10 --seq-len 32 --global-batch 8 --sequence-parallel --tp-overlap --metrics runs/lab02/overlap.jsonl --quiet")
    same = key.run("python -m common.compare_metrics runs/lab02/tp1.jsonl runs/lab02/overlap.jsonl", check=False)
    key.run("torchrun --nproc_per_node=2 02_tensor_parallel/overlap_tp.py --out runs/lab02/overlap2.json")
    key.run("torchrun --nproc_per_node=4 02_tensor_parallel/overlap_tp.py --out runs/lab02/overlap4.json")
    report = key.run("python 02_tensor_parallel/overlap_tp_report.py runs/lab02/overlap2.json runs/lab02/overlap4.json")
    runs = [json.loads((ROOT / f"runs/lab02/overlap{n}.json").read_text()) for n in (2, 4)]
    rows = []
    for run in runs:
        plain, ring = (overlap_tp_report.medians(run, v) for v in ("plain", "overlap"))
        rows.append([run["tp"], f"{1e3 * plain['exposed_s']:,.0f}", f"{1e3 * ring['exposed_s']:,.0f}",
                     f"{ring['exposed_s'] / plain['exposed_s']:.2f}", f"{1e3 * plain['step_cpu_s']:,.0f}",
                     f"{1e3 * ring['step_cpu_s']:,.0f}", f"{run['load_average']:.1f}"])
    key.section("8. Hide the communication: --tp-overlap", f"""
(a) `compare_metrics` exit status **{same.code}**: {same.line_with("overlap.jsonl: max")}. Round-off, not the
bit: the ring adds each chunk's partial sums in ring order (gloo's reduce-scatter in its own), and each
weight gradient is a sum of N chunk products instead of one product over every position.

(b) The prediction. One ring (an all-gather or a reduce-scatter over N ranks) is N − 1 hops of one
(B, S/N, D) chunk; under `--tp-overlap` each hop runs under one chunk's matmuls, so what stays exposed is
(N − 1)·max(0, t_hop − t_chunk) plus each post's latency, against plain SP's whole (N − 1)·t_hop. With
the matmul faster than the hop the two are equal; with t_chunk ≥ t_hop the exposed time tends to the
posts' latency, at tp 2 as at tp 4, if the hop truly runs beside the matmul.

Measured (`overlap_tp_report.py`; medians over steps and ranks, milliseconds per step):

{table(["tp", "plain SP exposed", "--tp-overlap exposed", "ratio", "plain step CPU", "overlap step CPU",
        "load average"], rows)}

What this machine can show: little. gloo moves the bytes with CPU threads, on the cores the matmuls use,
so a hop "under" a matmul takes its core away from it: at tp 2 (one core per rank) a hop and a chunk
share a core; at tp 4 (two ranks per core) nothing runs beside anything. And with other work on the
machine (the load average), every wall-clock span includes time spent waiting for a core: the ratios
above move from run to run, and on a quiet machine or another CPU a student sees other ones. The stable
number is the step's CPU time, the same work in both runs plus the ring's small overhead (more, smaller
matmuls and messages). On a GPU the hops run on the copy engines and NVLink while the SMs multiply; the
ratio t_chunk/t_hop = 2·(K/N)·bandwidth/(e·peak) (K the matmul's unsplit width, e bytes per element)
decides, and for TP's large MLP matmuls it exceeds 1 (README §4).

The report as printed:

```
{report.out.strip()}
```""")


if __name__ == "__main__":
    main()
