"""The trainer's own overhead: each chapter's script at world size 1 against a plain loop on the same model.

    python -m common.bench_overhead                 # tiny, 6 steps, 3 rounds: about 1½ minutes on 2 CPU cores
    python -m common.bench_overhead --model small --steps 6 --rounds 3 --device cuda --dtype bf16

At world size 1 every collective of the course is skipped, so what a script costs beyond the plain
loop is its machinery: the step protocol's verbs, the metrics row, the meters, the comm counter, its
AdamW. The plain loop is the ten lines every tutorial writes (forward, backward, clip, AdamW, zero
the gradients), on the same model, the same batches and the same learning-rate schedule, so it also
reaches the same losses; the table says by how much each script's loss differs from it.

How it is timed. Each script runs in this process, as `python SCRIPT.py` would run it, and the
time of a step is the time between two consecutive metrics rows (`RunLog.log_step`): the whole
iteration, its tail included (metrics, meters, checks), not only the part a script's own timer sees.
The plain loop is timed the same way, between two iterations' ends. Step 1 (warm-up) is left out,
and a run counts its fastest step: other processes can only slow a step down, never speed it up, so
the fastest is the closest to the step's own cost (the rule `timeit` follows).
On a CPU the clock is this process's CPU time, on one thread (`--clock cpu`, the default there): a
laptop's other programs then steal time from the wall clock but not from it, so a 3 % difference
stays measurable on a busy machine. On a GPU it is the wall clock (the loss's `.item()` in both
loops waits for the GPU's queue, so the step's kernels are inside the interval).
Rounds are paired: in each round every contestant runs once, in a rotated order, and its ratio is
taken against the plain loop *of the same round*, so a machine that slows down for a minute (other
processes) slows both sides of a ratio; the table gives the median over the rounds.
"""
import argparse
import math
import os
import runpy
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.data import TextData                          # noqa: E402
from common.distributed import set_cpu_threads            # noqa: E402
from common.metrics import RunLog                         # noqa: E402
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


def plain_loop(args, model_name: str) -> tuple[list[float], list[float]]:
    """The plain loop: (losses, seconds of each step after the first). Same model, batches, schedule and
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
    losses, ends = [], []
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
        losses.append(loss.item())                        # (waits for the GPU, like a script's metrics row)
        ends.append(args.clock())
    return losses, [b - a for a, b in zip(ends, ends[1:])]


def script_run(args, path: str, flags: list[str]) -> tuple[list[float], list[float]]:
    """One script's run in this process: (losses, seconds between consecutive metrics rows)."""
    argv = ["--steps", str(args.steps), "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len),
            "--seed", str(args.seed), "--dtype", args.dtype, "--device", args.device, "--quiet",
            "--compile", args.compile, *(["--model", args.model] if "--model" not in flags else []), *flags]
    ends, log_step = [], RunLog.log_step

    def timed_log_step(self, *a, **kw):
        row = log_step(self, *a, **kw)
        ends.append(args.clock())
        return row

    main = runpy.run_path(str(ROOT / path))["main"]       # the script's main(), as `python SCRIPT.py` runs it
    # (the threads stay as the benchmark set them: a script at world size 1 would take every core)
    with mock.patch.object(RunLog, "log_step", timed_log_step), \
            mock.patch("common.distributed.set_cpu_threads", lambda: None):
        history = main(argv)
    return [r["loss"] for r in history], [b - a for a, b in zip(ends, ends[1:])]


def measure(args) -> dict:
    """{name: [(fastest step s, ratio to the same round's plain loop, max loss difference)] per round}."""
    names = ["plain loop"] + list(SCRIPTS)
    rows = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]        # rotated: nobody always runs first
        models = {"tiny-moe" if "tiny-moe" in flags else args.model for _, flags in SCRIPTS.values()} | {args.model}
        plain = {m: plain_loop(args, m) for m in sorted(models)}
        for name in order:
            if name == "plain loop":
                continue
            path, flags = SCRIPTS[name]
            reference = plain["tiny-moe" if "tiny-moe" in flags else args.model]
            losses, steps = script_run(args, path, flags)
            ratio = min(steps) / min(reference[1])
            rows[name].append((min(steps), ratio, max_rel(losses, reference[0])))
            print(f"round {r + 1}: {name:30s} {min(steps) * 1e3:8.1f} ms/step  × {ratio:.3f}", flush=True)
        rows["plain loop"].append((min(plain[args.model][1]), 1.0, 0.0))
    return rows


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b)) if all(map(math.isfinite, a)) else math.inf


def table(args, rows: dict) -> str:
    lines = [f"`python -m common.bench_overhead {' '.join(sys.argv[1:])}`".replace(" `", "`"),
             "",
             f"{torch.__version__}, {args.device}, {torch.get_num_threads()} thread(s), {args.clock_name} clock, "
             f"{args.dtype}, --compile {args.compile}; `{args.model}`, global batch {args.global_batch} × "
             f"{args.seq_len} tokens, {args.steps} steps (step 1 left out; each run's fastest step), {args.rounds} "
             "paired rounds, their median. The MoE script is compared with the plain loop on its own model "
             "(tiny-moe). On a machine busy with other work a ratio moves by ±10 % from run to run: read one "
             "within that of 1 as equal.",
             "",
             "| what ran | ms per step | × the plain loop | loss vs the plain loop (max rel. diff) |",
             "|---|---|---|---|"]
    for name, runs in rows.items():
        ms = statistics.median(r[0] for r in runs) * 1e3
        ratio = statistics.median(r[1] for r in runs)
        diff = max(r[2] for r in runs)
        lines.append(f"| {name} | {ms:.1f} | {ratio:.3f} | {diff:.1e} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=[n for n in PRESETS if "moe" not in n])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--compile", default="none", choices=["none", "inductor", "aot_eager"])
    p.add_argument("--clock", choices=["cpu", "wall"], default=None,
                   help="cpu: this process's CPU time on one thread (default on a CPU); wall: the wall clock")
    p.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                   help="only the scripts whose path holds one of these (e.g. --only train_dp train_3d)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.only:
        for name in [n for n, (path, _) in SCRIPTS.items() if not any(t in path for t in args.only)]:
            del SCRIPTS[name]
    args.clock_name = args.clock or ("cpu" if args.device == "cpu" else "wall")
    if args.clock_name == "cpu":
        torch.set_num_threads(1)             # CPU time of one thread = the work of the step
    else:
        set_cpu_threads()                    # the threads every script takes at world size 1
    args.clock = time.process_time if args.clock_name == "cpu" else time.perf_counter
    os.environ.pop("WORLD_SIZE", None)       # world size 1: each script makes its own group of one
    text = table(args, measure(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
