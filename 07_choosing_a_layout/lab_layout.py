"""The answer key of Lab 06's exercise "Choose a layout": one section, called by lab_answers.py.

It runs the exercise's commands exactly as LAB.md prints them: the planner on 8 ranks of this CPU (its
JSON row for dp 4 × pp 2 against the bytes a 2-step run of that layout measures), and the planner on
Llama 3 405B (why plain data parallelism cannot hold it, and which lever makes the published layout fit).
"""
import json

from common.lab_key import ROOT

PLAN = ("python 06_context_parallel/choose_layout.py --model tiny --world 8 --device cpu --global-batch 16 "
        "--seq-len 128 --json runs/lab06/layouts.json")
RUN = ("torchrun --nproc_per_node=8 04_3d_combined/train_3d.py --dp 4 --tp 1 --pp 2 --microbatches 4 "
       "--global-batch 16 --seq-len 128 --steps 2 --quiet --sample-tokens 0 --metrics runs/lab06/dp4pp2.jsonl")
AT_SCALE = ("python 06_context_parallel/choose_layout.py --model llama3-405b --world 16384 --device h100 --dtype bf16 "
            "--global-batch 2048 --seq-len 8192 --top 5 --json runs/lab06/405b.json")
GROUPS = ("dp", "tp", "pp")


def layout_section(key, title: str = "Choose a layout") -> None:
    key.run(PLAN)
    rows = json.loads((ROOT / "runs/lab06/layouts.json").read_text())
    mine = next(r for r in rows if (r["dp"], r["tp"], r["pp"], r["cp"], r["zero_stage"], r["recompute"],
                                    r["schedule"], r["microbatches"]) == (4, 1, 2, 1, 0, "none", "1f1b", 4))
    key.run(RUN)
    measured = [json.loads(line) for line in (ROOT / "runs/lab06/dp4pp2.jsonl").read_text().splitlines()][-1]
    pred = [mine["comm_bytes"][g] for g in GROUPS]
    got = [measured[f"comm_bytes_{g}"] for g in GROUPS]
    key.run(AT_SCALE)
    big = json.loads((ROOT / "runs/lab06/405b.json").read_text())
    published = {r["recompute"]: r for r in big if (r["dp"], r["tp"], r["pp"], r["cp"], r["zero_stage"],
                                                     r["sequence_parallel"], r["schedule"]) ==
                 (128, 8, 16, 1, 2, True, "interleaved")}
    gib = {mode: published[mode]["memory_bytes"] for mode in published}
    key.section(title, f"""
**(a)** Predicted for dp 4 × pp 2 (1F1B, m = 4), rank 0: dp {pred[0]:,} bytes (its stage's {pred[0] // 3:,}
gradient bytes, all-reduced over 4 replicas: 2 · 2·3/4 of them, sent + received), tp {pred[1]:,}, pp {pred[2]:,}
(2·m = 8 messages of one (1, 128, 128) fp32 activation: 8 · 65,536). Measured by the run: dp {got[0]:,}, tp {got[1]:,},
pp {got[2]:,} — {'equal to the byte' if pred == got else 'DIFFERENT: the formulas and the code disagree'}.

**(b)** Plain data parallelism holds the whole model's state on every GPU: 16 bytes per parameter (fp32 weights,
gradients and AdamW's two moments) × 405.9B ≈ 6 TiB against 80 GiB. The published dp 128 × tp 8 × pp 16 with
ZeRO-2 and sequence parallelism holds {gib['none']['total'] / 2**30:,.1f} GiB without recomputation, of which
activations {gib['none']['peak_activation_bytes'] / 2**30:,.1f} GiB (the first stage keeps its interleaved warm-up's
micro-batches of 8,192 tokens in flight), and {gib['full']['total'] / 2**30:,.1f} GiB with full recomputation
(activations {gib['full']['peak_activation_bytes'] / 2**30:,.1f} GiB): recomputation is the lever that makes it fit,
at the price of a third more compute (its predicted step {published['full']['step_time_s']:.2f} s against
{published['none']['step_time_s']:.2f} s).
""")
