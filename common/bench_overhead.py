"""The trainer's own overhead: each chapter's script at world size 1 against a plain loop on the same model.

    python -m common.bench_overhead                 # tiny, 10 steps, 4 rounds: about 6 minutes on 2 CPU cores
    python -m common.bench_overhead --model small --steps 6 --rounds 3 --device cuda --dtype bf16

At world size 1 every collective of the course is skipped, so what a script costs beyond the plain
loop is its machinery: the step protocol's verbs, the metrics row, the meters, the comm counter, its
AdamW. The plain loop is the ten lines every tutorial writes (forward, backward, clip, AdamW, zero
the gradients), on the same model, the same batches and the same learning-rate schedule, so it also
reaches the same losses; the table says by how much each script's loss differs from it.

How it is timed: step beside step. Each script runs in this process, as `python SCRIPT.py` would run
it, and after each of its steps (at its metrics row: common/metrics.after_each_row) one step of the
plain loop runs, on its own model. A script's step is the time from the end of the plain step before it to its
metrics row: the whole iteration, its tail included (metrics, meters, checks), not only the part a
script's own timer sees. Each ratio divides a script step by the plain step right after it, and the
table gives the median of all of them (step 1, the warm-up, left out, and the last step, which also ends
the run: chapter 04's scripts take their validation loss there).
Why so close together: a shared CPU's speed moves within seconds. Measured here, the same plain loop
ran at 205–213 ms per step while the core's neighbour was idle and 265–290 ms while it was busy, and
at 187 ms and 345 ms a minute apart; whole runs compared with whole runs, even bracketed by plain runs
seconds apart, gave ratios from 0.8 to 1.4 for the same script. Two steps a third of a second apart
mostly see the same machine.
On a CPU the clock is this process's CPU time, on one thread (`--clock cpu`, the default there), so
other programs' time slices are not counted. On a GPU it is the wall clock (the loss's `.item()` in
both loops waits for the GPU's queue, so the step's kernels are inside the interval).
"""
import math
import os
import runpy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.cli import Parser                             # noqa: E402
from common.data import TextData                          # noqa: E402
from common.domains import POSITIVE_INT, whole            # noqa: E402
from common.distributed import set_cpu_threads            # noqa: E402
from common.metrics import after_each_row                 # noqa: E402
from common.model import PRESETS, build_model, loss_sum   # noqa: E402
from common.optim import decays, lr_at                    # noqa: E402
from common.preset_training import training_defaults      # noqa: E402

# Each chapter's trainer at world size 1, with the flags that make it run the plain loop's work: one
# micro-batch (a pipeline would cut the batch into two by default, smaller matmuls) and its degrees at 1.
SCRIPTS = {
    "01 train_dp.py (bucketed)": ("01_data_parallel/train_dp.py", []),
    "01 train_zero.py (stage 3)": ("01_data_parallel/train_zero.py", ["--zero-stage", "3"]),
    "02 train_tp.py": ("02_tensor_parallel/train_tp.py", []),
    "03 train_1f1b.py": ("03_pipeline_parallel/train_1f1b.py", ["--microbatches", "1"]),
    "04 train_3d.py": ("04_3d_combined/train_3d.py", ["--dp", "1", "--tp", "1", "--pp", "1", "--microbatches", "1"]),
    "06 train_cp.py": ("06_context_parallel/train_cp.py", []),
    # (no balancing terms: the plain loop trains the MoE on the language-model loss alone)
    "05 train_moe.py (tiny-moe)": ("05_moe_expert_parallel/train_moe.py", ["--model", "tiny-moe", "--aux-loss-coef",
                                                                          "0", "--z-loss-coef", "0"]),
}
RESULTS = ROOT / "results" / "overhead.md"


def plain_steps(args, model_name: str):
    """The plain loop, one step per `next()`: yields each step's loss. Same model, batches, schedule and
    clipping as every script; torch's own AdamW defaults (fused on a GPU, one loop per tensor on a CPU)."""
    device = torch.device(args.device)
    model = build_model(PRESETS[model_name], args.seed, device, compile_backend=args.compile)
    named = list(model.named_parameters())
    lr, warmup = training_defaults(model_name)
    groups = [{"params": [p for n, p in named if decays(n)], "weight_decay": 0.1},      # (the scripts' groups)
              {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))          # torch's own choice of kernel
    data = TextData(None, args.seq_len, args.seed)
    tokens = args.global_batch * args.seq_len
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, lr, warmup, args.steps)
        x, y = (t.to(device) for t in data.global_batch(step, args.global_batch))
        with torch.autocast(device.type, torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = loss_sum(model(x), y) / tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        yield loss.item()                                 # (waits for the GPU, like a script's metrics row)


def plain_loop(args, model_name: str) -> tuple[list[float], list[float]]:
    """The plain loop on its own: (losses, seconds of each step after the first)."""
    losses, ends = [], []
    for loss in plain_steps(args, model_name):
        losses.append(loss)
        ends.append(args.clock())
    return losses, [b - a for a, b in zip(ends, ends[1:])]


def side_by_side(args, path: str, flags: list[str], model_name: str) -> dict:
    """One script's run in this process, as `python SCRIPT.py` runs it, with a step of the plain loop
    after each of its steps: {"losses", "plain_losses", "seconds", "plain_seconds"}, a script step's time
    being from the end of the plain step before it to its own metrics row."""
    argv = ["--steps", str(args.steps), "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len),
            "--seed", str(args.seed), "--dtype", args.dtype, "--device", args.device, "--quiet",
            "--compile", args.compile, *(["--model", args.model] if "--model" not in flags else []), *flags]
    plain, out = plain_steps(args, model_name), {"plain_losses": [], "seconds": [], "plain_seconds": []}
    started = [None]

    def plain_step(row):
        end = args.clock()
        if started[0] is not None:                        # (step 1, the warm-up, is left out)
            out["seconds"].append(end - started[0])
        out["plain_losses"].append(next(plain))
        plain_end = args.clock()
        if started[0] is not None:
            out["plain_seconds"].append(plain_end - end)
        started[0] = plain_end

    main = runpy.run_path(str(ROOT / path))["main"]
    with after_each_row(plain_step):
        out["losses"] = [r["loss"] for r in main(argv)]
    # the last step also ends the run (chapter 04's validation loss comes before its metrics row), which
    # is not a training step's cost: left out, like the first
    out["seconds"], out["plain_seconds"] = out["seconds"][:-1], out["plain_seconds"][:-1]
    return out


# Each script runs twice per round: as it comes, and without the activation meter (its one optional cost
# at world size 1: a Python call for every tensor autograd saves).
VARIANTS = {"": [], "no meter": ["--no-activation-meter"]}


def measure(args) -> dict:
    """{(name, variant): [(script's seconds per step, plain loop's, [ratio of each pair of steps], max loss
    difference)] per round}."""
    rows = {(name, v): [] for name in SCRIPTS for v in VARIANTS}
    for r in range(args.rounds):
        order = list(rows)[r % len(rows):] + list(rows)[:r % len(rows)]                # nobody always first
        for name, variant in order:
            path, flags = SCRIPTS[name]
            model = "tiny-moe" if "tiny-moe" in flags else args.model
            run = side_by_side(args, path, flags + VARIANTS[variant], model)
            ratios = [a / b for a, b in zip(run["seconds"], run["plain_seconds"])]
            row = rows[(name, variant)]
            row.append((statistics.median(run["seconds"]), statistics.median(run["plain_seconds"]), ratios,
                        max_rel(run["losses"], run["plain_losses"])))
            print(f"round {r + 1}: {name:30s} {variant:8s} {row[-1][0] * 1e3:8.1f} ms/step, plain loop "
                  f"{row[-1][1] * 1e3:8.1f}: × {statistics.median(ratios):.3f}", flush=True)
    return rows


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b)) if all(map(math.isfinite, a)) else math.inf


def table(args, rows: dict) -> str:
    lines = [f"`python -m common.bench_overhead {' '.join(sys.argv[1:])}`".replace(" `", "`"),
             "",
             f"{torch.__version__}, {args.device}, {torch.get_num_threads()} thread(s), {args.clock_name} clock, "
             f"{args.dtype}, --compile {args.compile}; `{args.model}`, global batch {args.global_batch} × "
             f"{args.seq_len} tokens, {args.steps} steps (the first and the last left out), {args.rounds} rounds. "
             "Each step of a "
             "script is followed by a step of the plain loop in the same process; a ratio is a script step over "
             "the plain step after it, and the table gives their median and middle half over all rounds. The "
             "MoE script is compared with the plain loop on its own model (tiny-moe). Each script also runs "
             "with `--no-activation-meter` (no `peak_activation_bytes`; ZeRO-3 meters nothing either way).",
             "",
             "| what ran | ms per step | the plain loop beside it | × the plain loop | middle half of the ratios "
             "| × without the meter | its middle half | loss vs the plain loop (max rel. diff) |",
             "|---|---|---|---|---|---|---|---|"]
    for name in SCRIPTS:
        cells = []
        for variant in VARIANTS:
            ratios = sorted(x for r in rows[(name, variant)] for x in r[2])
            quarter = len(ratios) // 4
            cells.append(f"{statistics.median(ratios):.3f} | {ratios[quarter]:.3f}–{ratios[-1 - quarter]:.3f}")
        runs = rows[(name, "")]
        lines.append(f"| {name} | {statistics.median(r[0] for r in runs) * 1e3:.1f} | "
                     f"{statistics.median(r[1] for r in runs) * 1e3:.1f} | {' | '.join(cells)} | "
                     f"{max(r[3] for v in VARIANTS for r in rows[(name, v)]):.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=[n for n in PRESETS if "moe" not in n])
    p.add_argument("--steps", type=whole(3), default=10,
                   help="steps per run; its first and last are not timed, so at least 3")
    p.add_argument("--rounds", type=POSITIVE_INT, default=4)
    p.add_argument("--global-batch", type=POSITIVE_INT, default=8)
    p.add_argument("--seq-len", type=whole(2), default=128)
    p.add_argument("--seed", type=whole(0, 2**32 - 1), default=1337)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--compile", default="none", choices=["none", "inductor", "aot_eager"])
    p.add_argument("--clock", choices=["cpu", "wall"], default=None,
                   help="cpu: this process's CPU time on one thread (default on a CPU); wall: the wall clock")
    p.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                   help="only the scripts whose path holds one of these (e.g. --only train_dp train_3d)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.only:
        for name in [n for n, (path, _) in SCRIPTS.items() if not any(t in path for t in args.only)]:
            del SCRIPTS[name]
    args.clock_name = args.clock or ("cpu" if args.device == "cpu" else "wall")
    if args.clock_name == "cpu":             # CPU time of one thread = the work of the step: every script's
        os.environ["THREADS_PER_RANK"] = "1"     # init_distributed gives it one thread (set_cpu_threads)
    set_cpu_threads()                        # the threads every script takes at world size 1
    args.clock = time.process_time if args.clock_name == "cpu" else time.perf_counter
    os.environ.pop("WORLD_SIZE", None)       # world size 1: each script makes its own group of one
    text = table(args, measure(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    from common.errors import run_main
    run_main(main)
