"""Model FLOPs utilisation (MFU): what share of the hardware's peak a run turns into the model's math.

    mfu = flops_per_token × tokens_per_s ÷ (peak FLOP/s of one device × devices)

Model FLOPs per token come from the configuration alone: what the model needs, whatever the layout
does on top (communication, recomputation, padding, idle pipeline slots all lower the MFU):

    6 · N_matmul            every weight matmul, forward + backward. A matmul with N weights costs
                            2N FLOPs per token forward (multiply + add) and 4N backward (input and
                            weight gradients). N_matmul counts, per layer, wq, wk, wv, wo, and the
                            SwiGLU gate, up and down, plus the LM head (D × V). The embedding is a
                            lookup (no FLOPs); norms and RoPE are O(D) per token and left out.
  + 6 · L · S · D           attention's QKᵀ and AV: each is 2·S·D FLOPs per token and layer forward
                            (S positions, D = H·hd; every query head counts, even with shared KV
                            heads), 12·L·S·D forward + backward; causal masking halves it (a token
                            attends to S/2 positions on average).

An MoE feed-forward (a config with n_experts > 0) counts ACTIVE parameters: the router (D × E) and
top_k experts of SwiGLU size D × expert_hidden each, instead of the dense MLP.

The peak of one device. On a GPU, the datasheet's dense figure for the device and the run's dtype
(fp32 matmuls use TF32 tensor cores when torch allows it). On a CPU there is no datasheet that
means much for one rank, so the peak of one core is measured once: the best rate of fp32 (or bf16)
matmuls on one thread over a few hundred ms, cached in ~/.cache/parallelism-from-scratch/peak.json
by CPU model and dtype (delete the file, or run `python -m common.mfu --remeasure` on a quiet
machine, to measure again). A rank with t threads has t cores' peak. (Why not probe with t threads?
On a shared machine a multi-threaded matmul runs at the pace of its most delayed thread, and can
measure several times less than one thread alone.) Ranks that share a core share its peak: on a CPU
the devices counted are at most the cores that exist.
"""
import json
import os
import platform
import time
from pathlib import Path

import torch

TFLOPS = 1e12
# Dense (no sparsity) peak FLOP/s from NVIDIA's datasheets; the first name fragment that matches wins.
DATASHEET = [
    ("H100 PCIe", {"bf16": 756 * TFLOPS, "tf32": 378 * TFLOPS, "fp32": 51.2 * TFLOPS}),
    ("H100", {"bf16": 989.4 * TFLOPS, "tf32": 494.7 * TFLOPS, "fp32": 66.9 * TFLOPS}),      # SXM
    ("H200", {"bf16": 989.4 * TFLOPS, "tf32": 494.7 * TFLOPS, "fp32": 66.9 * TFLOPS}),      # H100 SXM's
    ("A100", {"bf16": 312 * TFLOPS, "tf32": 156 * TFLOPS, "fp32": 19.5 * TFLOPS}),
]
PROBE_SIZES = (256, 512)               # square matmuls; the best rate of any counts
PROBE_SECONDS = 0.3


def matmul_params(cfg) -> int:
    """Weights that take part in a matmul for one token (N_matmul): active ones for MoE."""
    D, L, V = cfg.dim, cfg.n_layers, cfg.vocab_size
    kv = cfg.n_kv_heads * cfg.head_dim
    attn = D * D + 2 * D * kv + D * D                           # wq, wk, wv, wo
    n_experts = getattr(cfg, "n_experts", 0) or 0
    if n_experts:                                               # router + the top_k experts a token visits
        hidden = getattr(cfg, "expert_hidden", None) or cfg.ffn_hidden
        mlp = D * n_experts + getattr(cfg, "top_k", 1) * 3 * D * hidden
    else:
        mlp = 3 * D * cfg.ffn_hidden                            # gate, up, down
    return L * (attn + mlp) + D * V                             # + LM head; the embedding is a lookup


def attention_flops_per_token(cfg, seq_len: int, causal: bool = True) -> float:
    """Attention's QKᵀ and AV per token, forward and backward: 6·L·S·D (see the module docstring);
    `causal=False`: the whole square, 12·L·S·D, as PaLM's definition of MFU counts it (Chowdhery et al.,
    Appendix B: 6N + 12·L·H·Q·T), which some published MFUs use."""
    return (6 if causal else 12) * cfg.n_layers * seq_len * cfg.dim


def flops_per_token(cfg, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs per token: 6·N_matmul + 6·L·S·D (see the module docstring; `causal` as above)."""
    return 6 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len, causal)


def recompute_flops_per_token(cfg, seq_len: int, mode: str, blocks: int | None = None) -> float:
    """The FLOPs per token that --recompute adds to a step: none for `selective` (norms and SwiGLU's silu,
    elementwise); for `full`, each recomputed block's forward again (`blocks` of them; None: every block)
    as far as backward needs it. The recomputation
    stops at the last tensor backward uses, so a dense block skips its down projection (its output only
    feeds the residual sum), where a mixture reruns its experts whole (the combine weights their outputs,
    which backward needs): the bytes of chapter 02's tp_collectives(recompute="full") say the same."""
    if mode != "full":
        return 0.0
    D = cfg.dim
    down = 0 if cfg.n_experts else D * cfg.ffn_hidden
    block = (matmul_params(cfg) - D * cfg.vocab_size) / cfg.n_layers - down    # weights one token meets again
    share = 1.0 if blocks is None else blocks / cfg.n_layers
    return share * (cfg.n_layers * 2 * block + attention_flops_per_token(cfg, seq_len) / 3)


def measure_peak_flops(device, dtype: torch.dtype, seconds: float = PROBE_SECONDS) -> float:
    """The best FLOP/s of square matmuls on `device` over `seconds` (the max filters out the moments
    another process had the core)."""
    best = 0.0
    for n in PROBE_SIZES:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        a @ b                                                   # warm-up: allocation, kernel choice
        deadline = time.perf_counter() + seconds / len(PROBE_SIZES)
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            a @ b
            if a.is_cuda:
                torch.cuda.synchronize()
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
    return best


def cache_path() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "parallelism-from-scratch" / "peak.json"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measured_peak(key: str, device, dtype: torch.dtype, remeasure: bool = False) -> float:
    """The probe's result for `key`, from the cache, or measured now and cached."""
    return cached_measurement(key, lambda: measure_peak_flops(device, dtype), remeasure)


def cached_measurement(key: str, measure, remeasure: bool = False):
    """cache[key], or `measure()` now, stored under `key` in the cache file (a JSON value)."""
    path = cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache or remeasure:
        cache[key] = measure()
        try:                                                    # atomic: ranks of two runs may race
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            tmp.replace(path)
        except OSError:
            pass                                                # read-only home: measure every run
    return cache[key]


def peak_flops(device, dtype: str = "fp32", remeasure: bool = False) -> float:
    """Peak FLOP/s of ONE device (one rank) for matmuls in `dtype` ("fp32" or "bf16")."""
    device = torch.device(device)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        kind = "tf32" if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32 else dtype
        for fragment, peaks in DATASHEET:
            if fragment in name:
                return peaks[kind]
        return measured_peak(f"{name} | {kind}", device, torch_dtype, remeasure)      # unknown GPU
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        per_core = measured_peak(f"{cpu_model()} | one core | {dtype}", device, torch_dtype, remeasure)
    finally:
        torch.set_num_threads(threads)
    return per_core * threads


def peak_flops_total(device, dtype: str, world_size: int) -> float:
    """Peak FLOP/s of all the devices of a run: one per rank on GPUs; on a CPU, ranks beyond the
    cores of a machine add nothing (two ranks time-sharing a core share its peak)."""
    per_device = peak_flops(device, dtype)
    if torch.device(device).type == "cuda":
        return per_device * world_size
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    per_machine = min(local, max(1, (os.cpu_count() or 1) // torch.get_num_threads()))
    return per_device * per_machine * max(1, world_size // local)


if __name__ == "__main__":
    import argparse
    from common.model import PRESETS                            # run as `python -m common.mfu`
    ap = argparse.ArgumentParser(description="FLOPs per token of each preset, and this machine's peak")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="threads per rank (CPU: t × one core's peak)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--remeasure", action="store_true", help="run the probe again and overwrite the cache")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name, cfg in PRESETS.items():
        print(f"{name:>8}: {flops_per_token(cfg, args.seq_len) / 1e6:10.1f} MFLOP per token at seq_len {args.seq_len}")
    peak = peak_flops(args.device, args.dtype, args.remeasure)
    print(f"peak of one {args.device} device ({args.threads} thread(s), {args.dtype}): {peak / 1e9:,.1f} GFLOP/s"
          + (f"  (cached in {cache_path()})" if args.device == "cpu" else ""))
