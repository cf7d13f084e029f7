"""How a GPU's matmul rate falls as the matmul shrinks: the curve the planner's GPU time model follows.

    python 07_choosing_a_layout/gpu_efficiency.py        # (make gpu-efficiency) → results/gpu_efficiency_<gpu>.json

A layout that splits a sequence (CP) or a layer (TP) hands each GPU smaller matmuls, and a small matmul
reaches less of the datasheet peak than a large one: too few tiles to fill the chip, too little work
per byte read. The planner's GPU model states one efficiency (0.5 of the peak, `--efficiency`); with a
measured curve for that GPU it keeps that figure for the largest matmuls and scales it down for the
smaller ones by what this curve says:

    efficiency(layout) = stated × rate(F) / rate(F_largest)

F is the FLOPs of the layout's typical matmul on one rank: a micro-batch's tokens on that rank (its
sequence share under CP) times the model width times the MLP's hidden width over TP, times 2. The
curve is measured here as bf16 (and fp32) matmuls of shape (tokens, width) @ (width, 4·width) over a
grid of tokens and widths; rate(F) is interpolated in log F between the measured points, clamped at
the ends. Without CUDA the command says so in one line and exits 0; the planner then keeps its one
stated efficiency, as before.
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = Path(__file__).resolve().parent / "results"
TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
WIDTHS = (1024, 2048, 4096, 8192)


def path_for(fragment: str) -> Path:
    return RESULTS / f"gpu_efficiency_{fragment}.json"


def load_curve(fragment: str, dtype: str) -> tuple | None:
    """((matmul FLOPs, share of the datasheet peak), ...) measured on GPU `fragment` (h100, a100) in
    `dtype`, sorted by FLOPs; None when no curve was measured for it."""
    path = path_for(fragment)
    if not path.exists():
        return None
    points = json.loads(path.read_text())["points"].get(dtype)
    return tuple(sorted((p["flops"], p["efficiency"]) for p in points)) if points else None


def rate_at(curve: tuple, flops: float) -> float:
    """The curve's share of the peak at a matmul of `flops`: linear in log FLOPs between two measured
    points, the end point's value beyond them."""
    if flops <= curve[0][0]:
        return curve[0][1]
    if flops >= curve[-1][0]:
        return curve[-1][1]
    for (f0, e0), (f1, e1) in zip(curve, curve[1:]):
        if f0 <= flops <= f1:
            t = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0)) if f1 > f0 else 0.0
            return e0 + t * (e1 - e0)
    raise AssertionError("unreachable: the curve is sorted")


def scaled_efficiency(stated: float, curve: tuple | None, flops: float) -> float:
    """The stated efficiency for the curve's largest matmuls, scaled down for smaller ones."""
    if curve is None:
        return stated
    return stated * rate_at(curve, flops) / max(e for _, e in curve)


def measure(dtype: str, seconds: float = 0.2) -> list[dict]:
    """{tokens, width, flops, tflops, efficiency} for every (tokens, width) of the grid on this GPU."""
    import torch
    from common import mfu
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    peak = mfu.peak_flops("cuda", dtype)
    points = []
    for width in WIDTHS:
        w = torch.randn(width, 4 * width, device="cuda", dtype=torch_dtype)
        for tokens in TOKENS:
            x = torch.randn(tokens, width, device="cuda", dtype=torch_dtype)
            x @ w                                                       # (warm-up: the kernel's choice)
            torch.cuda.synchronize()
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                for _ in range(10):
                    x @ w
                torch.cuda.synchronize()
                n += 10
            rate = 2 * tokens * width * 4 * width * n / (time.perf_counter() - start)
            points.append({"tokens": tokens, "width": width, "flops": 2 * tokens * width * 4 * width,
                           "tflops": rate / 1e12, "efficiency": rate / peak})
    return points


def fragment_of(name: str) -> str | None:
    for fragment in ("h100", "h200", "a100"):
        if fragment in name.lower():
            return "h100" if fragment == "h200" else fragment        # (H200: the H100's datasheet peak)
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=0.2, help="timing per matmul shape")
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("gpu_efficiency: no CUDA device here, nothing measured; the planner keeps its stated efficiency")
        return 0
    name = torch.cuda.get_device_name()
    fragment = fragment_of(name)
    if fragment is None:
        print(f"gpu_efficiency: {name} is not one of the planner's GPUs (h100, a100); nothing written")
        return 0
    points = {dtype: measure(dtype, args.seconds) for dtype in ("bf16", "fp32")}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path_for(fragment).write_text(json.dumps({"device": name, "torch": torch.__version__, "points": points},
                                             indent=1) + "\n")
    for dtype, pts in points.items():
        best = max(pts, key=lambda q: q["efficiency"])
        worst = min(pts, key=lambda q: q["efficiency"])
        print(f"{name} {dtype}: {worst['efficiency']:.1%} of the peak at {worst['tokens']} × {worst['width']}, "
              f"{best['efficiency']:.1%} at {best['tokens']} × {best['width']}")
    print(f"written: {path_for(fragment)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
