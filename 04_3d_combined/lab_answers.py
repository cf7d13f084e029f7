"""Lab 04's answer key: runs every command of LAB.md and writes LAB_ANSWERS.md from what they print.

    python 04_3d_combined/lab_answers.py          # runs every command of LAB.md
"""
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common`
from common.exercises.museum import key_section  # noqa: E402
from common.lab_key import ROOT, Edit, Key, median_step_s, mesh_groups, mesh_row, mib, table  # noqa: E402
from common.model import PRESETS, count_parameters  # noqa: E402
from common.recompute import MODES  # noqa: E402

CH = "04_3d_combined"


def killed_rank_seconds(key: Key) -> tuple[float, int, str]:
    """Start the lab's long run, kill -9 one rank once training runs, time how long the rest take."""
    cmd = "torchrun --nproc_per_node=4 04_3d_combined/train_3d.py --steps 500 --quiet"
    assert cmd in key.lab, "LAB.md no longer starts this run"
    proc = subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=ROOT, env=key.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(5)
    ranks = []
    for _ in range(600):                      # wait until the 4 ranks exist and have started training
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        if len(ranks) == 4:
            break
        time.sleep(0.5)
    time.sleep(60)                            # let them build the model and enter the loop
    subprocess.run(["kill", "-9", ranks[1]])
    t0 = time.perf_counter()
    out, _ = proc.communicate(timeout=600)
    return time.perf_counter() - t0, proc.returncode, out


def killed_report(out: str) -> str:
    """Every rank's exit code from torchrun's failure summary: "rank 0: 1, rank 1: -9, ..."."""
    found = sorted(set(re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", out)))
    return ", ".join(f"rank {r}: {c}" for r, c in found) if found else "no report found"


def main() -> None:
    key = Key(CH, "Lab 04 — DP × TP × PP on one mesh")
    key.names(f"{CH}/parallel_3d.py", "def decide_layout")
    key.names("common/errors.py", "lost contact with another rank")

    # 1. -------------------------------------------------------------------------------------------
    rows = []
    for flags in ["", " --dp 1 --tp 2 --pp 4", " --dp 4 --tp 2 --pp 1"]:
        out = key.run(f"torchrun --nproc_per_node=8 04_3d_combined/train_3d.py --steps 1 --sample-tokens 0{flags}").out
        row, groups = mesh_row(out, 5, 4), mesh_groups(out, 5)     # rank, dp, pp, tp; {dimension: ranks}
        rows.append([f"`{flags.strip() or '(default) --dp 2 --tp 2 --pp 2'}`", f"({row[1]}, {row[2]}, {row[3]})",
                     groups["tp"], groups["pp"], groups["dp"]])
    key.section("1. Read the grid", f"""
Rank 5's row of the printed ranks table, and its groups from the groups table, in each layout:

{table(["layout", "(dp, pp, tp)", "tp group", "pp group", "dp group"], rows)}

With `arange(8).view(dp, pp, tp)`: 5 = 4·1 + 2·0 + 1 in the default layout, so (dp, pp, tp) =
(1, 0, 1). Its TP group varies the last index (ranks 4, 5), its PP group the middle one (5, 7), its
DP group the first (1, 5). TP varies fastest, so a TP group is always consecutive ranks: on a real
cluster, the GPUs of one node, where the all-reduce in every layer is cheapest.""")

    # 2. -------------------------------------------------------------------------------------------
    eight = "torchrun --nproc_per_node=8 04_3d_combined/train_3d.py --steps 10 --quiet --metrics runs/lab04/eight.jsonl --sample-tokens 0"
    compare = "python -m common.compare_metrics runs/lab04/one.jsonl runs/lab04/eight.jsonl"
    key.run("python 04_3d_combined/train_3d.py --steps 10 --quiet --metrics runs/lab04/one.jsonl --sample-tokens 0")
    key.run(eight)
    good = key.run(compare, check=False)
    key.run("python 04_3d_combined/plot_loss.py runs/lab04/one.jsonl runs/lab04/eight.jsonl --labels 1-rank 8-rank")
    edit = Edit(f"{CH}/trainer_3d.py", "loss_scale=args.global_batch * args.seq_len,",
                'loss_scale=args.global_batch * args.seq_len // mesh.size("dp"),')
    with key.broken(edit) as broken_root:
        key.run(eight, root=broken_root)
        (broken_root / "runs/lab04/one.jsonl").write_bytes((ROOT / "runs/lab04/one.jsonl").read_bytes())
        bad_cmp = key.run(compare, root=broken_root, check=False)
        bad = key.rows("runs/lab04/eight.jsonl", broken_root)
    ref = key.rows("runs/lab04/one.jsonl")
    gaps = [abs(e["loss"] - r["loss"]) / r["loss"] for e, r in zip(key.rows("runs/lab04/eight.jsonl"), ref)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)                  # its index: step worst + 1
    calm = max(r["grad_norm"] for i, r in enumerate(ref) if i != worst and i > 0)
    after = f"; step {worst + 2}: {gaps[worst + 1]:.0e}" if worst + 1 < len(gaps) else ""
    ratio = bad[0]["loss"] / ref[0]["loss"]
    curve = max(abs(b["loss"] / ratio - r["loss"]) / r["loss"] for b, r in zip(bad, ref))
    key.section("2. Same numbers in every layout", f"""
`{compare}`: exit status **{good.code}**; {good.line_with("eight.jsonl: max")}

Equal to about 7 significant digits at most steps (the median gap {sorted(gaps)[len(gaps) // 2]:.0e}), not bit for
bit: the 8-rank run adds the same numbers in another order (DP sums two half-batch gradients, TP sums partial
matmuls, the pipeline sums micro-batch losses), and float32 addition is not associative; AdamW then lets these
~1e-7 differences grow slowly over the steps (the root README measures how fast). The largest gap,
{gaps[worst]:.1e} at step {worst + 1}, is where the gradient norm jumps to {ref[worst]["grad_norm"]:.0f} (a batch the
model finds hard; after step 1 no other step's norm is above {calm:.1f}): a round-off-sized change of the
weights moves a loss that steep more, and clipping that norm back to 1 keeps the difference from lasting{after}.
`runs/lab04/loss.png` shows two curves on top of each other; the comparison shows by how much they differ.

**Broken on purpose** (`loss_scale=args.global_batch * args.seq_len // mesh.size("dp")`): step-1 loss ÷ reference =
**{ratio:.3f}** (dp = 2: each replica's loss is now the mean over its own half of the tokens, and the
two means are added instead of two halves of one mean); the comparison exits **{bad_cmp.code}**,
{bad_cmp.line_with("first step above") or bad_cmp.line_with("eight.jsonl: max")}. Divided by
{ratio:.0f}, the curve stays within {curve:.1e} of the reference over 10 steps: every gradient is
twice too large, but clipping (norm 1.0) rescales both runs alike while both are above it, and
AdamW divides each update by the running RMS of the gradients, so a constant factor nearly
cancels (not exactly: `eps`, and steps where only one run is clipped). With SGD, or replicas of
unequal size, the training itself would go wrong; here mainly the reported loss does.""")

    # 3. -------------------------------------------------------------------------------------------
    key.run("torchrun --nproc_per_node=8 04_3d_combined/train_3d.py --steps 3 --quiet --sample-tokens 0 --metrics runs/lab04/bytes.jsonl")
    key.run("torchrun --nproc_per_node=8 04_3d_combined/train_3d.py --steps 3 --quiet --sample-tokens 0 --sequence-parallel --metrics runs/lab04/bytes_sp.jsonl")
    key.run("torchrun --nproc_per_node=8 04_3d_combined/train_3d.py --steps 3 --quiet --sample-tokens 0 --pp-sends scatter-gather --metrics runs/lab04/bytes_sg.jsonl")
    b, sp = key.rows("runs/lab04/bytes.jsonl")[-1], key.rows("runs/lab04/bytes_sp.jsonl")[-1]
    sg_rows = key.rows("runs/lab04/bytes_sg.jsonl")
    sg, same = sg_rows[-1], [r["loss"] for r in sg_rows] == [r["loss"] for r in key.rows("runs/lab04/bytes.jsonl")]
    cfg = PRESETS["tiny"]
    model_bytes = count_parameters(cfg) * 4
    act = 2 * 128 * cfg.dim * 4                              # one (2, 128, 128) fp32 activation
    dp_pred, tp_pred, pp_pred = 2 * model_bytes / 4, 4 * (4 * 4 + 1) * 2 * act, 4 * 2 * act
    key.section("3. Who talks how much", f"""
{table(["rank 0, step 3", "dp", "tp", "pp"],
       [["predicted", mib(dp_pred), mib(tp_pred), mib(pp_pred)],
        ["measured", mib(b["comm_bytes_dp"]), mib(b["comm_bytes_tp"]), mib(b["comm_bytes_pp"])],
        ["measured, --sequence-parallel", mib(sp["comm_bytes_dp"]), mib(sp["comm_bytes_tp"]), mib(sp["comm_bytes_pp"])],
        ["measured, --pp-sends scatter-gather", mib(sg["comm_bytes_dp"]), mib(sg["comm_bytes_tp"]),
         mib(sg["comm_bytes_pp"])]])}

- **dp**: rank 0 holds stage 0's TP shard, about 1/4 of the {mib(model_bytes)} model (≈ {mib(model_bytes / 4)}); an
  all-reduce over N = 2 sends 2·(1/2)·n = n and receives n: ≈ {mib(dp_pred)} per step. (The exact value
  differs a little: stage 0 holds the embedding, which is not exactly a quarter, and the norms are
  whole on each TP rank.)
- **tp**: per micro-batch, 4 all-reduces per layer (2 g forward, 2 f backward) × 4 layers + 1 for the
  vocab-parallel embedding = 17, each of a (2, 128, 128) fp32 activation of {act // 1024} KiB, sent and
  received (2(N-1)/N·n = n each way at N = 2): 17 × 2 × 128 KiB × 4 micro-batches = {mib(tp_pred)}.
  TP is the largest by far: it talks in every layer, DP once per step.
- **tp with --sequence-parallel**: each all-reduce became a reduce-scatter plus an all-gather of half
  the volume each, the same bytes; and each column-parallel layer's input, kept as its sequence shard,
  is all-gathered again in backward (Megatron-LM's trade of bytes for activations): 2 entrances per
  layer × 4 layers × 4 micro-batches × 128 KiB = 4.00 MiB more. The small rest is the all-reduce of the
  norm weights' partial gradients (the norms now see only a slice of the sequence).
- **pp**: 4 micro-batches × (one activation sent + one gradient received) × 128 KiB = {mib(pp_pred)}.
  Under sequence parallelism the pipeline message is the sequence shard (2, 64, 128): half.
- **--pp-sends scatter-gather**: pp halves ({mib(b["comm_bytes_pp"])} → {mib(sg["comm_bytes_pp"])}): each TP
  rank sends its half of the flat message; tp grows by one all-gather of each message stage 0 receives (its 4
  gradients, (N-1)/N·n = 64 KiB each way each: {mib(4 * act)}), {mib(b["comm_bytes_tp"])} →
  {mib(sg["comm_bytes_tp"])}. The losses are {"the same, digit for digit" if same else "NOT the same"}: the
  gathered tensor is the one sent whole. Across GPU nodes that moves half (tp−1 of every tp) of the pipeline's
  bytes from the links between nodes onto NVLink inside one; on one CPU it buys nothing.""")

    # 4. -------------------------------------------------------------------------------------------
    key.fresh("runs/lab04/ck")
    key.run("torchrun --nproc_per_node=8 04_3d_combined/train_3d.py --steps 20 --quiet --sample-tokens 0 --checkpoint-dir runs/lab04/ck --checkpoint-every 10 --metrics runs/lab04/a.jsonl")
    key.run("echo step_000010.pt > runs/lab04/ck/latest")
    key.run("torchrun --nproc_per_node=4 04_3d_combined/train_3d.py --steps 20 --quiet --sample-tokens 0 --checkpoint-dir runs/lab04/ck --resume --dp 1 --tp 4 --pp 1 --metrics runs/lab04/b.jsonl")
    resumed = key.run("python -m common.compare_metrics runs/lab04/a.jsonl runs/lab04/b.jsonl", check=False)
    steps = [r["step"] for r in key.rows("runs/lab04/b.jsonl")]
    key.section("4. Resume in another layout", f"""
`b.jsonl` holds steps {steps[0]}–{steps[-1]}; the comparison exits **{resumed.code}**: {resumed.line_with("b.jsonl: max")}

Yes, they are the same steps up to round-off (the two layouts add in different orders, as in §2).
The checkpoint holds the **consolidated single-device state**: every parameter under its reference
name and shape, with its AdamW moments, plus the step (which sets the learning rate), and the data
position is a function of the step alone. Any layout can take its own slices of that: the 4-rank
TP run shards the same tensors along its own dimensions. A checkpoint of shards would tie the
resume to the layout that wrote it.""")

    # 5. -------------------------------------------------------------------------------------------
    failures = key.failures(["torchrun --nproc_per_node=8 04_3d_combined/train_3d.py --dp 2 --tp 2 --pp 4",
                             "torchrun --nproc_per_node=4 04_3d_combined/train_3d.py --tp 4 --sequence-parallel --seq-len 30"],
                            "train_3d.py")
    seconds, code, out = killed_rank_seconds(key)
    key.section("5. Failure on purpose", f"""
{failures}

Both are caught by `parallel_3d.decide_layout` on every rank before any communication: the degrees
must multiply to the world size (2·2·4 = 16 ≠ 8), and under sequence parallelism the sequence
(30 tokens) must split evenly over the 4 TP ranks.

**Killed rank:** `kill -9` of one of the four ranks, about a minute into the run: torchrun exited
**{seconds:.1f} s** later with exit code **{code}**. Its summary lists every rank's exit code:
{killed_report(out)}. The killed rank shows -9 (SIGKILL). A survivor whose collective was talking to
it exits on its own with 1 and `error [rank r]: lost contact with another rank`. torchrun's agent,
which watches its worker processes, stops the rest with SIGTERM (-15). Which survivor gets there
first varies from run to run, and so does the "root cause" torchrun names. Without torchrun (ranks
started by hand, or another node of a multi-node job), a survivor's next collective fails when the
connection drops and it exits with `error [rank r]: lost contact with another rank`; a rank that
hangs instead of dying trips `--timeout` (60 s) on the others.""")

    # 6. -------------------------------------------------------------------------------------------
    rows, rc = [], {}
    for mode in MODES:
        key.run(f"torchrun --nproc_per_node=4 04_3d_combined/train_3d.py --steps 4 --quiet --sample-tokens 0 "
                f"--recompute {mode} --metrics runs/lab04/rc_{mode}.jsonl")
        rc[mode] = key.rows(f"runs/lab04/rc_{mode}.jsonl")
        last = rc[mode][-1]
        rows.append([mode, *(mib(b) for b in last["peak_activation_bytes"]), *(mib(b) for b in last["activation_bytes_predicted"]),
                     f"{median_step_s(rc[mode]):.3f}"])
    same = key.run("python -m common.compare_metrics runs/lab04/rc_none.jsonl runs/lab04/rc_full.jsonl", check=False)
    stage0 = {m: rc[m][-1]["peak_activation_bytes"][0] for m in rc}
    per_mb = 4 * 128 * (4 * 7192 + 12) + 16384                 # one micro-batch on stage 0, none
    slower = median_step_s(rc["full"]) / median_step_s(rc["none"])
    key.section("6. What a rank holds: recomputation", f"""
{table(["--recompute", "measured stage 0", "stage 1", "predicted stage 0", "stage 1", "median step (s)"], rows)}

Stage 0 of a 1F1B pipeline of 2 keeps 2 micro-batches in flight (p − s = 2). One micro-batch under
`none`: 4 sequences × 128 positions × (4 layers × 7,192 + 12) bytes + 16,384 bytes of RoPE tables =
{per_mb:,} bytes, so {mib(2 * per_mb)} for two: the measured {mib(stage0["none"])}. `selective` keeps
{stage0["selective"] / stage0["none"]:.0%} of it (the norms' x·rms and SwiGLU's silu(gate) are rebuilt),
`full` {stage0["full"] / stage0["none"]:.0%} (each block's input, 512 bytes per position, and the
tables). Stage 1 keeps one micro-batch in flight but also the head and the loss's softmax.

`compare_metrics` exits **{same.code}**: {same.line_with("rc_full.jsonl: max")}. Recomputation reruns the
same operations on the same inputs, so every number is bit-identical. Its price is time: `full` ran
**{slower:.2f}×** the step time of `none` here (a second forward of every block: about 1 + 1/3 of the
work, plus its TP collectives again; one short run on a shared machine, so only roughly).""")

    key.section(*key_section("04"))      # the museum's bugs of this chapter: how each is found
    key.write()


if __name__ == "__main__":
    main()
