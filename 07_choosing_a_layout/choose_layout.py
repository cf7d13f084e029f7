"""Choosing a layout: every way to spread one model over a cluster, predicted, ranked and explained.

    python 06_context_parallel/choose_layout.py --model tiny --world 8 --device cpu --global-batch 16 --seq-len 128
    python 06_context_parallel/choose_layout.py --model llama3-405b --world 16384 --gpus-per-node 8 \\
        --device h100 --dtype bf16 --global-batch 2048 --seq-len 8192 --json runs/405b.json

It enumerates every valid layout: the degrees dp × tp × pp × cp = world (ep among the dp ranks, for a
mixture of experts), the ZeRO stage, the recomputation mode, sequence parallelism, the schedule and its
micro-batches; predicts for each what a rank holds, what it sends, the bubble and a step time
(layout_costs.py: the chapters' own formulas); keeps what fits, ranks by step time, and explains the
first choices in words. This chapter holds it because it is the last: it may import every earlier
one, and the layout of a long-context mixture needs all five dimensions (chapter 04's README points
here). What the planner is worth is checked against measured runs and published ones by
check_layouts.py (the chapter's README shows both tables).

`--json PATH` writes every layout as a row: dp, tp, pp, cp, ep, zero_stage, recompute,
sequence_parallel, schedule, microbatches, memory_bytes {params, grads, optim_bytes,
peak_activation_bytes, total}, comm_bytes {dp, tp, pp, ep, cp} (per optimizer step, global rank 0's,
sent + received: the metrics' comm_bytes_*), bubble, step_time_s, fits.

Exit codes: 0, a plan; 1, no layout fits (one `error:` line says the smallest one's memory; the table and
the --json rows, every one fits = false, are still written); 2, a bad flag (one line that names it).
"""
import json
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common` and the chapters

from common.cli import OUTPUT_FILE, POSITIVE_INT, Domain, Parser, Refused, real, whole  # noqa: E402
from common.errors import ConfigError, fail, require, run_main  # noqa: E402
from common.metrics import format_bytes  # noqa: E402
from common.model import count_parameters  # noqa: E402
from common.recompute import MODES  # noqa: E402

layout_inputs = import_module("06_context_parallel.layout_inputs")    # this chapter: models and devices
layout_costs = import_module("06_context_parallel.layout_costs")      # this chapter: one layout's numbers
tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")  # chapter 02: which TP degrees split
# (name, virtual stages). GPipe is left out: it has 1F1B's bubble and time and keeps all m micro-batches in
# flight instead of at most p, so it never ranks above 1F1B.
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
SCHEMA = ("dp", "tp", "pp", "cp", "ep", "zero_stage", "recompute", "sequence_parallel", "schedule", "microbatches",
          "memory_bytes", "comm_bytes", "bubble", "step_time_s", "fits")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_splits(cfg, tp: int) -> bool:
    try:
        tensor_parallel.check_tp_config(cfg, tp)
        return True
    except ConfigError:
        return False


def microbatch_counts(rows: int, pp: int, schedule: str) -> list[int]:
    """The course's default (the largest count ≤ 2·pp that splits the rows, common/cli's rule; a
    multiple of pp for the interleaved schedule) and one row per micro-batch: without a pipeline the
    least activation memory (gradient accumulation), with one the smallest bubble (1F1B keeps at most
    about p micro-batches in flight whatever m is)."""
    step = pp if schedule == "interleaved" else 1
    fits = [m for m in range(step, rows + 1, step) if rows % m == 0]
    default = [m for m in fits if m <= 2 * pp]
    if not default:
        return []
    return sorted({max(default)} | ({rows} if rows in fits else set()))


def candidates(cfg, world: int, global_batch: int, seq_len: int, gpus_per_node: int):
    """Every layout of `world` ranks that the chapters can build for this model and batch."""
    for tp in (t for t in divisors(world) if t <= gpus_per_node and tp_splits(cfg, t)):
        for cp in (c for c in divisors(world // tp) if c == 1 or seq_len % (2 * c) == 0):
            for pp in (p for p in divisors(world // (tp * cp)) if p <= cfg.n_layers):
                dp = world // (tp * cp * pp)
                if global_batch % dp:
                    continue
                for ep in [e for e in divisors(dp) if cfg.n_experts % e == 0] if cfg.n_experts else [1]:
                    for schedule, v in SCHEDULES if pp > 1 else (("1f1b", 1),):
                        if pp * v > cfg.n_layers:
                            continue
                        for m in microbatch_counts(global_batch // dp, pp, schedule):
                            for zero in (0, 1, 2, 3) if pp == 1 else (0, 1, 2):   # ZeRO-3 re-gathers per micro-batch
                                for mode in MODES:
                                    for sp in (False, True) if tp > 1 and seq_len // cp % tp == 0 else (False,):
                                        yield layout_costs.Candidate(dp, tp, pp, cp, ep, zero, mode, sp, schedule,
                                                                     m, v)


def plan(args) -> tuple[list[dict], object]:
    """(every layout's row, fastest first among those that fit, then the rest by memory; the device)."""
    cfg = layout_inputs.model_for(args.model)
    require(args.seq_len <= cfg.max_seq_len,
            f"--seq-len {args.seq_len} is longer than --model {args.model}'s {cfg.max_seq_len} positions")
    dev = layout_inputs.device_for(args.device, args.dtype, args.world, args.efficiency)
    gpn = args.world if dev.cores is not None else args.gpus_per_node
    run = layout_costs.Run(cfg, args.global_batch, args.seq_len, args.dtype)
    rows = [layout_costs.predict(run, c, dev, gpn) for c in candidates(cfg, args.world, args.global_batch,
                                                                       args.seq_len, gpn)]
    require(rows, f"no layout of --world {args.world} splits this model and batch (--global-batch "
                  f"{args.global_batch} over the data-parallel ranks, heads over TP): use a world size that is "
                  f"a product of the model's divisors, e.g. a power of two")
    rows.sort(key=lambda r: (not r["fits"], r["step_time_s"] if r["fits"] else r["memory_bytes"]["total"]))
    return rows, dev


def describe(r: dict) -> str:
    zero = f", ZeRO-{r['zero_stage']}" if r["zero_stage"] else ""
    sched = f", {r['schedule']} m={r['microbatches']}" if r["pp"] > 1 else f", m={r['microbatches']}"
    return (f"dp {r['dp']} × tp {r['tp']}{' +SP' if r['sequence_parallel'] else ''} × pp {r['pp']} × cp {r['cp']}"
            + (f" (ep {r['ep']})" if r["ep"] > 1 else "") + f"{zero}, recompute {r['recompute']}{sched}")


def gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else format_bytes(n)


def explain(rows: list[dict], cfg, dev, args) -> list[str]:
    """The decision tree, with this case's numbers: does the model fit one device, which lever buys
    memory, what the winner pays its time for."""
    n = count_parameters(cfg)
    state = 16 * n                                          # fp32 weights + gradients + AdamW's two moments
    fitting = [r for r in rows if r["fits"]]
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    out = [f"{args.model}: {size} parameters; weights, gradients and AdamW's moments take "
           f"16 bytes each = {gib(state)}, against {gib(dev.memory)} per {dev.name} rank."]
    plain = [r for r in rows if r["dp"] == args.world and r["zero_stage"] == 0 and r["recompute"] == "none"]
    if plain:
        p = min(plain, key=lambda r: r["memory_bytes"]["total"])
        out.append(f"Plain data parallelism would hold {gib(p['memory_bytes']['total'])} per rank: "
                   + ("it fits, so anything else must buy speed." if p["fits"] else
                      "it does not fit, so the state must be split (ZeRO, TP, PP) or the activations cut."))
    if not fitting:
        return out                          # the verdict is main's NothingFits, with the smallest layout
    for i, r in enumerate(fitting[:args.explain]):
        mem, parts = r["memory_bytes"], r["time_parts_s"]
        slowest = max((k for k in parts if k != "compute"), key=parts.get)
        out.append(f"{i + 1}. {describe(r)}: {r['step_time_s']:.3g} s per step, {gib(mem['total'])} per rank "
                   f"(weights {gib(mem['params'])}, gradients {gib(mem['grads'])}, AdamW {gib(mem['optim_bytes'])}, "
                   f"activations {gib(mem['peak_activation_bytes'])}). Compute {parts['compute']:.3g} s; the largest "
                   f"other cost is {slowest.replace('_', ' ')}, {parts[slowest]:.3g} s"
                   + (f"; the bubble is {r['bubble']:.1%} of a pipeline step" if r["pp"] > 1 else "") + ".")
    return out


def _model(domain: Domain, text: str) -> str:
    if text not in layout_inputs.MODELS:
        raise Refused("unknown model", f"choose one of {', '.join(layout_inputs.MODELS)}")
    return text


MODEL = Domain("model", "", _model)


def parser() -> Parser:
    """The course's parser: every flag has a domain (or choices), and a value outside it is refused with one
    line that names the flag (a ConfigError, exit code 2), as in every training script."""
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=MODEL, default="tiny",
                   help=f"a course preset or a published shape: {', '.join(layout_inputs.MODELS)}")
    # at most 2^20 ranks (today's largest runs use tens of thousands): the planner tries every divisor of the
    # world, and a number like 10^9 would keep it busy for minutes before its first row
    p.add_argument("--world", type=whole(1, 1 << 20), default=8, help="ranks (GPUs) in all")
    p.add_argument("--gpus-per-node", type=POSITIVE_INT, default=8, help="ranks that share a node's fast links")
    p.add_argument("--device", default="cpu", choices=list(layout_inputs.DEVICES),
                   help="cpu: this machine, measured; h100, a100: datasheet numbers")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="compute dtype")
    p.add_argument("--global-batch", type=POSITIVE_INT, default=16, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=POSITIVE_INT, default=128,
                   help="tokens per sequence (at most the model's max_seq_len)")
    p.add_argument("--efficiency", type=real(0, strict=True, high=1), default=None,
                   help="share of peak FLOP/s the math reaches (default: 0.5 on a GPU, 0.4 on this CPU)")
    p.add_argument("--top", type=POSITIVE_INT, default=10, help="layouts in the printed table")
    p.add_argument("--explain", type=POSITIVE_INT, default=3, help="layouts explained in words")
    p.add_argument("--json", type=OUTPUT_FILE, default=None,
                   help="write every layout's row here, a JSON list (default: none)")
    return p


def parse_args(argv=None):
    return parser().parse_args(argv)


class NothingFits(Exception):
    """No layout holds this model and batch on these ranks: the plan's answer is no (exit code 1; a bad
    flag is a ConfigError, exit code 2). Raised after the table and the JSON rows are out."""


def main(argv=None) -> list[dict]:
    """Plan, print, write --json; every layout's row, or NothingFits when none fits."""
    args = parse_args(argv)
    rows, dev = plan(args)
    cfg = layout_inputs.model_for(args.model)
    print(f"{len(rows)} layouts of {args.world} {dev.name} ranks, {sum(r['fits'] for r in rows)} fit; fastest first:")
    print(f"  {'layout':<70} {'GiB/rank':>9} {'step (s)':>9} {'bubble':>7}")
    for r in rows[:args.top]:
        print(f"  {describe(r):<70} {r['memory_bytes']['total'] / 2**30:9.2f} {r['step_time_s']:9.3g} "
              f"{r['bubble']:7.1%}{'' if r['fits'] else '  (does not fit)'}")
    print("\n".join(["", *explain(rows, cfg, dev, args)]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([{k: r[k] for k in SCHEMA} for r in rows], indent=1))
        print(f"\n{len(rows)} rows written to {args.json}")
    if not any(r["fits"] for r in rows):
        best, ranks = rows[0], f"{args.world} {dev.name} rank{'s' if args.world > 1 else ''}"   # sorted by memory
        raise NothingFits(f"no layout of {ranks} fits: the smallest, {describe(best)}, "
                          f"still holds {gib(best['memory_bytes']['total'])} per rank against {gib(dev.memory)}; "
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
