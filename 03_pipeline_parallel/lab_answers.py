"""Lab 03's answer key: runs every command of LAB.md and writes LAB_ANSWERS.md from what they print.

    python 03_pipeline_parallel/lab_answers.py          # runs every command of LAB.md
"""
import os
import re
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common`
from common.exercises.museum import key_section  # noqa: E402
from common.lab_key import ROOT, Edit, Key, mib, table  # noqa: E402

CH = "03_pipeline_parallel"


def bubbles(out: str) -> tuple[float, float]:
    """(theory, simulated) bubble from a --print-schedule output."""
    theory = float(re.search(r"theory bubble ([\d.]+)", out).group(1))
    simulated = float(re.search(r"simulated bubble ([\d.]+)", out).group(1))
    return theory, simulated


def in_flight(out: str) -> str:
    return re.search(r"in flight per rank (\[.*\])", out).group(1)


def bubble_reading(b1: float, bz: float, cores: int) -> str:
    """The "why" of §5, for what this run measured on a machine with `cores` cores."""
    shared = cores < 4
    where = (f"Here four ranks share {cores} cores" if shared
             else f"Here each of the four ranks has a core ({cores} in all)")
    if b1 > 0.273 + 0.02:
        first = (f"1F1B measured **above** the theory (+{b1 - 0.273:.3f}). The theory assumes every stage computes "
                 f"at a fixed speed on a processor of its own, and hand-overs that cost nothing. {where}"
                 + (": in the steady state more ranks want to compute than there are cores, actions are stretched "
                    "unevenly, a late rank delays its neighbours, and they wait with nothing to do while the cores "
                    "serve others; those waits count as bubble. The measured bubble is time each rank waits, not "
                    "capacity the machine loses." if shared else
                    ": what the theory leaves out is every hand-over's send and receive, and the last stage's extra "
                    "work (the head and the loss)."))
    elif b1 < 0.273 - 0.02:
        first = (f"1F1B measured **below** the theory ({b1 - 0.273:+.3f}). {where}"
                 + (": a rank that is ready but waiting for a shared core still counts as busy inside its F or B, so "
                    "part of the real waiting hides inside the boxes: on an oversubscribed machine the measurement "
                    "is not the capacity lost." if shared else
                    ", so a measurement below the theory means the stages were not the equal units the theory "
                    "assumes (the first ones faster than the last)."))
    else:
        first = (f"1F1B measured **close to** the theory ({b1 - 0.273:+.3f}). {where}: in this run the ranks' actions "
                 "kept roughly equal lengths. Expect it to move from run to run"
                 + (": ranks sharing cores stretch actions unevenly, and a late rank makes its neighbours wait."
                    if shared else "."))
    if bz >= b1:
        second = ("ZB-H1 measured no lower than 1F1B: on a CPU, W (one matmul per linear layer) is a small share of "
                  "the backward, not the third the F = B = W theory assumes, so there is little W to move into the "
                  "bubble, and rank 0, whose B is empty and whose W is a whole backward, sets the pace (the chapter "
                  "README's F/B/W durations).")
    else:
        second = ("ZB-H1 measured below 1F1B but far above its theory 0.111: on a CPU W is a small share of the "
                  "backward, not the third the F = B = W theory assumes, so there is less W to move into the bubble.")
    elsewhere = ("On another machine the sign can differ: it depends on its cores and on what else runs. With a "
                 "core per rank and nothing else running, expect 1F1B a few hundredths above the theory, as the "
                 "chapter README's p = 2 measurements are.")
    return "\n\n".join(textwrap.fill(t, 100) for t in (first, second, elsewhere))


def main() -> None:
    key = Key(CH, "Lab 03 — pipeline parallelism")

    # 1. -------------------------------------------------------------------------------------------
    out = key.run("""for pm in "4 1" "4 4" "4 16" "2 8"; do set -- $pm; python 03_pipeline_parallel/train_pp.py --pp $1 --microbatches $2 --schedule gpipe --print-schedule | sed -n '1p;$p'; done""").out
    rows = [[*re.search(r"p=(\d+) m=(\d+)", t).groups(), f"{float(a):.3f}", f"{float(b):.3f}"]
            for t, a, b in zip(re.findall(r"gpipe: .*", out), re.findall(r"theory bubble ([\d.]+)", out),
                                re.findall(r"simulated bubble ([\d.]+)", out))]
    f1b = bubbles(key.run("python 03_pipeline_parallel/train_pp.py --pp 4 --microbatches 4 --schedule 1f1b --print-schedule").out)
    key.section("1. Predict the bubble", f"""
{table(["p", "m", "theory (p-1)/(m+p-1)", "simulated"], rows)}

1F1B at p = 4, m = 4: theory {f1b[0]:.3f}, simulated {f1b[1]:.3f}, the same as GPipe's.

**Why the same bubble:** 1F1B reorders the same work, it does not remove any waiting. The first
backward still cannot start before micro-batch 0 has crossed all p stages (p-1 forward slots of
idling on the last ranks), and the last backward still has to travel back through p-1 stages
(p-1 backward slots of idling on the first ranks). What 1F1B changes is *when* each backward runs,
which is what frees memory early.""")

    # 2. -------------------------------------------------------------------------------------------
    gp_print = key.run("python 03_pipeline_parallel/train_gpipe.py --pp 4 --microbatches 8 --print-schedule").out
    fb_print = key.run("python 03_pipeline_parallel/train_1f1b.py --pp 4 --microbatches 8 --print-schedule").out
    key.run("torchrun --nproc_per_node=4 03_pipeline_parallel/train_gpipe.py --microbatches 8 --global-batch 8 --steps 3 --quiet --metrics runs/lab03/gpipe.jsonl")
    key.run("torchrun --nproc_per_node=4 03_pipeline_parallel/train_1f1b.py --microbatches 8 --global-batch 8 --steps 3 --quiet --metrics runs/lab03/1f1b.jsonl")
    gp = key.rows("runs/lab03/gpipe.jsonl")[-1]["peak_activation_bytes"]
    fb = key.rows("runs/lab03/1f1b.jsonl")[-1]["peak_activation_bytes"]
    per_mb = fb[0] / 4
    key.section("2. GPipe vs 1F1B memory", f"""
Micro-batches in flight (last line of the printed schedules): GPipe {in_flight(gp_print)}, 1F1B
{in_flight(fb_print)}: m everywhere for GPipe, p - r on rank r for 1F1B.

{table(["schedule", *[f"stage {s}" for s in range(4)]], [["gpipe", *map(mib, gp)], ["1f1b", *map(mib, fb)]])}

- Stage 0, GPipe ÷ 1F1B = {gp[0] / fb[0]:.2f} (predicted 8 / 4 = 2).
- 1F1B, stage 0 ÷ stage 3 = {fb[0] / fb[3]:.2f} (predicted 4 / 1 = 4 from the counts). One micro-batch of
  one sequence costs about {mib(per_mb)} of saved activations on a stage of two layers
  ({mib(fb[0])} / 4 on stage 0). Stage 3 keeps more than its one micro-batch's layers: it also
  computes the final norm, the head and the loss, and autograd saves the logits (1 × 128 × 256
  floats = 128 KiB) and the softmax of the cross-entropy for the backward, so the ratio is below 4.
  Stage 0's embedding saves only the token ids.
- GPipe's stages are all about {mib(gp[1])}: 8 micro-batches each (the last one again more, for the logits).""")

    # 3. -------------------------------------------------------------------------------------------
    il_print = key.run("python 03_pipeline_parallel/train_pp.py --pp 4 --microbatches 8 --schedule interleaved --virtual-stages 2 --print-schedule").out
    key.run("torchrun --nproc_per_node=4 03_pipeline_parallel/train_pp.py --schedule interleaved --virtual-stages 2 --microbatches 8 --global-batch 8 --steps 3 --quiet --metrics runs/lab03/interleaved.jsonl")
    il_bytes = key.rows("runs/lab03/interleaved.jsonl")[-1]["comm_bytes_pp"]
    fb_bytes = key.rows("runs/lab03/1f1b.jsonl")[-1]["comm_bytes_pp"]
    t, s = bubbles(il_print)
    key.section("3. Interleaving", f"""
Bubble p = 4, m = 8, v = 2: theory {t:.3f} = 3 / (2·8 + 3), simulated {s:.3f} (1F1B: 0.273). The
price shows in the same printout: micro-batch-chunks in flight per rank {in_flight(il_print)},
more than 1F1B's [4, 3, 2, 1] (each is half a stage, so in bytes about half as much each).

`comm_bytes_pp` of rank 0 per step: 1F1B {fb_bytes:,} B, interleaved {il_bytes:,} B,
ratio **{il_bytes / fb_bytes:.2f}**. Per micro-batch, in 1F1B rank 0 sends one activation (to rank 1)
and receives one gradient. Interleaved, rank 0 holds chunks 0 and 4: chunk 0 sends its activation
to rank 1 and receives its gradient back; chunk 4 receives its input from rank 3, sends its output
to rank 1 (chunk 5), and in backward receives a gradient from rank 1 and sends one to rank 3. Six
messages of the same (1, 128, 128) fp32 shape instead of two: 3×. Each message is 64 KiB here.""")

    # 4. -------------------------------------------------------------------------------------------
    zb_print = key.run("python 03_pipeline_parallel/train_pp.py --pp 4 --microbatches 8 --schedule zb-h1 --print-schedule").out
    key.run("python 03_pipeline_parallel/plot_timeline.py --simulate gpipe:4:8 1f1b:4:8 zb-h1:4:8 --out runs/lab03/zb.png")
    t, s = bubbles(zb_print)
    key.section("4. Zero bubble", f"""
Simulated bubbles, p = 4, m = 8: GPipe {bubbles(gp_print)[1]:.3f}, 1F1B {bubbles(fb_print)[1]:.3f}, ZB-H1
{s:.3f} (theory {t:.3f} = (p-1)/(3m+p-1) with F = B = W: the drain carries only B's, and the W's fill
the tail). The panel titles of `runs/lab03/zb.png` show the same three numbers.

**Why rank 0 keeps no W for the end:** rank 0 is the last rank the backward wave reaches; nothing
comes after its last B, so it simply runs its W's in order as they become available, and each W it
postponed would only make its own step longer. Rank r finishes its last B r slots *before* rank 0
does (the wave still has r ranks to cross), so it has r idle slots to fill: it keeps r W's back.

**Why rank p-1 idles longest at the end in 1F1B:** it is the first rank the last backward leaves.
After its last B it has nothing left to do while that backward travels through ranks p-2, ..., 0,
that is (p-1) backward slots of idling, the longest tail; rank 0 has none at the end (its idle time
is at the start, waiting for the first backward to come back).""")

    # 5. -------------------------------------------------------------------------------------------
    key.run("torchrun --nproc_per_node=4 03_pipeline_parallel/train_1f1b.py --microbatches 8 --steps 3 --quiet --timeline runs/lab03/1f1b.json --metrics runs/lab03/1f1b_timeline.jsonl")
    key.run("torchrun --nproc_per_node=4 03_pipeline_parallel/train_pp.py --schedule zb-h1 --microbatches 8 --steps 3 --quiet --timeline runs/lab03/zb.json --metrics runs/lab03/zb_timeline.jsonl")
    key.run("python 03_pipeline_parallel/plot_timeline.py runs/lab03/1f1b.json runs/lab03/zb.json --out runs/lab03/real.png")
    b1 = key.rows("runs/lab03/1f1b_timeline.jsonl")[-1]["bubble_fraction"]
    bz = key.rows("runs/lab03/zb_timeline.jsonl")[-1]["bubble_fraction"]
    key.section("5. Real timelines", f"""
Measured `bubble_fraction`, last step: 1F1B **{b1:.3f}** (theory 0.273), ZB-H1 **{bz:.3f}** (theory 0.111).

{bubble_reading(b1, bz, os.cpu_count())}""")

    # 6. -------------------------------------------------------------------------------------------
    key.run("python 03_pipeline_parallel/train_pp.py --steps 10 --quiet --metrics runs/lab03/ref.jsonl")
    il_cmd = ("torchrun --nproc_per_node=4 03_pipeline_parallel/train_pp.py --schedule interleaved --virtual-stages 2 "
              "--microbatches 4 --steps 10 --quiet --metrics runs/lab03/il.jsonl")
    key.run(il_cmd)
    cmp_loss = key.run("python -m common.compare_metrics runs/lab03/ref.jsonl runs/lab03/il.jsonl", check=False)
    cmp_grad = key.run("python -m common.compare_metrics runs/lab03/ref.jsonl runs/lab03/il.jsonl --key grad_norm --tol 1e-4",
                       check=False)
    edit = Edit(f"{CH}/train_pp.py", "loss_scale=tokens_per_step,", "loss_scale=tokens_per_step // layout.m,")
    with key.broken(edit) as broken_root:
        key.run(il_cmd, root=broken_root)
        (broken_root / "runs/lab03/ref.jsonl").write_bytes((ROOT / "runs/lab03/ref.jsonl").read_bytes())
        bad_cmp = key.run("python -m common.compare_metrics runs/lab03/ref.jsonl runs/lab03/il.jsonl",
                          root=broken_root, check=False)
        bad = key.rows("runs/lab03/il.jsonl", broken_root)
    ref = key.rows("runs/lab03/ref.jsonl")
    loss_ratio, grad_ratio = bad[0]["loss"] / ref[0]["loss"], bad[0]["grad_norm"] / ref[0]["grad_norm"]
    curve = max(abs(b["loss"] / loss_ratio - r["loss"]) / r["loss"] for b, r in zip(bad, ref))
    key.section("6. Same numbers", f"""
`compare_metrics` on `loss`: exit status {cmp_loss.code}; {cmp_loss.line_with("il.jsonl: max")}
`compare_metrics` on `grad_norm`: exit status {cmp_grad.code}; {cmp_grad.line_with("il.jsonl: max")}

The differences are float32 round-off of sums taken in another order; the gradient norm, a sum of
squares over every element, drifts faster than the loss (the root README's equivalence section
measures how both grow with the steps). On another CPU the digits of these differences change (its
kernels round differently); both exit statuses stay 0.

**Broken on purpose** (`loss_scale=tokens_per_step // layout.m`, m = 4): step-1 loss ÷ reference =
**{loss_ratio:.3f}**, step-1 grad_norm ÷ reference = **{grad_ratio:.3f}**. Each micro-batch's loss is
now the mean over its own 1/m of the tokens, and the pipeline adds the m means: the reported loss
and every gradient are m = 4 times too large. The curve, divided by {loss_ratio:.0f}, stays within
{curve:.1e} of the reference over 10 steps: clipping at norm 1.0 rescales both runs' gradients to the
same norm whenever both are above it, and AdamW divides each update by the running RMS of the
gradients, so a constant factor cancels except against `eps` (1e-8) and in the steps where only
one of the two runs is clipped. The damage is real but quiet: the printed loss is wrong, and
with SGD, or with micro-batches of unequal size, the training itself would differ. The comparison
exits {bad_cmp.code}: {bad_cmp.line_with("il.jsonl: max")}""")

    # 7. -------------------------------------------------------------------------------------------
    bad_runs = ["torchrun --nproc_per_node=4 03_pipeline_parallel/train_pp.py --schedule interleaved --virtual-stages 2 --microbatches 6 --global-batch 12",
                "torchrun --nproc_per_node=4 03_pipeline_parallel/train_pp.py --schedule interleaved --virtual-stages 4 --microbatches 4",
                "torchrun --nproc_per_node=4 03_pipeline_parallel/train_1f1b.py --virtual-stages 2",
                "torchrun --nproc_per_node=4 03_pipeline_parallel/train_1f1b.py --microbatches 3"]
    key.section("7. Bad input", f"""
{key.failures(bad_runs, "03_pipeline_parallel/")}

Each check runs on every rank before any communication, on the same inputs, so every rank reaches
the same verdict; rank 0 prints the line and exits 2. torchrun then prints its own failure report,
a traceback of the launcher ending in `ChildFailedError` and the table of the ranks' exit codes:
the launcher's, not a traceback from the project's code. Why the rules: interleaving sends
micro-batches round in groups of p, so m must be a multiple of p; each stage needs at least one
layer; one stage per rank is all GPipe/1F1B/ZB-H1 know how to schedule; and m micro-batches must
each get a whole number of the rank's sequences.""")
    v_section(key)
    key.section(*key_section("03"))      # the museum's bugs of this chapter: how each is found
    key.write()


def v_section(key) -> None:
    """§8: the V's bubble and memory on paper, PyTorch's lists, and the placement that is not a V."""
    zbv = key.run("python 03_pipeline_parallel/train_pp.py --pp 4 --microbatches 8 --schedule zb-v --print-schedule").out
    dpv = key.run("python 03_pipeline_parallel/train_pp.py --pp 4 --microbatches 8 --schedule dualpipev --print-schedule").out
    order = key.run("python 03_pipeline_parallel/torch_order.py --pp 4 --microbatches 8").out
    (t, s), (td, sd) = bubbles(zbv), bubbles(dpv)
    edit = Edit(f"{CH}/v_schedules.py", "return r, 2 * p - 1 - r", "return r, r + p")
    with key.broken(edit) as broken_root:
        loop = key.run("python 03_pipeline_parallel/train_pp.py --pp 4 --microbatches 8 --schedule zb-v --print-schedule",
                       root=broken_root, check=False)
    key.section("8. The V: ZB-V and DualPipeV", f"""
ZB-V, p = 4, m = 8: theory **{t:.3f}** = 3 / (6·8 + 3), simulated {s:.3f}: below ZB-H1 (0.111) and 1F1B
(0.273). DualPipeV: theory {td:.3f}, simulated {sd:.3f}, the same with F = B = W. Peak in flight per rank
(half-stages): ZB-V {in_flight(zbv)}, DualPipeV {in_flight(dpv)}.

**Why:** a rank does 2 stages × m × (F + B + W) = 6m units; the turn of the V is local, so rank 3
starts the first backward right after its own forward, and the W's fill every gap of the drain: what
is left is the ramp-up, p-1 = 3 units per rank. **Memory:** 2p = 8 half-stage micro-batches on
every rank, the weight of p = 4 whole-stage ones: rank 0 holds as much as rank 3, where 1F1B's rank 0
holds four times rank 3's. DualPipeV holds one more (its pairs start a forward before the backward
that would free one).

PyTorch's lists, `torch_order.py`: {order.splitlines()[0]}; {next(l for l in order.splitlines() if l.startswith("dualpipev"))}.

**Broken on purpose** (`v_stages` returns `r, r + p`, a loop): exit status {loop.code},
`{loop.line_with("ValueError: deadlock")}`

Rank r's second stage is now r + p, whose next stage lives on rank r+1, not r-1: the second half
of the model runs down the ranks again, and the turn is no longer local (stage 3 on rank 3 feeds
stage 4 on rank 0). The list was written for the V: rank 0 runs the backward of micro-batch 0 on its
second stage before its next forward there. That backward waits for rank 1's, which waits for rank
1's forward of micro-batch 1, which waits for the forward rank 0 has put after the backward: a
cycle, and every rank waits. A V schedule is an order written for the V placement, not a schedule
on any other.""")


if __name__ == "__main__":
    main()
