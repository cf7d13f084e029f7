"""The answer key of Lab 07, section by section, called by lab_answers.py.

It runs the exercises' commands exactly as LAB.md prints them: the planner on 8 ranks of this CPU (its
JSON row for dp 4 × pp 2 against the bytes a 2-step run of that layout measures), the planner on Llama 3
405B's published run (what plain data parallelism would hold, what each lever buys), and the planner
asked about layouts the chapters refuse, and the allocator's model on torchtitan's published run.
"""
import json
import re
from importlib import import_module

from common.lab_key import ROOT

explain_layout = import_module("07_choosing_a_layout.explain_layout")   # the planner's lines, wrapped and joined back

PLAN = ("python 07_choosing_a_layout/choose_layout.py --model tiny --world 8 --device cpu --global-batch 16 "
        "--seq-len 128 --json runs/lab07/layouts.json")
RUN = ("torchrun --nproc_per_node=8 04_3d_combined/train_3d.py --dp 4 --tp 1 --pp 2 --microbatches 4 "
       "--global-batch 16 --seq-len 128 --steps 2 --quiet --sample-tokens 0 --metrics runs/lab07/dp4pp2.jsonl")
AT_SCALE = "python 07_choosing_a_layout/choose_layout.py --explain llama3-405b-8k-16384gpu --top 5 --json runs/lab07/405b.json"
REFUSED = ("python 07_choosing_a_layout/choose_layout.py --model tiny --world 16 --device cpu --explain tp=16",
           "python 07_choosing_a_layout/choose_layout.py --model tiny --world 8 --device cpu --explain "
           "pp=8,schedule=interleaved,v=2")
GROUPS = ("dp", "tp", "pp")
BROKEN = "python 07_choosing_a_layout/choose_layout.py --model tiny --world 8 --device cpu --top 3"
REPLAY = "python 07_choosing_a_layout/replay_allocations.py"


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def bytes_section(key) -> None:
    key.run(PLAN)
    rows = json.loads((ROOT / "runs/lab07/layouts.json").read_text())
    mine = next(r for r in rows if (r["dp"], r["tp"], r["pp"], r["cp"], r["zero_stage"], r["recompute"],
                                    r["schedule"], r["microbatches"]) == (4, 1, 2, 1, 0, "none", "1f1b", 4))
    key.run(RUN)
    measured = [json.loads(line) for line in (ROOT / "runs/lab07/dp4pp2.jsonl").read_text().splitlines()][-1]
    pred = [mine["comm_bytes"][g] for g in GROUPS]
    got = [measured[f"comm_bytes_{g}"] for g in GROUPS]
    key.section("L1 — bytes", f"""
Predicted for dp 4 × pp 2 (1F1B, m = 4), rank 0: dp {pred[0]:,} bytes (its stage's {pred[0] // 3:,} gradient
bytes, all-reduced over 4 replicas: 2 · 2·3/4 of them, sent + received), tp {pred[1]:,}, pp {pred[2]:,}
(2·m = 8 messages of one (1, 128, 128) fp32 activation: 8 · 65,536). Measured by the run: dp {got[0]:,},
tp {got[1]:,}, pp {got[2]:,} — {'equal to the byte' if pred == got else 'DIFFERENT: the formulas and the code disagree'}.
DP moves the most, but once per step, after the last backward of the stage: it overlaps the other stage's
cool-down (the bubble), where the pipeline's messages sit on the critical path of every micro-batch.
""")


def scale_section(key) -> None:
    out = key.run(AT_SCALE).out
    rows = json.loads((ROOT / "runs/lab07/405b.json").read_text())
    shape = ("dp", "tp", "pp", "cp", "zero_stage", "sequence_parallel", "schedule", "virtual_stages", "microbatches")
    explained = next(r for r in rows if (r["dp"], r["tp"], r["pp"], r["cp"], r["zero_stage"], r["sequence_parallel"],
                                         r["schedule"]) == (128, 8, 16, 1, 2, True, "interleaved"))  # ranked: the first
    pub = {r["recompute"]: r for r in rows if r["recompute_layers"] is None
           and all(r[k] == explained[k] for k in shape)}     # the explained row's v and m, each recompute mode
    line = next((x for x in explain_layout.unwrapped(out) if "layouts have the fields asked" in x), "")
    parts = {mode: pub[mode]["memory_bytes"] for mode in ("none", "full") if mode in pub}
    vm = f"v={explained['virtual_stages']} m={explained['microbatches']}"
    words = "; ".join(f"recompute {mode}: weights {gib(m['params'])}, gradients {gib(m['grads'])}, AdamW "
                      f"{gib(m['optim_bytes'])}, activations {gib(m['peak_activation_bytes'])}, total {gib(m['total'])}"
                      for mode, m in parts.items())
    key.section("L2 — what must be split", f"""
Plain data parallelism holds the whole model's state on every GPU: 16 bytes per parameter (fp32 weights,
gradients and AdamW's two moments) × 405.9B ≈ 6 TiB against 80 GiB, whatever the batch. The planner's
line for the published layout: `{line.strip()}`

By component, its fullest pipeline rank at the peak of a step, at the same {vm} — {words}. Recomputation shrinks only the
activations; ZeRO-2 shards AdamW's moments (and, between steps, the gradients), but during a step the
grid's trainers keep the full gradients until the reduce-scatter after the schedule, so the weights and
the gradients stay whole: TP 8 × PP 16 is what divides them (by 128).
""")


def refusals_by_rule(world: int) -> list[tuple[int, str]]:
    """(how many, the message of the first) for each rule the scripts refuse the tiny plan's candidates by
    on `world` CPU ranks (16 × 128 tokens, the lab's plan): runnable.refusal asked of every candidate."""
    planner = import_module("07_choosing_a_layout.planner")
    runnable = import_module("07_choosing_a_layout.runnable")
    cfg = import_module("07_choosing_a_layout.layout_inputs").model_for("tiny")
    rules = {}
    for c in planner.candidates(cfg, world, 16, world):
        if why := runnable.refusal(c, "tiny", cfg, 16, 128, "fp32"):
            count, first = rules.get(re.sub(r"[0-9]+", "N", why), (0, why))
            rules[re.sub(r"[0-9]+", "N", why)] = (count + 1, first)
    return sorted(rules.values(), reverse=True)


def refusals_section(key) -> None:
    outs = [key.run(cmd).out for cmd in REFUSED]
    first = [next((x for x in explain_layout.unwrapped(out) if "refused by their checks" in x), "") for out in outs]
    said = [next((x for x in explain_layout.unwrapped(out) if x.startswith("--explain")), "") for out in outs]
    rules = refusals_by_rule(16)
    key.section("L3 — ask the chapters", f"""
`--explain tp=16`: `{said[0].strip()}` — the heads do not split over 16 ranks (chapter 02's check).
`--explain pp=8,schedule=interleaved,v=2`: `{said[1].strip()}` — the planner never proposes it:
the interleaved schedule's v runs from 2 to (layers + 2) ÷ pp (planner.chunks_per_rank: a layer a chunk, and
the embedding and the head a chunk each), 1 at pp 8 on 8 layers, because 8 ranks × 2 chunks would be 16 stages
for 8 layers, which chapter 03's partition refuses (it takes at most 10).

The plans' first lines: `{first[0].strip()}` (16 ranks) and `{first[1].strip()}` (8 ranks). The refusals
are the scripts' own messages (runnable.refusal asks `checked_layout`, the function each script's `main`
runs before any communication); on 16 ranks {len(rules)} rules give them, asked of every candidate
(lab_layout.refusals_by_rule):

""" + "\n".join(f"- {count} × `{why}`" for count, why in rules) + "\n")


def broken_section(key, skip) -> None:
    """L4: `skip` is lab_answers.py's Edit that keeps every candidate."""
    with key.broken(skip) as root:
        result = key.run(BROKEN, root=root, check=False)
    error = next((x for x in result.out.splitlines() if x.startswith("error")), "(no error line)")
    key.section("L4 — break it: skip the chapters' verdict", f"""
With every candidate kept, the planner prints nothing: it exits with code {result.code} and one line,
`{error}`. The first candidate the scripts would have refused (more pipeline stages than the model has
layers) reaches the prediction, and chapter 03's partition, which the planner's formulas call, raises its
own refusal in the middle of the plan — the same rule, met at the wrong place: for one layout, it stops
all of them. Asking the scripts first turns each refusal into a row left out (and a count on the first
line). Undo the change.
""")


def allocator_section(key, no_merge) -> None:
    """L5: the allocator's model on torchtitan's run, then with `no_merge` (lab_answers.py's Edit)."""
    said, peak = key.run(REPLAY).out.splitlines()[:2]
    with key.broken(no_merge) as root:
        broken = key.run(REPLAY, root=root).out.splitlines()[0]
    tensors, segments, expandable = [float(x) for x in re.findall(r"([0-9.]+) GiB", said)]
    unmerged = float(re.findall(r"([0-9.]+) GiB", broken)[2])
    request, hole = (float(re.search(rf"{words} ([0-9.]+) GiB", peak).group(1))
                     for words in ("a request of", "the largest free block"))
    key.section("L5 — reserved is not allocated", f"""
`{said}`

`{peak}`

The tensors alone peak at {tensors:.1f} GiB; the allocator's model reserves {expandable:.1f} GiB with
expandable segments (torchtitan's launcher sets them), {expandable / tensors - 1:.0%} more, and
{segments:.1f} GiB with the default segments. The difference is memory the allocator keeps cached where
the request of the moment cannot use it. Its peak is the loss's backward (the request of {request:.1f} GiB,
one fp32 [t, V] of 2 × 8,192 × 128,256 positions): the forward left the bf16 logits and their fp32 copy
({hole:.1f} and {request:.1f} GiB) freed side by side below the log-softmax it keeps; the backward's first
fp32 [t, V] fits in that {hole + request:.1f} GiB hole, its second does not and takes new memory on top, and
the hole's other {hole:.1f} GiB stay reserved and empty (the largest free block). FSDP2's own streams hold the rest: a block freed on its all-gather or
reduce-scatter stream is kept for that stream, so the buffers of its gathers and reductions stay reserved
beside the compute stream's tensors, all of them free at that moment.

Without merging: `{broken}` — {unmerged - expandable:.1f} GiB more with expandable segments. A freed block
next to a free one stays two blocks: each hole the step leaves is only as large as the tensor that left
it, and a request larger than each of two neighbouring holes takes new memory although the two together
would hold it. (At the loss itself nothing changes: the first fp32 [t, V] fits the fp32 copy's own hole
exactly, the second fits neither that nor the bf16 logits', as before.) Undo the change.
""")
