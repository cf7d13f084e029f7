"""Chapter 06 benchmark: context parallelism against one device, its bytes, memory, balance, speed and overlap.

    python 06_context_parallel/bench_cp.py                       # every part (about 5 minutes on 2 cores)
    python 06_context_parallel/bench_cp.py --only memory time    # some of: equality bytes memory balance time overlap

Writes 06_context_parallel/results/:
  equality.md                   every layout of train_cp.py and train_5d.py against world size 1, 20 steps
  bytes.md                      comm_bytes_cp per rank and step against attention_bookkeeping.cp_bytes, to the byte
  memory.md, memory.png         peak activation bytes per rank as S and cp double together, against cp 1
  balance.md, causal_mask.png   attn_work_imbalance, zig-zag vs contiguous; the causal mask cut into ranks' blocks
  time.md                       median step time against S at cp 1, 2, 4
  overlap.md, ring_timeline.png one ring step's compute against one hop (overlap_cp.py), and ring forwards
Every number comes from the chapter's own scripts' metrics files (or overlap_cp.py's). Bytes, attention work and
activation bytes are the same on every machine; times (and what depends on them) are this machine's.
A run that two parts need (same script, ranks and flags) runs once.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from importlib import import_module
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from common.launch import launch  # noqa: E402
from common.metrics import read_metrics  # noqa: E402
from common.model import PRESETS  # noqa: E402

bench_3d = import_module("04_3d_combined.bench_3d")                   # chapter 04: write
cp_split = import_module("06_context_parallel.cp_split")              # this chapter: the split's work
attention_bookkeeping = import_module("06_context_parallel.attention_bookkeeping")  # this chapter: the bytes formula
plot_cp = import_module("06_context_parallel.plot_cp")                # this chapter: the plots

RESULTS = HERE / "results"
CP, FIVE = HERE / "train_cp.py", HERE / "train_5d.py"
PARTS = ("equality", "bytes", "memory", "balance", "time", "overlap")
# equality: 20 steps of 8 × 64 tokens; groups of {name: (script, ranks, flags)}, each against its first (1 rank)
EQUAL = ["--steps", "20", "--seq-len", "64", "--global-batch", "8"]
FIVE_FLAGS = ["--sample-tokens", "0", "--val-every", "0"]
GROUPS = [
    {"1 rank (reference)": (CP, 1, []),
     "control: 1 rank, 2 micro-batches": (CP, 1, ["--microbatches", "2"]),
     "control: dp 2, no CP": (CP, 2, ["--dp", "2", "--cp", "1"]),
     "cp 2": (CP, 2, ["--cp", "2"]), "cp 4": (CP, 4, ["--cp", "4"]), "cp 2 × dp 2": (CP, 4, ["--cp", "2"]),
     "cp 2 × tp 2": (CP, 4, ["--cp", "2", "--tp", "2"]),
     "cp 4, all-gather": (CP, 4, ["--cp", "4", "--cp-attention", "allgather"]),
     "cp 4, contiguous": (CP, 4, ["--cp", "4", "--cp-split", "contiguous"])},
    {"5D tiny-moe, 1 rank (reference)": (FIVE, 1, FIVE_FLAGS),
     "5D tiny-moe, default layout: dp 2 = edp 1 × ep 2, pp 2, cp 2": (FIVE, 8, FIVE_FLAGS)},
    {"5D dense tiny, 1 rank (reference)": (FIVE, 1, ["--model", "tiny", *FIVE_FLAGS]),
     "5D dense tiny, default layout": (FIVE, 8, ["--model", "tiny", *FIVE_FLAGS])},
]
# bytes, memory, balance, time: the small preset (max_seq_len 512), 2 rows per step, zig-zag ring unless named
SMALL = ["--model", "small", "--global-batch", "2"]
TIME_STEPS, SEQS, TIME_CPS = 4, (128, 256, 512), (1, 2, 4)
SCALED = [(128, 2), (256, 4), (512, 8)]          # S and cp doubling together: 64 positions per rank
TIMELINES = (32, 128, 512)                       # the block sizes ring_timeline.png draws
ALLGATHER = ("--cp-attention", "allgather", "--cp-split", "contiguous")


def small(S: int, cp: int, *extra: str) -> tuple:
    """A small-preset run of train_cp.py on cp ranks. The time grid's runs (zig-zag ring) train TIME_STEPS steps
    and serve the memory, bytes and balance tables too (from step 1); the others need one step."""
    steps = TIME_STEPS if not extra and S in SEQS and cp in TIME_CPS else 1
    return (CP, cp, [*SMALL, "--seq-len", str(S), "--cp", str(cp), "--steps", str(steps), *extra])


def machine() -> str:
    return (f"Machine: {os.cpu_count()}-core {platform.machine()} CPU, gloo, threads per rank = cores ÷ ranks "
            f"(at least 1)")


class Runs:
    """Launches each (script, ranks, flags, round) once; returns rank 0's metrics rows."""

    def __init__(self, tmp: Path):
        self.tmp, self.done = tmp, {}

    def __call__(self, script: Path, ranks: int, flags: list, rnd: int = 0) -> list[dict]:
        key = (script.name, ranks, tuple(flags), rnd)
        if key not in self.done:
            out, start = self.tmp / f"{len(self.done)}.jsonl", time.perf_counter()
            launch(script, ranks, [*flags, "--quiet", "--metrics", out], echo=False, quiet=True)
            self.done[key] = read_metrics(out)
            seconds = time.perf_counter() - start
            print(f"{script.name} on {ranks} rank(s) {' '.join(flags)}: {seconds:.0f} s", flush=True)
        return self.done[key]


def command(part: str, more: str = "") -> str:
    return f"Command: `python 06_context_parallel/bench_cp.py --only {part}{more}`"


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def equality(runs: Runs) -> list[str]:
    lines = [f"{machine()}; 20 steps of 8 × 64 tokens, seed 1337; train_cp.py's model tiny, train_5d.py's tiny-moe "
             "(its default) and tiny.", command("equality"), "",
             "| layout | script | ranks | max loss rel. diff | max grad_norm rel. diff | first step above 1e-5: loss "
             "| … grad_norm | first step routing differs | comm_bytes_cp / step | attn_work_imbalance |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    worst = 0.0
    for layouts in GROUPS:
        script, ranks, flags = next(iter(layouts.values()))
        ref = runs(script, ranks, EQUAL + flags)
        for name, (script, ranks, flags) in layouts.items():
            rows = runs(script, ranks, EQUAL + flags)
            diffs = {k: [rel(a[k], b[k]) for a, b in zip(rows, ref)] for k in ("loss", "grad_norm")}
            above = {k: next((r["step"] for r, x in zip(rows, d) if x > 1e-5), "-") for k, d in diffs.items()}
            routed = "-" if "expert_load" not in ref[0] else next(
                (a["step"] for a, b in zip(rows, ref) if a["expert_load"] != b["expert_load"]), "never")
            worst = max([worst] + diffs["loss"]) if routed == "-" else worst
            imb = rows[-1].get("attn_work_imbalance")
            lines.append(f"| {name} | {script.name} | {ranks} | {max(diffs['loss']):.1e} "
                         f"| {max(diffs['grad_norm']):.1e} | {above['loss']} | {above['grad_norm']} | {routed} "
                         f"| {rows[-1].get('comm_bytes_cp', 0):,} | {'-' if imb is None else f'{imb:.2f}'} |")
    lines += ["", "Rank 0's metrics rows, step by step, against the first row of each group (world size 1); "
              "`python -m common.compare_metrics REF RUN [--key grad_norm]` prints the same per step. Every dense "
              f"layout keeps its loss within {worst:.1e} of one device for all 20 steps. The gradient norm parts "
              "further in the last steps, and so it does in the two controls, which have no context parallelism: "
              "one rank with the batch cut into two micro-batches, and DP 2. What parts them is the order of float32 "
              "additions, which AdamW turns into weight differences that grow with the steps, and to which the "
              "gradient norm of this short, clipped run reacts more than the loss. The 5D tiny-moe run trains a "
              "mixture of experts: top-k routing is discrete, and once one token's near-tie between two experts "
              "goes the other way (the step where `expert_load` first differs) the runs part like two runs that "
              "differ in one bit (chapter 05, section 8); the same layout with the dense tiny model shows the "
              "5D composition itself within round-off. comm_bytes_cp and attn_work_imbalance: rank 0's, last step."]
    return lines


def cp_bytes_per_step(S: int, cp: int, variant: str) -> int:
    cfg = PRESETS["small"]
    return cfg.n_layers * attention_bookkeeping.cp_bytes(variant, 2, S, cp, cfg.n_kv_heads, cfg.head_dim, 4)


def bytes_table(runs: Runs) -> list[str]:
    cfg = PRESETS["small"]
    lines = [f"{machine()}; model small ({cfg.n_layers} layers, kv heads {cfg.n_kv_heads}, head dim {cfg.head_dim}), "
             "2 sequences per step, S/cp = 64 positions per rank, fp32; step 1.", command("bytes"), "",
             "| attention | S | cp | blk (bytes) | comm_bytes_cp measured | L × cp_bytes(...) | equal |",
             "|---|---|---|---|---|---|---|"]
    for variant, extra in (("ring", ()), ("allgather", ALLGATHER)):
        for S, cp in SCALED:
            got = runs(*small(S, cp, *extra))[0]["comm_bytes_cp"]
            want = cp_bytes_per_step(S, cp, variant)
            blk = 2 * (S // cp) * cfg.n_kv_heads * cfg.head_dim * 4
            lines.append(f"| {variant} | {S} | {cp} | {blk:,} | {got:,} | {want:,} | {'yes' if got == want else 'NO'} "
                         "|")
    lines += ["", "Bytes one rank sends plus receives under \"cp\" in one step (common/comm.py's count), against "
              "`attention_bookkeeping.cp_bytes` × layers × micro-batches (1 here). blk = rows·(S/cp)·kv·hd·4 "
              "bytes is one rank's K (or V) block. **Ring**: the forward passes K and V on cp−1 hops (2(cp−1) "
              "blocks); the backward passes them around again (2(cp−1) blocks) together with the travelling partial "
              "sums of dK and dV (2(cp−1) blocks, which end at their owner): 6(cp−1)·blk sent, as many received. "
              "**All-gather**: one all-gather of K and V and one reduce-scatter of dK and dV, each moving (cp−1)/cp "
              "of cp·2·blk: 4(cp−1)·blk sent, as many received — a third less than the ring, because it keeps the "
              "gathered K/V for the backward instead of passing it again (the memory table shows that cost). The "
              "all-gather runs use the contiguous split: bytes do not depend on the split. The same on every "
              "machine."]
    return lines


def memory(runs: Runs) -> list[str]:
    cfg = PRESETS["small"]
    series = {"cp 1 (one rank holds all S)": [], "ring, zig-zag (S/cp per rank)": [],
              "all-gather (K/V of all S saved)": []}
    lines = [f"{machine()}; model small, 2 sequences per step, fp32; rank 0, step 1 (every step and rank holds the "
             "same).", command("memory"), "",
             "| S | cp 1 (bytes) | ring at cp = S/64 (bytes) | ring vs S 128 | all-gather at cp = S/64 (bytes) "
             "| all-gather − ring | L·2·rows·(S − S/cp)·kv·hd·4 |", "|---|---|---|---|---|---|---|"]
    measured = {(S, cp): [runs(*small(S, c, *extra))[0]["peak_activation_bytes"]   # cp 1, ring, all-gather
                          for c, extra in ((1, ()), (cp, ()), (cp, ALLGATHER))] for S, cp in SCALED}
    first = measured[SCALED[0]][1]
    for (S, cp), (one, ring, ag) in measured.items():
        for name, value in zip(series, (one, ring, ag)):
            series[name].append((f"S {S}, cp {cp}", value))
        gathered = cfg.n_layers * 2 * 2 * (S - S // cp) * cfg.n_kv_heads * cfg.head_dim * 4
        lines.append(f"| {S} | {one:,} | {ring:,} (cp {cp}) | {ring / first - 1:+.2%} | {ag:,} (cp {cp}) "
                     f"| {ag - ring:,} | {gathered:,} |")
    lines += ["", "Peak bytes of the tensors autograd saves for the backward (measured by common/activation_meter.py), per rank, as S and "
              "cp double together at the same 2 rows. At cp 1 they double with S: every layer saves tensors per "
              "token, and one rank holds all 2·S tokens. With the ring every rank holds 2 × 64 tokens whatever S, "
              "and its attention saves only its own positions' q, k, v, output and log-sum-exp (no S × S matrix, "
              "no other rank's K/V): flat. The all-gather variant saves the gathered K and V of the whole sequence "
              "for its backward: the other ranks' S − S/cp positions of K and V in each of the L layers, exactly "
              "the last column, which grows with S. Bytes are the same on every machine."]
    plot_cp.plot_memory(RESULTS / "memory.png", series, note=f"model small, 2 × S tokens per step. {machine()}")
    return lines


def balance(runs: Runs) -> list[str]:
    lines = [f"{machine()}; model small, 2 sequences per step, S/cp = 64; step 1.", command("balance"), "",
             "| cp | S | zig-zag measured | zig-zag theory | contiguous measured | contiguous theory |",
             "|---|---|---|---|---|---|"]
    for S, cp in SCALED:
        zig = runs(*small(S, cp))[0]["attn_work_imbalance"]
        cont = runs(*small(S, cp, *ALLGATHER))[0]["attn_work_imbalance"]
        theory = {name: max(w) / min(w) for name in cp_split.SPLITS
                  for w in [[cp_split.SequenceSplit(S, cp, name).work(r) for r in range(cp)]]}
        lines.append(f"| {cp} | {S} | {zig:.3f} | {theory['zigzag']:.3f} (1) | {cont:.3f} "
                     f"| {theory['contiguous']:.3f} (cp) |")
    lines += ["", "`attn_work_imbalance`: max over min, over the CP ranks, of the score entries each computed in the "
              "step (forward and the backward's recomputation; a pair the mask cuts through counts whole). Theory "
              "from `SequenceSplit.work`: **contiguous**, rank r's queries meet r+1 of the cp equal blocks "
              "(the diagonal one computed whole, then masked), so the last rank computes cp blocks and the "
              "first one: ratio cp. **Zig-zag**, 2cp chunks, rank r holds chunks r and 2cp−1−r, which attend to "
              "r+1 and 2cp−r chunks: 2cp+1 chunk pairs on every rank, ratio 1. The contiguous runs use the "
              "all-gather attention (the work does not depend on the variant). The same on every machine. "
              "causal_mask.png: the mask at S 32, cp 4, each score entry coloured by the rank that computes it."]
    plot_cp.plot_causal_mask(RESULTS / "causal_mask.png", 32, 4, note="06_context_parallel/plot_cp.py --mask 32 4")
    return lines


def time_table(runs: Runs, rounds: int) -> list[str]:
    times = {(S, cp): [] for S in SEQS for cp in TIME_CPS}
    for rnd in range(rounds):                     # rounds interleave the runs: the machine's drift spreads over all
        for S, cp in times:
            times[S, cp] += [r["step_time_s"] for r in runs(*small(S, cp), rnd)[1:]]
    lines = [f"{machine()}; model small, 2 sequences per step, zig-zag ring; {rounds} round(s) × {TIME_STEPS} steps, "
             f"median over steps 2..{TIME_STEPS}.", command("time", f" --rounds {rounds}" * (rounds > 1)),
             "", "| S | " + " | ".join(f"cp {cp}: s/step (tokens/s)" for cp in TIME_CPS) + " | cp 4 vs cp 1 |",
             "|---|" + "---|" * (len(TIME_CPS) + 1)]
    for S in SEQS:
        med = {cp: statistics.median(times[S, cp]) for cp in TIME_CPS}
        cells = " | ".join(f"{med[cp]:.3f} ({2 * S / med[cp]:,.0f})" for cp in TIME_CPS)
        lines.append(f"| {S} | {cells} | {med[1] / med[4]:.2f}× |")
    lines += ["", "Times vary by machine and from run to run. On a 2-core CPU, cp ranks share 2 cores: more ranks add "
              "messages and process switches, not compute; CP pays where each rank has its own device and the "
              "sequence no longer fits one."]
    return lines


def overlap(tmp: Path) -> list[str]:
    out = tmp / "overlap.json"
    launch(HERE / "overlap_cp.py", 2, ["--out", out], echo=False, quiet=True)
    d = json.loads(out.read_text())
    sweep, c_star = d["sweep"], d["crossover_c"]
    F = max(r["flops"] / r["compute_s"] for r in sweep)           # the best rates the sweep reached
    B = max(r["bytes"] / r["hop_s"] for r in sweep)
    lines = [f"{machine()}: 2 ranks, {d['threads_per_rank']} thread each; model {d['model']} (h {d['h']}, "
             f"kv {d['kv']}, hd {d['hd']}), {d['rows']} sequences, fp32.", command("overlap") + " (it runs `torchrun "
             "--nproc_per_node=2 06_context_parallel/overlap_cp.py`)", "",
             "| c | compute, one block pair (ms) | one hop alone (ms) | compute / hop | GFLOP/s | hop GB/s "
             "| ring forward: posting (ms) | its step 0 compute (ms) | its wait for the next block (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    waits = {}
    for r in sweep:
        spans = {kind: statistics.median(e["end"] - e["start"] for e in d["timelines"][str(r["c"])]
                                         if e["kind"] == kind and e["ring_step"] == 0)
                 for kind in ("post", "compute", "wait")}
        waits[r["c"]] = spans["wait"]
        lines.append(f"| {r['c']} | {r['compute_s'] * 1e3:.3f} | {r['hop_s'] * 1e3:.3f} "
                     f"| {r['compute_s'] / r['hop_s']:.1f} | {r['flops'] / r['compute_s'] / 1e9:.1f} "
                     f"| {r['bytes'] / r['hop_s'] / 1e9:.2f} | "
                     + " | ".join(f"{spans[k] * 1e3:.3f}" for k in ("post", "compute", "wait")) + " |")
    hidden = next((r["c"] for r in sweep                  # the smallest c from which on the ring's wait is < hop/10
                   if all(waits[x["c"]] < 0.1 * x["hop_s"] for x in sweep if x["c"] >= r["c"])), None)
    where = (f"c* ≈ {c_star:.0f} positions per rank" if c_star and c_star > sweep[0]["c"] else
             f"compute ≥ hop at every swept c (c* < {sweep[0]['c']})" if c_star else "no crossover in the sweep")
    lines += ["", f"**Crossover, measured: {where}.** From the best rates of the sweep, F = {F / 1e9:.1f} GFLOP/s and "
              f"B = {B / 1e9:.2f} GB/s, the bandwidth condition alone, c ≥ (2·kv/h)·F/B, gives c ≥ "
              f"{2 * d['kv'] / d['h'] * F / B:.1f}; a hop's fixed latency moves the real crossover above it. "
              "**In the ring** (columns 7–9) the wait for the next block stays below a tenth of a hop alone "
              + (f"from c = {hidden} on." if hidden else "at no swept c."), "",
              "Columns 2–6: **compute** is one block pair's attention forward (c queries against c keys, unmasked: "
              "ring_attention's attend_block), 4·rows·h·c²·hd FLOPs; a **hop** sends one K/V block "
              "(2·rows·kv·c·hd·4 bytes) to the other rank while receiving its block (comm.exchange); each the "
              "best of 5 timings of back-to-back calls, on the slower rank. Compute grows as c², a hop as c "
              "plus a fixed latency: from c* on, one block pair's compute outlasts a hop alone, the condition for "
              "the ring to hide the hop under it. Columns 7–9: "
              f"{d['layers']} real ring forwards at each c (zig-zag, cp 2, S = 2c; each started after a barrier) "
              "with attention_bookkeeping.RingSpans handed to the ring, medians over both ranks of ring step 0: "
              "posting the hop, "
              "computing on the rank's own block (3 of its 4 chunk pairs, so more calls than one block pair at "
              "small c), and waiting for the other rank's block: the part of the hop that did not hide. Where that "
              "wait persists above c*, the hop did not move while both ranks computed, as expected where a "
              "transfer is itself CPU work (with gloo, threads copy the bytes through the kernel) and two ranks "
              "computing on two cores leave it a core only now and then. ring_timeline.png draws "
              f"them at c = {', '.join(map(str, TIMELINES))}. Times are this machine's: another CPU, or a GPU with "
              "its far higher F against its link's B, moves c*."]
    titles = {r["c"]: f"c = {r['c']} (S = {2 * r['c']}, cp 2, zig-zag): one block pair's compute is "
                      f"{r['compute_s'] / r['hop_s']:.1f}× a hop alone" for r in sweep if r["c"] in TIMELINES}
    plot_cp.plot_ring_timeline(RESULTS / "ring_timeline.png", {c: d["timelines"][str(c)] for c in TIMELINES},
                               titles, note=machine())
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=PARTS, default=PARTS, help="the parts to run (default: all)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of the time grid (default 1)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = Runs(Path(tmp))
        tables = {"equality": lambda: equality(runs), "bytes": lambda: bytes_table(runs),
                  "memory": lambda: memory(runs), "balance": lambda: balance(runs),
                  "time": lambda: time_table(runs, args.rounds),
                  "overlap": lambda: overlap(Path(tmp))}
        for part in args.only:
            bench_3d.write(RESULTS / f"{part}.md", tables[part]())


if __name__ == "__main__":
    main()
