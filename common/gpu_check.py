"""`make gpu-check`: every training script on one GPU, then the MFU of a model sized for it.

    python common/gpu_check.py            # writes results/gpu_check.md (and prints it)
    python common/gpu_check.py --quick    # the first part only (every script, fp32 and bf16, 5 steps)

On a machine without CUDA it says so in one line and exits 0: there is nothing to check. With a Python
that lacks PyTorch (before `make setup`) it says so in one line and exits 1: it cannot check.
It needs only what the GPU machine already has (PyTorch with CUDA, rich): no setup step, no download.

1. Every `train_*.py` at world size 1 (`python SCRIPT.py --device cuda`), `tiny` preset (`tiny-moe` where
   the script trains experts), in fp32 and in bf16, 5 steps: did it finish, its step-5 loss (in fp32 the
   CPU's to round-off), tokens/s (median of steps 2–5), and the allocator's peak memory.
2. MFU on a model sized for the GPU (`--model xl --seq-len 2048 --global-batch 8 --dtype bf16`, 1.08 B
   parameters): `train_dp.py` and `train_3d.py` at world size 1, eager and with `--compile`, MFU =
   the model's FLOPs per token × tokens/s ÷ the datasheet peak (common/mfu.py).
3. The trainer's overhead at that shape: `python -m common.bench_overhead` on the GPU (the plain loop
   and those two scripts, eager and compiled), its tables appended.
Each run is its own process (a fresh GPU each time); a run that fails is a row with its last error line.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "gpu_check.md"
SCRIPTS = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("0[1-6]_*/train_*.py"))
MFU_SHAPE = ["--model", "xl", "--seq-len", "2048", "--global-batch", "8", "--dtype", "bf16"]
MFU_RUNS = {"01_data_parallel/train_dp.py": [],
            "04_3d_combined/train_3d.py": ["--dp", "1", "--tp", "1", "--pp", "1", "--microbatches", "1"]}


def run(script: str, flags: list[str], steps: int) -> dict:
    """One run of `script` on the GPU: {ok, loss, tokens_per_s, mfu, peak, error, seconds}."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        cmd = [sys.executable, str(ROOT / script), "--device", "cuda", "--steps", str(steps), "--quiet",
               "--metrics", str(metrics), *flags]
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if done.returncode != 0 or len(rows) < steps:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        return {"ok": False, "error": lines[-1][:200] if lines else f"exit code {done.returncode}", "seconds": seconds}
    steady = rows[1:] or rows
    return {"ok": True, "loss": rows[-1]["loss"], "seconds": seconds,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "mfu": statistics.median(r["mfu"] for r in steady) if "mfu" in rows[-1] else None,
            "peak": max((r.get("peak_memory_bytes") or 0) for r in rows) or None}


def every_script() -> list[str]:
    lines = ["## 1. Every script at world size 1, 5 steps", "",
             "`python SCRIPT.py --device cuda --steps 5 --dtype fp32|bf16` (tiny; tiny-moe for the MoE scripts' "
             "default). Tokens/s: median of steps 2–5; peak: the CUDA allocator's.", "",
             "| script | dtype | finished | step-5 loss | tokens/s | peak memory |", "|---|---|---|---|---|---|"]
    for script in SCRIPTS:
        for dtype in ("fp32", "bf16"):
            r = run(script, ["--dtype", dtype], steps=5)
            lines.append(row(f"`{script}`", dtype, r))
            print(lines[-1], flush=True)
    return lines


def mfu_runs() -> list[str]:
    lines = ["", "## 2. MFU on a model sized for the GPU", "",
             f"`python SCRIPT.py --device cuda {' '.join(MFU_SHAPE)} --steps 10 [--compile]` (1.08 B parameters); "
             "median of steps 2–10; MFU against the datasheet's bf16 peak (common/mfu.py).", "",
             "| script | compile | finished | tokens/s | MFU | peak memory |", "|---|---|---|---|---|---|"]
    for script, flags in MFU_RUNS.items():
        for compile_flags in ([], ["--compile"]):
            r = run(script, MFU_SHAPE + flags + compile_flags, steps=10)
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
            lines.append(f"| `{script}` | {'inductor' if compile_flags else 'eager'} | {finished(r)} | "
                         f"{r.get('tokens_per_s', 0):,.0f} | {mfu} | {gib(r.get('peak'))} |")
            print(lines[-1], flush=True)
    return lines


def overhead_tables() -> list[str]:
    lines = ["", "## 3. The trainer's overhead at that shape (python -m common.bench_overhead)", ""]
    shape = ["--model", "xl", "--seq-len", "2048", "--global-batch", "8", "--dtype", "bf16", "--device", "cuda",
             "--steps", "6", "--rounds", "2", "--only", "train_dp", "train_3d"]
    for backend in ("none", "inductor"):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "overhead.md"
            done = subprocess.run([sys.executable, "-m", "common.bench_overhead", *shape, "--compile", backend,
                                   "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
            if done.returncode == 0 and out.exists():
                lines += [out.read_text(), ""]
            else:
                last = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()][-1:]
                lines += [f"--compile {backend}: failed ({last[0][:200] if last else done.returncode})", ""]
        print(lines[-2], flush=True)
    return lines


def row(name: str, dtype: str, r: dict) -> str:
    if not r["ok"]:
        return f"| {name} | {dtype} | no: {r['error']} | - | - | - |"
    return f"| {name} | {dtype} | yes | {r['loss']:.6f} | {r['tokens_per_s']:,.0f} | {gib(r['peak'])} |"


def finished(r: dict) -> str:
    return "yes" if r["ok"] else f"no: {r['error']}"


def gib(n) -> str:
    return f"{n / 2**30:.2f} GiB" if n else "-"


def import_torch(tool: str, script: str):
    """PyTorch, or None after one line on stderr saying this Python has none (a GPU tool run before
    `make setup`, by a Python without it): the caller exits 1."""
    try:
        import torch
    except ModuleNotFoundError:
        print(f"{tool}: this Python ({sys.executable}) has no PyTorch; run `make setup`, or run "
              f"{script} with a Python that has PyTorch and CUDA", file=sys.stderr)
        return None
    return torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="every script only (part 1), not the MFU runs")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch = import_torch("gpu-check", "common/gpu_check.py")        # (after --help: importing takes seconds)
    if torch is None:
        return 1
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device on this machine (PyTorch {torch.__version__}); nothing to check")
        return 0
    name = torch.cuda.get_device_name(0)
    head = [f"# GPU check: {name}", "",
            f"`python common/gpu_check.py{' --quick' if args.quick else ''}` on one {name}, PyTorch "
            f"{torch.__version__} (CUDA {torch.version.cuda}), {time.strftime('%Y-%m-%d')}.", ""]
    lines = head + every_script()
    if not args.quick:
        lines += mfu_runs() + overhead_tables()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
