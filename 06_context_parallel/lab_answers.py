"""Lab 06's answer key: runs every command of LAB.md and writes LAB_ANSWERS.md from what they print.

    python 06_context_parallel/lab_answers.py          # runs every command of LAB.md (about 3 minutes)
"""
import argparse
import re
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters
from common.exercises.museum import key_section  # noqa: E402
from common.lab_key import Edit, Key, mesh_groups, mesh_row, table  # noqa: E402
from common.model import PRESETS  # noqa: E402

attention_bookkeeping = import_module("06_context_parallel.attention_bookkeeping")

CH = "06_context_parallel"
TRAIN = "torchrun --nproc_per_node=4 06_context_parallel/train_cp.py --steps 5 --seq-len 64 --global-batch 8"
RUNS = "/tmp/c3_1.jsonl /tmp/c2_zigzag.jsonl /tmp/c2_contiguous.jsonl /tmp/c3_cp2dp2.jsonl /tmp/c3_cp2tp2.jsonl"
SPLITS = ("python -c \"import sys; sys.path.insert(0, '.'); from importlib import import_module; s = "
          "import_module('06_context_parallel.cp_split'); [print(split, r, s.SequenceSplit(16, 4, split).chunks(r), "
          "s.SequenceSplit(16, 4, split).work(r)) for split in ('contiguous', 'zigzag') for r in range(4)]\"")
C6_ONE = ("for s in 32 64 128; do python 06_context_parallel/train_cp.py --steps 1 --seq-len $s --global-batch 4 "
          "--metrics /tmp/c6_s${s}_cp1.jsonl --quiet; done")
C6_CP = {"s64_cp2": "torchrun --nproc_per_node=2 06_context_parallel/train_cp.py --steps 1 --seq-len 64 --global-batch 4",
         "s128_cp4": "torchrun --nproc_per_node=4 06_context_parallel/train_cp.py --steps 1 --seq-len 128 --global-batch 4",
         "s128_cp4_ag": "torchrun --nproc_per_node=4 06_context_parallel/train_cp.py --steps 1 --seq-len 128 "
                        "--global-batch 4 --cp-attention allgather"}
C7 = ("torchrun --nproc_per_node=8 06_context_parallel/train_5d.py --steps 1 --seq-len 32 --global-batch 8 "
      "--sample-tokens 0 --metrics /tmp/c7.jsonl")


def cp_bytes_per_step(row: dict, B: int, S: int = 64) -> int:
    """attention_bookkeeping.cp_bytes for one attention call, × the layers (one micro-batch per step)."""
    cfg = PRESETS["tiny"]
    return cfg.n_layers * attention_bookkeeping.cp_bytes(row["cp_attention"], B, S, row["cp"],
                                                         cfg.kv_heads_per_rank(row["tp"]), cfg.head_dim, 4)


def part_one(key: Key) -> None:
    out = key.run(SPLITS).out.strip()
    key.section("C1 — the split by hand", f"""
```
{out}
```

Contiguous: rank r's queries [4r, 4r+4) see the keys of every rank at or before it, r+1 blocks of
4 × 4 (the last of them, its own, cut by the mask but computed whole): 16, 32, 48, 64 entries, a ratio
of cp = 4 between the busiest and the idlest rank. Zigzag: chunk i (c = 2 positions) attends to chunks
0..i, i+1 chunk pairs; rank r holds chunks r and 2cp−1−r, so (r+1) + (2cp−r) = 2cp+1 = 9 pairs of
c² = 4 entries: 36 on every rank.

The causal mask has S(S+1)/2 = 136 entries; what a split computes beyond it is the masked half of
each diagonal pair, computed whole and then masked. Contiguous has cp diagonal blocks of S/cp = 4
positions, each with 4·3/2 = 6 masked entries: 136 + 24 = 160. Zigzag has 2cp = 8 diagonal pairs of
c = 2 positions, 1 masked entry each: 136 + 8 = 144. Smaller chunks waste less on the diagonal: for
large S the waste is about S²/(2cp) with the contiguous split and S²/(4cp) with zig-zag, fractions 1/cp
and 1/(2cp) of the causal S²/2.""")

    key.run(f"{TRAIN} --metrics /tmp/c2_zigzag.jsonl --quiet")
    key.run(f"{TRAIN} --cp-split contiguous --metrics /tmp/c2_contiguous.jsonl --quiet")
    imb = {split: sorted({r["attn_work_imbalance"] for r in key.rows(f"/tmp/c2_{split}.jsonl")})
           for split in ("zigzag", "contiguous")}
    key.section("C2 — the two splits' work, measured", f"""
`attn_work_imbalance` over the 5 steps: zigzag {imb["zigzag"]}, contiguous {imb["contiguous"]}.

Contiguous, any cp: rank r computes r+1 blocks of (S/cp)², so max/min = cp/1 = cp; zigzag: 2cp+1 chunk
pairs of c² on every rank, max/min = 1. Every CP rank waits for the others at each hop of the ring
and at the gradient all-reduce, so a step takes as long as its busiest rank: with the contiguous
split, the last rank's cp blocks, while rank 0 idles after one. (The metric counts the score
entries computed, a count, not a time: the same on every machine.)

{timeline_answer(key)}""")


def timeline_answer(key: Key) -> str:
    """C2's `--timeline` runs: each rank's ring compute (CPU and wall) and wait, per split, and why the step
    time does not show them on shared cores."""
    rows, cpu, step = [], {}, {}
    for split, flag in (("zigzag", ""), ("contiguous", " --cp-split contiguous")):
        out = key.run(f"{TRAIN}{flag} --timeline /tmp/c2_{split}_trace.json").out
        for r, c, w, wait in re.findall(r"rank (\d): ring attention forward, all steps and layers: computing +([\d.]+) ms "
                                        r"of CPU \( *([\d.]+) ms wall\), waiting for a block +([\d.]+) ms", out):
            rows.append([split, r, c, w, wait])
            cpu[split, int(r)] = float(c)
        step[split] = re.search(r"median step time\s*│\s*([\d.]+) ms", out).group(1)
    z = [cpu["zigzag", r] for r in range(4)]
    return table(["split", "rank", "computing, ms of CPU", "computing, ms wall", "waiting for a block, ms"], rows) + f"""

Zig-zag: the ranks' compute CPU time within {100 * (max(z) / min(z) - 1):.0f} % of each other. Contiguous: it grows
with the rank, rank 3 {cpu["contiguous", 3] / cpu["contiguous", 0]:.1f}× rank 0 (not 4×: each ring step also
pays a fixed cost, the merge and the bookkeeping, for a skipped block too). The wall-clock spans are longer and
noisier than the CPU time: 4 ranks share 2 cores, so a rank is descheduled mid-span. Median step times:
zigzag {step["zigzag"]} ms, contiguous {step["contiguous"]} ms, a ratio of {float(step["contiguous"]) /
float(step["zigzag"]):.1f}, far from cp = 4 (and it moves from run to run with whatever else the 2 cores do):
on shared cores a waiting rank gives its core to one that computes, so the step lasts about the total work ÷
the cores, nearly the same for both splits. With one GPU per rank a waiting GPU helps nobody: the contiguous
step lasts as long as rank 3's attention, cp times rank 0's work."""


def part_two(key: Key) -> None:
    key.run("python 06_context_parallel/train_cp.py --steps 5 --seq-len 64 --global-batch 8 --metrics /tmp/c3_1.jsonl --quiet")
    key.run(f"{TRAIN} --cp 2 --cp-attention allgather --metrics /tmp/c3_cp2dp2.jsonl --quiet")
    key.run(f"{TRAIN} --cp 2 --tp 2 --metrics /tmp/c3_cp2tp2.jsonl --quiet")
    cmps = {k: key.run(f"python -m common.compare_metrics {RUNS}{flag}", check=False)
            for k, flag in (("loss", ""), ("grad_norm", " --key grad_norm"))}
    names = ("c2_zigzag", "c2_contiguous", "c3_cp2dp2", "c3_cp2tp2")
    lines = "\n".join(f"- `{k}`: exit {r.code}; " + "; ".join(r.line_with(f"{n}.jsonl: max") for n in names)
                      for k, r in cmps.items())
    tp_row = key.rows("/tmp/c3_cp2tp2.jsonl")[0]
    one_row = key.rows("/tmp/c3_1.jsonl")[0]
    key.names(f"{CH}/train_cp.py", 'global_sum(local_loss, mesh.group("dp_cp"))')
    key.section("C3 — every layout, the same losses", f"""
{lines}

Step 1: one rank {one_row["loss"]:.7f}, CP 2 × TP 2 {tp_row["loss"]:.7f}; `tokens` {one_row["tokens"]:,} and
{tp_row["tokens"]:,}.

The printed loss is `global_sum(local_loss, mesh.group("dp_cp"))`: each rank's share (its rows, its
positions, divided by the global token count) summed over the ranks that hold *different* tokens.
The two TP ranks of a group hold the same tokens, and chapter 02's vocab-parallel cross-entropy gives
each of them the whole loss of those tokens: summed over all 4 ranks, the CP × TP run would print
twice the loss ({2 * tp_row["loss"]:.4f} at step 1), with gradients still right — the kind of bug that
only a comparison with one device shows. `tokens` is the global batch, 8 × 64 = 512, counted once:
the CP ranks of a row hold different positions of it, not copies.""")

    rows = []
    for name, B in (("c2_zigzag", 8), ("c3_cp2dp2", 4), ("c3_cp2tp2", 8)):
        measured = {r["comm_bytes_cp"] for r in key.rows(f"/tmp/{name}.jsonl")}
        r = key.rows(f"/tmp/{name}.jsonl")[0]
        rows.append([f"`{name}`", f"cp {r['cp']} × dp {r['dp']} × tp {r['tp']}, {r['cp_attention']}",
                     f"{cp_bytes_per_step(r, B):,}", ", ".join(f"{m:,}" for m in sorted(measured))])
    key.section("C4 — the ring's bytes", table(["run", "layout", "formula (bytes / step)", "measured, every step"], rows)
                + """

The ring moves K and V twice because the backward needs every block again, and no rank kept the
other ranks' blocks: it sends them around a second time, next to the travelling partial sums of dK
and dV (in fp32). The all-gather gathers K and V once and keeps the whole sequence's K and V for the
backward: fewer bytes, and one collective instead of cp−1 dependent hops, but every rank then holds
O(S) of K/V instead of O(S/cp) — C6 measures that price. Under GQA (kv < h) both move only the small
K/V heads.""")

    edit = Edit(f"{CH}/train_cp.py", 'cp_group, mesh.group("dp_cp"), split', 'cp_group, mesh.group("dp"), split')
    with key.broken(edit) as root:
        key.run(f"{TRAIN} --metrics /tmp/c5_broken.jsonl --quiet", root=root)
    broken = {k: key.run(f"python -m common.compare_metrics /tmp/c3_1.jsonl /tmp/c5_broken.jsonl{flag}", check=False)
              for k, flag in (("loss", ""), ("grad_norm", " --key grad_norm"))}
    b, ref = key.rows("/tmp/c5_broken.jsonl"), key.rows("/tmp/c3_1.jsonl")
    key.section("C5 — break it on purpose: the gradients summed over dp only", """
| step | loss, 1 rank | loss, broken | grad_norm, 1 rank | grad_norm, broken |
|---|---|---|---|---|
""" + "\n".join(f"| {x['step']} | {x['loss']:.7f} | {y['loss']:.7f} | {x['grad_norm']:.5f} | {y['grad_norm']:.5f} |"
                for x, y in zip(ref, b)) + f"""

`loss`: exit {broken["loss"].code}, {broken["loss"].line_with("c5_broken.jsonl: max")}; `grad_norm`: exit
{broken["grad_norm"].code}, {broken["grad_norm"].line_with("c5_broken.jsonl: max")}.

At cp 4 × dp 1 the DP group is one rank: nothing is summed, and each rank steps with the gradient of
its own quarter of the positions (rank 0's is what the metrics print). The step-1 loss is computed
before any gradient, so it is exact; the gradient norm is wrong from step 1, and the weights — now
different on every CP rank — make every later loss wrong. `tests/test_cp.py::test_every_cp_layout_matches_one_device`
fails on it (its `grad_norm` at step 1, and the losses after, on every rank, against world size 1);
`tests/test_ring_attention.py` passes, because the attention alone is still exact — the bug is in
which group sums the gradients, and only an end-to-end comparison with one device sees it.""")


def part_three(key: Key) -> None:
    key.run(C6_ONE)
    for name, cmd in C6_CP.items():
        key.run(f"{cmd} --metrics /tmp/c6_{name}.jsonl --quiet")
    peak = {name: key.rows(f"/tmp/c6_{name}.jsonl")[0]["peak_activation_bytes"]
            for name in ("s32_cp1", "s64_cp1", "s128_cp1", "s64_cp2", "s128_cp4", "s128_cp4_ag")}
    base = peak["s32_cp1"]
    labels = {"s32_cp1": "S 32, 1 rank", "s64_cp1": "S 64, 1 rank", "s128_cp1": "S 128, 1 rank",
              "s64_cp2": "S 64, cp 2", "s128_cp4": "S 128, cp 4", "s128_cp4_ag": "S 128, cp 4, all-gather"}
    rows = [[labels[name], f"{v:,}", f"{v / base:.3f}"] for name, v in peak.items()]
    blk = 4 * 32 * 4 * 16 * 4
    extra = 8 * (4 - 1) * 2 * blk
    key.section("C6 — activations as S and cp double together",
                table(["run", "peak_activation_bytes (rank 0)", "÷ S 32, cp 1"], rows) + f"""

One rank: every saved activation is (B, S, ·), so the bytes double with S. With CP each rank holds S/cp = 32 positions of every
layer's activations, whatever S is, and the ring attention saves only its own q, k, v, output and
log-sum-exp: the same bytes as S = 32 on one rank, within 5 %. The all-gather variant keeps the
gathered K and V of all cp ranks for its backward: (cp−1) = 3 other ranks' K and V blocks of
{blk:,} bytes per layer, 8 × 3 × 2 × {blk:,} = {extra:,} bytes more; measured
{peak["s128_cp4_ag"] - peak["s128_cp4"]:,}.""")


def part_four(key: Key) -> None:
    out = key.run(C7).out
    # train_5d.py's ranks table: rank, dp, dp_cp, edp_cp, edp, ep, pp, cp, tp, experts, positions; then its groups
    r, g = mesh_row(out, 5, 11), mesh_groups(out, 5)
    context_row = next((line.strip(" │") for line in out.splitlines() if "│ context" in line), "")
    key.section("C7 — five coordinates per rank", f"""
Rank 5's row of the ranks table:

{table(["rank", "dp", "dp_cp", "edp_cp", "edp", "ep", "pp", "cp", "tp", "experts", "positions"], [r])}

and its groups, from the groups table:

{table(list(g), [list(g.values())])}

The configuration's context row: `{re.sub(r"[│ ]+", " ", context_row).strip()}`

5 = 4·1 + 2·0 + 1: ep 1, pp 0, cp 1 (edp 0, tp 0), so dp = ep = 1. Its cp group is the rank that
differs only in cp, 4; zig-zag over 2·cp = 4 chunks of 8 gives cp rank 1 chunks 1 and 2, positions
8–15 and 16–23. Its dense gradients are summed over dp × cp, the ranks with its pp 0 and tp 0:
0, 1, 4, 5 (two data-parallel rows, two halves of each sequence); its experts (4–7, held by ep 1)
over edp × cp: 4 and 5 (edp is 1, so only the CP partner holds the same experts).

TP talks inside every layer, twice per block, with nothing to hide behind: it gets the fastest links
(innermost, consecutive ranks). CP talks inside every attention, a hop per block that can overlap
the block's compute: next to TP, still inside a node where possible. PP sends one activation per
micro-batch per stage boundary, and DP (edp) sums gradients once per step, overlapped with the
backward: they tolerate the slowest links, outermost.""")

    failures = key.failures(["torchrun --nproc_per_node=4 06_context_parallel/train_cp.py --seq-len 36",
                             "torchrun --nproc_per_node=4 06_context_parallel/train_cp.py --cp 3",
                             "torchrun --nproc_per_node=4 06_context_parallel/train_5d.py --cp 2 --capacity-factor 1.0",
                             "torchrun --nproc_per_node=4 06_context_parallel/train_5d.py --model tiny --cp 2 --dp 2 --tp 2 --pp 1"],
                            "06_context_parallel/")
    key.section("C8 — bad input", failures + """

A capacity serves each sequence's tokens in position order until an expert is full; with CP a rank
holds only some positions of each sequence (zig-zag: not even in order), so which token is dropped
would depend on the layout. ZeRO with CP shards over dp × cp, not over the DP group alone: after the
gradients are summed over dp × cp, every rank of that group holds the same dense gradient, so each
can keep 1/(dp·cp) of the state; the DP group alone would leave the CP ranks' shards duplicated
(`torchrun --nproc_per_node=4 06_context_parallel/train_5d.py --model tiny --cp 2 --zero-stage 1` runs,
the same losses as one device).""")


def part_six(key: Key) -> None:
    """C10: the all-to-all's bytes against the formula, and a heads/sequence transposition that still runs."""
    cfg, B, S = PRESETS["tiny"], 8, 64
    runs = {"a2a": ("alltoall", 1), "hybrid": ("alltoall+ring", 2)}
    key.run(f"{TRAIN} --cp-attention alltoall --metrics /tmp/c10_a2a.jsonl --quiet")
    key.run(f"{TRAIN} --cp-attention alltoall+ring --cp-alltoall 2 --metrics /tmp/c10_hybrid.jsonl --quiet")
    same = key.run("python -m common.compare_metrics /tmp/c3_1.jsonl /tmp/c10_a2a.jsonl /tmp/c10_hybrid.jsonl", check=False)
    rows = []
    for name, (variant, K) in runs.items():
        formula = cfg.n_layers * attention_bookkeeping.cp_bytes(variant, B, S, 4, cfg.n_kv_heads, cfg.head_dim, 4,
                                                                h=cfg.n_heads, K=K)
        measured = sorted({r["comm_bytes_cp"] for r in key.rows(f"/tmp/c10_{name}.jsonl")})
        rows.append([f"`--cp-attention {variant}`" + (f" `--cp-alltoall {K}`" if K > 1 else ""), f"{formula:,}",
                     ", ".join(f"{m:,}" for m in measured)])
    edit = Edit(f"{CH}/alltoall_attention.py", "t.permute(1, 2, 0, 3, 4).reshape(B, a // self.n, self.n * L, hd)",
                "t.permute(1, 0, 2, 3, 4).reshape(B, a // self.n, self.n * L, hd)")
    with key.broken(edit) as root:
        key.run(f"{TRAIN} --cp-attention alltoall --metrics /tmp/c10_broken.jsonl --quiet", root=root)
    b, ref = key.rows("/tmp/c10_broken.jsonl"), key.rows("/tmp/c3_1.jsonl")
    key.section("C10 — the all-to-all: predict its bytes, then break it", table(
        ["run (cp 4, B 8, S 64)", "formula (bytes / step)", "measured, every step"], rows) + f"""

(a) One layer's q, k, v and output on a rank: B·(S/cp)·(h + 2kv + h)·hd·4 = 8·16·24·16·4 = 196,608 bytes;
the four all-to-alls of forward and backward send 3/4 of it twice each way: 4 · 3/4 · 196,608 = 589,824
per layer, × 8 = 4,718,592, half the ring's 9,437,184. The hybrid: the all-to-all over 2 ranks, 4 · 1/2 ·
196,608, plus a ring of 2 groups on 2 KV heads of 32 positions, 12 · 1 · 32,768: 786,432 per layer. Both
train as one device: `compare_metrics` exit {same.code}, {same.line_with("c10_a2a.jsonl: max")};
{same.line_with("c10_hybrid.jsonl: max")}.

The all-to-all over the ring is (2h + 2kv)/(3·cp·kv): for tiny (h/kv = 2) 2/cp, equal at cp 2; for MHA
4/(3cp), below 1 from cp 2 on; for h/kv = 8, 6/cp (equal at cp 6). At fixed S the ring's bytes per rank
stay about 12·S·kv·hd·4 while the all-to-all's fall as 1/cp. `--cp 8` refuses it for tiny, on every rank
before any communication: 8 ranks cannot share 4 KV heads (`check_alltoall`; DeepSpeed-Ulysses refuses the
same, some implementations replicate KV heads instead).

(b) The broken run, step by step:

| step | loss, 1 rank | loss, broken | grad_norm, 1 rank | grad_norm, broken |
|---|---|---|---|---|
""" + "\n".join(f"| {x['step']} | {x['loss']:.7f} | {y['loss']:.7f} | {x['grad_norm']:.5f} | {y['grad_norm']:.5f} |"
                for x, y in zip(ref, b)) + f"""

Bytes {b[0]["comm_bytes_cp"]:,} (the formula's: the same tensors are sent) and work imbalance
{b[0]["attn_work_imbalance"]}: nothing the bookkeeping sees changes. The received pieces are (rank, head,
position); read as (head, rank·position), each "head" of the attention is a mixture of heads and of other
ranks' positions, and the causal order is lost. The step-1 loss is off by only
{abs(b[0]["loss"] / ref[0]["loss"] - 1):.1e} relative (at initialisation attention is close to uniform, so
scrambling what it averages changes little), far above round-off's 1e-6, and the runs drift apart from there.
It still runs because the element count is the same. `tests/test_ring_attention.py::test_matches_single_device_attention`
fails on it (the all-to-all and hybrid cases: output and gradients off by tens of percent), and so does
`tests/test_cp.py` at step 1; the ring's and all-gather's cases pass, as they never call `Repartition`. Undo
the change.""")


def main(argv=None) -> None:
    # --help prints what this does, and runs nothing (the whole key takes minutes)
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    key = Key(CH, "Chapter 06 lab — context parallelism")
    key.names(f"{CH}/cp_split.py", "def work", "def chunks")
    part_one(key)
    part_two(key)
    part_three(key)
    part_four(key)
    part_six(key)                        # C10: the all-to-all
    key.section(*key_section("06"))      # the museum's bugs of this chapter: how each is found
    key.write()


if __name__ == "__main__":
    main()
