"""Choosing a layout: every way to spread one model over a cluster, predicted, ranked and explained.

    python 07_choosing_a_layout/choose_layout.py --model tiny --world 8 --device cpu --global-batch 16 --seq-len 128
    python 07_choosing_a_layout/choose_layout.py --model llama3-405b --world 16384 --gpus-per-node 8 \\
        --device h100 --dtype bf16 --global-batch 2048 --seq-len 8192 --json runs/405b.json

The plan is planner.py's: it enumerates the layouts the course runs: the degrees dp × tp × pp × cp = world
(ep among the dp ranks, for a mixture of experts), the ZeRO stage, the recomputation mode, sequence
parallelism, the schedule, its virtual stages and micro-batches, each kept only if the training script
that would run it accepts it (runnable.py asks the script's own checks); predicts for each what every rank
holds, what it sends, the bubble and a step time (layout_costs.py: the chapters' own formulas); keeps what
fits and ranks by step time (ties by memory). This command prints it, the command that runs the first,
and explains the first choices in words,
or any one layout with --explain. What the planner is worth is checked against measured runs and
published ones by check_layouts.py (the chapter's README shows both tables).

`--json PATH` writes every layout as a row: dp, tp, pp, cp, ep, zero_stage, recompute, recompute_layers
(--recompute-layers: full recomputation of the first blocks of each stage only, null for all), sequence_parallel,
tp_overlap (--tp-overlap: the plan's own rows never, --explain tpo asks for it), schedule, virtual_stages,
microbatches, memory_bytes {params, grads, optim_bytes,
peak_activation_bytes, working (working_set.py), total, held_between_steps} (the fullest pipeline rank's, fullest_pp_rank),
busiest_pp_rank (the pipeline rank whose work and collectives a GPU's step time is; 0 on a CPU),
comm_bytes {dp, tp, pp, ep, cp} (per optimizer step, global rank 0's, sent + received: the metrics'
comm_bytes_*), bubble, step_time_s, mfu (the model's FLOPs over every rank's peak), time_parts_s (a GPU's
compute, memory, bubble, comm_<group>, optimizer: step_time.py), fits, command (null for a published shape: its miniature is
printed instead).

Exit codes: 0, a plan; 1, no layout fits (one `error:` line says the smallest one's memory; the table and
the --json rows, every one fits = false, are still written); 2, a bad flag (one line that names it).
"""
import json
import sys
from functools import partial
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters

from common.cli import Parser  # noqa: E402
from common.domains import OUTPUT_FILE, POSITIVE_INT, Domain, Refused, real, whole  # noqa: E402
from common.errors import fail, require, run_main  # noqa: E402

layout_inputs = import_module("07_choosing_a_layout.layout_inputs")    # this chapter: models and devices
layout_costs = import_module("07_choosing_a_layout.layout_costs")      # this chapter: one layout's numbers
runnable = import_module("07_choosing_a_layout.runnable")              # this chapter: the scripts' own checks
planner = import_module("07_choosing_a_layout.planner")                # this chapter: the plan, ranked
explain_layout = import_module("07_choosing_a_layout.explain_layout")  # this chapter: the planner's words
published = import_module("07_choosing_a_layout.published")            # this chapter: published runs
pipeline_time = import_module("07_choosing_a_layout.pipeline_time")    # this chapter: a schedule run on paper
framework_flags = import_module("07_choosing_a_layout.framework_flags")  # this chapter: Megatron-LM's, torchtitan's
scatter_gather = import_module("04_3d_combined.scatter_gather")        # chapter 04: --pp-sends


SCHEMA = ("dp", "tp", "pp", "cp", "ep", "zero_stage", "recompute", "recompute_layers", "sequence_parallel",
          "tp_overlap", "cp_attention", "schedule", "virtual_stages",
          "microbatches", "memory_bytes", "fullest_pp_rank", "busiest_pp_rank", "comm_bytes", "bubble", "step_time_s", "mfu",
          "time_parts_s", "fits", "command")


def describe(r: dict) -> str:
    zero = f", ZeRO-{r['zero_stage']}" if r["zero_stage"] else ""
    v = f" v={r['virtual_stages']}" if r.get("virtual_stages", 1) > 1 else ""
    sched = f", {r['schedule']}{v} m={r['microbatches']}" if r["pp"] > 1 else f", m={r['microbatches']}"
    sp = (" +SP" if r["sequence_parallel"] else "") + (" (overlapped)" if r.get("tp_overlap") else "")
    cp = " (all-gather)" if r.get("cp_attention", "ring") != "ring" and r["cp"] > 1 else ""
    return (f"dp {r['dp']} × tp {r['tp']}{sp} × pp {r['pp']} × cp {r['cp']}{cp}"
            + (f" (ep {r['ep']})" if r["ep"] > 1 else "") + f"{zero}, recompute {r['recompute']}"
            + (f" ({r['recompute_layers']}/stage)" if r.get("recompute_layers") else "") + sched)


gib = explain_layout.gib


def _model(domain: Domain, text: str) -> str:
    if text not in layout_inputs.MODELS and not text.endswith(".json"):
        raise Refused("unknown model", f"choose one of {', '.join(layout_inputs.MODELS)}, or a PATH.json")
    return text


def _device(domain: Domain, text: str) -> str:
    if text not in layout_inputs.DEVICES and not text.endswith(".json"):
        raise Refused("unknown device", f"choose one of {', '.join(layout_inputs.DEVICES)}, or a PATH.json")
    return text


MODEL = Domain("model", "", _model)
DEVICE = Domain("device", "", _device)


def parser() -> Parser:
    """The course's parser: every flag has a domain (or choices), and a value outside it is refused with one
    line that names the flag (a ConfigError, exit code 2), as in every training script."""
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=MODEL, default="tiny",
                   help=f"a course preset or a published shape: {', '.join(layout_inputs.MODELS)}; or a model "
                        f"file PATH.json (model_files.py: ModelConfig's fields, \"mlp\": swiglu or gelu, and a GPT's "
                        f"\"bias\", \"dropout\", \"tied_embeddings\": true or false)")
    # at most 2^20 ranks (today's largest runs use tens of thousands): the planner tries every divisor of the
    # world, and a number like 10^9 would keep it busy for minutes before its first row
    p.add_argument("--world", type=whole(1, 1 << 20), default=8, help="ranks (GPUs) in all")
    p.add_argument("--gpus-per-node", type=POSITIVE_INT, default=8, help="ranks that share a node's fast links")
    p.add_argument("--device", type=DEVICE, default="cpu",
                   help=f"cpu: this machine, measured; a GPU's device file: {', '.join(layout_inputs.DEVICES[1:])} "
                        f"(07_choosing_a_layout/devices/), or a PATH.json of the same form (device_files.py)")
    p.add_argument("--attention", default="flash", choices=["flash", "unfused"],
                   help="a GPU's attention kernel: flash (fused, the causal half skipped) or unfused (the scores "
                        "and softmax in memory, as Megatron-LM ran before flash attention)")
    p.add_argument("--cp-attention", default="ring", choices=["ring", "allgather"],
                   help="chapter 06's attention of every layout with cp > 1: ring (K/V hops under the attention's "
                        "compute) or allgather (K/V gathered whole before it, exposed: Llama 3's)")
    p.add_argument("--full-recompute", default="early-stop", choices=["early-stop", "whole-block"],
                   help="what --recompute full reruns on a GPU: early-stop (the course's checkpoint: the forward "
                        "again until backward has what it needs, not the MLP's down projection) or whole-block "
                        "(Megatron-LM's --recompute-granularity full: the block's whole forward)")
    p.add_argument("--pp-sends", default="whole", choices=list(scatter_gather.CHOICES),
                   help="what a pipeline stage sends when SP does not split its activation: whole (the scripts' "
                        "default) or scatter-gather (chapter 04's --pp-sends and Megatron-LM's default: each TP rank "
                        "sends its 1/tp, the next stage all-gathers it over TP)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="compute dtype")
    p.add_argument("--global-batch", type=POSITIVE_INT, default=16, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=POSITIVE_INT, default=128,
                   help="tokens per sequence (at most the model's max_seq_len)")
    p.add_argument("--efficiency", type=real(0, strict=True, high=1), default=None,
                   help="share of peak FLOP/s every matmul reaches (default: a GPU's device file by size, this "
                        "CPU's calibration)")
    p.add_argument("--top", type=POSITIVE_INT, default=10, help="layouts in the printed table")
    p.add_argument("--why", type=POSITIVE_INT, default=3, help="first layouts explained in words")
    p.add_argument("--explain", type=explain_layout.LAYOUT, default=None, metavar="LAYOUT",
                   help="explain one layout, fitting or not: key=value fields (dp, tp, pp, cp, ep, zero, recompute, layers, "
                        "schedule, v, m, sp, and tpo: sp with --tp-overlap), or a published run's name, "
                        "which also plans its cluster: "
                        + ", ".join(published.BY_NAME))
    p.add_argument("--bubble", default="textbook", choices=["textbook", "on-paper"],
                   help="the pipeline bubble: textbook (chapter 03's, equal stages: the ranking's), or on-paper "
                        "(a GPU): the table as ranked, then the first --top layouts that fit with every schedule run "
                        "on paper (pipeline_time.py: each stage's own forward, input and weight gradients), found "
                        "exactly; slower (seconds to tens of seconds at scale)")
    p.add_argument("--json", type=OUTPUT_FILE, default=None,
                   help="write every layout's row here, a JSON list (default: none)")
    return p


def parse_args(argv=None):
    """The flags; `--explain NAME` of a published run plans that run's cluster and batch (its flags first,
    so that a flag given after them still wins)."""
    args = parser().parse_args(argv)
    if args.explain and "name" in args.explain:
        args = parser().parse_args(list(published.BY_NAME[args.explain["name"]].argv) + list(argv or sys.argv[1:]))
    return args


def run_it(r: dict, cfg, args) -> str:
    """The command that runs the first layout: itself where the model is a course preset, else the same layout
    in miniature on this machine (every degree above 1 made 2, the preset of the same kind)."""
    if r["command"]:
        return f"Run it:\n  {r['command']}"
    mini = runnable.miniature(layout_costs.Candidate.of_row(r), cfg, args.pp_sends)
    return ("Run it in miniature on this machine:\n  " + mini[1]) if mini else \
        "No miniature of it runs here (its script refuses the reduced degrees)."


def on_paper_lines(rows: list[dict], dev, args) -> list[str]:
    """--bubble on-paper: the first --top layouts that fit with each schedule run on paper, fastest first, each
    with its step, its bubble there and the textbook's, and its place in the table above."""
    fitting = [r for r in rows if r["fits"]]
    bubble_of = pipeline_time.bubbles(planner.run_of(args), dev)
    lines = explain_layout.wrap(f"On paper (each schedule run with its stages' own times: pipeline_time.py), the "
                                f"first {min(args.top, len(fitting))} that fit:")
    for r, step in pipeline_time.leaders_on_paper(fitting, bubble_of, args.top):
        lines += explain_layout.wrap(f"{step:.4g} s (MFU {r['mfu'] * r['step_time_s'] / step:.1%}), bubble "
                                     f"{bubble_of(r):.1%} (textbook {r['bubble']:.1%}; the table's "
                                     f"{fitting.index(r) + 1:,}): {describe(r)}", "  ")
    return lines


class NothingFits(Exception):
    """No layout holds this model and batch on these ranks: the plan's answer is no (exit code 1; a bad
    flag is a ConfigError, exit code 2). Raised after the table and the JSON rows are out."""


def main(argv=None) -> list[dict]:
    """Plan, print, write --json; every layout's row, or NothingFits when none fits."""
    args = parse_args(argv)
    require(not (args.bubble == "on-paper" and args.device == "cpu"),
            "--bubble on-paper runs a GPU's pipeline schedules on paper; on --device cpu the ranks share cores and "
            "the model charges no bubble: use a GPU's device file (--device h100, say)")
    rows, dev, refused = planner.plan(args)
    cfg = layout_inputs.model_for(args.model)
    fit = sum(r["fits"] for r in rows)
    print("\n".join(explain_layout.wrap(
        f"{len(rows)} layouts of {args.world} {dev.name} ranks that the chapters run ({refused} more refused "
        f"by their checks), {fit} fit; " + ("fastest first, equal times by memory:" if fit else
                                             "none fits, the smallest first:"))))
    print("\n".join(explain_layout.table(rows[:args.top], dev, args.world)))
    if args.bubble == "on-paper":
        print("\n".join(["", *on_paper_lines(rows, dev, args)]))
    print("\n".join(["", *explain_layout.decision_tree(rows, cfg, dev, args, describe, args.why)]))
    if fit:
        print("\n".join(["", *explain_layout.run_lines(run_it(rows[0], cfg, args))]))
    if args.explain:
        print("\n".join(["", *explain_layout.explain_one(args.explain, rows, dev, describe,
                                                          partial(planner.refusal_of, args, dev),
                                                          lambda r: run_it(r, cfg, args),
                                                          partial(pipeline_time.words, planner.run_of(args), dev=dev))]))
        flags = framework_flags.explained(args.explain, rows, cfg, args.global_batch, args.seq_len,
                                          args.pp_sends)
        print("\n".join(x for line in flags for x in explain_layout.wrap(line.strip(), "  ")))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([{k: r[k] for k in SCHEMA} for r in rows], indent=1))
        print(f"\n{len(rows)} rows written to {args.json}")
    if not any(r["fits"] for r in rows):
        best, ranks = rows[0], f"{args.world} {dev.name} rank{'s' if args.world > 1 else ''}"   # sorted by memory
        raise NothingFits(f"no layout of {ranks} fits: the smallest, {describe(best)}, "
                          f"still holds {gib(best['memory_bytes']['total'])} per rank against "
                          f"{explain_layout.capacity(dev)}; "
                          f"use more ranks (--world), a smaller --global-batch or a shorter --seq-len")
    return rows


def command() -> None:
    """The script: a bad flag exits 2 (run_main), a plan where nothing fits exits 1 with its one line."""
    try:
        main()
    except NothingFits as err:
        sys.stdout.flush()                  # the table first, then the verdict, also in a log of both
        fail("error", str(err), 1)


if __name__ == "__main__":
    run_main(command)
