"""A GPU's own device file, measured: the same form as devices/*.json (device_files.py), from this GPU's runs.

    python 07_choosing_a_layout/gpu_efficiency.py        # (make gpu-efficiency) → devices/<gpu>-measured.json
    torchrun --nproc_per_node=8 07_choosing_a_layout/gpu_efficiency.py      # (make gpu-efficiency GPUS=8) and NCCL
    python 07_choosing_a_layout/choose_layout.py --device 07_choosing_a_layout/devices/h100-sxm-measured.json ...

The described files carry datasheet rates and published efficiencies. This one measures, on the GPU it
runs on, what the planner's step time reads (and copies the rest from the described file of the same GPU):

    matmul_efficiency     bf16 matmuls (tokens, width) @ (width, 4·width) over a grid of sizes: each one's
                          FLOP/s over the datasheet peak, a row per size (its GFLOP, its share)
    attention_efficiency  torch's fused causal attention (scaled_dot_product_attention), forward and
                          backward, at 8 sequences of 4,096 with head dim 128: its products' FLOP/s
    hbm                   a copy of 1 MB to 1 GB: the best rate is the bandwidth, each size's share of it a row
    networks              under torchrun with several GPUs of one node, the first tier's efficiency and
                          latency from NCCL all-reduces among them (collective_efficiency.py: nccl-tests'
                          busbw over the line rate; the smallest size's time); the rest kept from the
                          described file (one GPU: all of it)
    processing            "roofline": a measured rate already includes the traffic (or the arithmetic) of
                          the operation it timed, so the two are not added again

A measured file replaces a described one with no other change. Without CUDA the command says so in one
line and exits 0; without PyTorch (a Python before `make setup`) it says so in one line and exits 1.
"""
import argparse
import json
import os
import re
import sys
import time
from importlib import import_module
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEVICES = Path(__file__).resolve().parent / "devices"
TOKENS = (128, 512, 2048, 8192)
WIDTHS = (1024, 4096, 8192)
COPY_MB = (1, 10, 100, 1000)


def described_name(gpu: str) -> str | None:
    """The described device file of a GPU by its CUDA name (devices/<name>.json), or None."""
    for fragment, name in (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80g")):
        if fragment in gpu:
            return name
    return None


def device_file(base: dict, measured: dict, gpu: str, stamp: str) -> dict:
    """The described file `base` with what was measured in place of what it described.
    `measured`: {"matmul": [(FLOPs, share)], "flash": share, "copy": [(bytes, bytes/s)],
    "nccl": collective_efficiency.summary() | None}."""
    said = f"measured on {gpu} ({stamp}) by gpu_efficiency.py"
    out = json.loads(json.dumps(base))
    out["name"] = f"{gpu} (measured)"
    matmul = sorted(measured["matmul"], reverse=True)
    out["matmul_efficiency"] = {"gflop": [[round(f / 1e9, 3), round(e, 3)] for f, e in matmul[:-1]]
                                + [[0, round(matmul[-1][1], 3)]],
                                "source": f"{said}: bf16 matmuls (tokens, width) @ (width, 4·width), FLOP/s over "
                                          f"the datasheet peak"}
    out["attention_efficiency"] = {"flash": round(measured["flash"], 3),
                                   "source": f"{said}: scaled_dot_product_attention, causal, forward + backward"}
    copies = sorted(measured["copy"], reverse=True)
    best = max(rate for _, rate in copies)
    out["hbm"] = {**out["hbm"], "gbps": round(best / 1e9, 1),
                  "mb_efficiency": [[round(b / 1e6), round(r / best, 3)] for b, r in copies[:-1]]
                  + [[0, round(copies[-1][1] / best, 3)]],
                  "source": f"capacity: {out['hbm']['source']}; bandwidth: {said}, a copy, read + written bytes "
                            f"per second, the best size's; the share of it each size reached"}
    if measured.get("nccl"):           # a busbw above the line rate (NVLink SHARP, say) counts as the line rate
        net, tier = measured["nccl"], out["networks"][0]
        out["networks"][0] = {**tier, "efficiency": float(f"{min(1.0, net['busbw'] / (tier['gbps'] * 1e9)):.4g}"),
                              "latency_us": round(net["latency"] * 1e6, 1),
                              "source": f"bandwidth: {tier['source'].split(';')[0].removeprefix('bandwidth: ')}; "
                                        f"efficiency and latency {said}: all-reduces among {net['ranks']} GPUs, "
                                        f"busbw {net['busbw'] / 1e9:,.1f} GB/s at {net['at'] / 2**20:,.0f} MiB "
                                        f"over the line rate, and one of {min(net['sizes'])[0]} bytes"}
    out["processing"] = {"mode": "roofline", "source": f"{said}: each rate includes its operation's own traffic"}
    return out


def dumps(device: dict) -> str:
    """A device file as JSON, each [size, share] table on one line."""
    text = json.dumps(device, indent=1, ensure_ascii=False)
    text = re.sub(r"\[\s*([-\d.e+]+),\s*([-\d.e+]+)\s*\]", r"[\1, \2]", text)
    return re.sub(r"\[\s*(\[[^\[\]]*\](?:,\s*\[[^\[\]]*\])*)\s*\]",
                  lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text) + "\n"


def timed(fn, seconds: float) -> float:
    """Seconds per call of `fn` on the GPU, after a warm-up."""
    import torch
    fn()
    torch.cuda.synchronize()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n


def measure(peak: float, seconds: float) -> dict:
    """This GPU's matmul sweep, fused attention and copy bandwidth (module docstring)."""
    import torch
    import torch.nn.functional as F
    matmul = []
    for width in WIDTHS:
        w = torch.randn(width, 4 * width, device="cuda", dtype=torch.bfloat16)
        for tokens in TOKENS:
            x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
            flops = 2 * tokens * width * 4 * width
            matmul.append((flops, flops / timed(lambda: x @ w, seconds) / peak))
    q, k, v = (torch.randn(8, 32, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def attention():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    flops = 3.5 * 4 * 8 * 32 * 4096 * 4096 * 128 / 2      # 2 products forward, 5 backward; the causal half
    copy = []
    for mb in COPY_MB:
        a = torch.empty(mb * 10**6 // 2, device="cuda", dtype=torch.bfloat16)
        b = torch.empty_like(a)
        copy.append((2 * a.numel() * 2, 2 * a.numel() * 2 / timed(lambda: b.copy_(a), seconds)))
    return {"matmul": matmul, "flash": flops / timed(attention, seconds) / peak, "copy": copy, "nccl": None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=0.2, help="timing per shape")
    args = p.parse_args(argv)
    from common.gpu_check import import_torch
    torch = import_torch("gpu-efficiency", "07_choosing_a_layout/gpu_efficiency.py")
    if torch is None:
        return 1
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    say = print if rank == 0 else (lambda *_: None)
    if not torch.cuda.is_available():
        say("gpu_efficiency: no CUDA device here, nothing measured; the planner keeps the described devices/*.json")
        return 0
    gpu = torch.cuda.get_device_name()
    name = described_name(gpu)
    if name is None:
        say(f"gpu_efficiency: {gpu} has no described file in devices/ to start from; nothing written")
        return 0
    if world > 1:                       # torchrun: the other GPUs wait while rank 0 sweeps its own, then NCCL
        import torch.distributed as dist
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    from common import mfu
    collective_efficiency = import_module("07_choosing_a_layout.collective_efficiency")   # imports torch
    measured = measure(mfu.peak_flops("cuda", "bf16"), args.seconds) if rank == 0 else {}
    one_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world
    measured["nccl"] = collective_efficiency.measure() if world > 1 and one_node else None
    if world > 1:
        dist.destroy_process_group()
    if rank:
        return 0
    base = json.loads((DEVICES / f"{name}.json").read_text())
    path = DEVICES / f"{name}-measured.json"
    stamp = f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    path.write_text(dumps(device_file(base, measured, gpu, stamp)))
    nccl = measured["nccl"]
    links = (f", NCCL all-reduce busbw {nccl['busbw'] / 1e9:,.0f} GB/s among {nccl['ranks']} GPUs" if nccl else
             "; the links kept as described" + ("" if one_node else " (the ranks span nodes: not measured)"))
    print(f"{gpu}: matmul {min(e for _, e in measured['matmul']):.1%}–{max(e for _, e in measured['matmul']):.1%} "
          f"of the peak, fused attention {measured['flash']:.1%}, copy "
          f"{max(r for _, r in measured['copy']) / 1e9:,.0f} GB/s{links}; written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
