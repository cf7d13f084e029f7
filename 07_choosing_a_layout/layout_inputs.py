"""What the layout planner (choose_layout.py) starts from: a model's shape and a device's numbers.

Models. The course's presets (common/model.PRESETS), plus published shapes written as this course's
configuration (a Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU), to plan with
only: nobody trains them here. Each comes from its paper:

    llama3-8b / 70b / 405b   The Llama 3 Herd of Models (Llama Team, Meta, 2024), Table 3
    gpt3-175b                Language Models are Few-Shot Learners (Brown et al., 2020), Table 2.1: d 12288,
                             96 layers, 96 heads, a GELU MLP of 4d = 49152 (model_files.gelu_model: its
                             memory counted as a SwiGLU of 32768, the same 2·d·4d = 3·d·32768 weights, its
                             time as the two matrices of 49152 it runs), the vocabulary 50257 padded to
                             51200 (a multiple of 128·8, as Megatron-LM pads it for TP 8); as Megatron-LM
                             builds a GPT, biases, dropout and the head tied to the embedding (their time:
                             model_files.PlannedModel; its memory keeps both copies, as Megatron-LM does)
    mixtral-8x7b             Mixtral of Experts (Jiang et al., 2024), Table 1
    deepseek-v3              DeepSeek-V3 Technical Report (DeepSeek-AI, 2024), §4.2: d 7168, 61 layers,
                             128 heads, 256 routed experts of hidden 2048, 8 per token. Approximated:
                             multi-head latent attention as 128 plain heads of 56 (the same 4·d² weights
                             within 10 %), the shared expert and the 3 dense first layers as routed
                             layers (700B parameters, 36B active, against the published 671B and 37B)

Devices. `cpu` is this machine: one core's peak FLOP/s from the course's own probe (common/mfu.py),
the cores ranks share, its memory, and the gloo link measured once (`measure_link`, cached beside the
peak). A GPU is a device file (device_files.py; devices/a100-80g.json, h100-sxm.json, h200.json, `a100`
and `h100` for the first two, or any path): its peak, its matmul efficiency by size, its memory and the
two network tiers, each number with its source in the file. A link's rate in `Device` is in the
counter's unit: bytes sent + received per second (twice the file's one-way rate).
"""
import os
import time
from dataclasses import dataclass, replace
from importlib import import_module
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import comm, mfu
from common.errors import require
from common.model import PRESETS, ModelConfig

device_files = import_module("07_choosing_a_layout.device_files")    # this chapter: a GPU's rates, by file
model_files = import_module("07_choosing_a_layout.model_files")      # this chapter: a model of one's own

PUBLISHED = {
    "llama3-8b": ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                             max_seq_len=131072, rope_theta=500000.0),
    "llama3-70b": ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                              max_seq_len=131072, rope_theta=500000.0),
    "llama3-405b": ModelConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                               ffn_hidden=53248, max_seq_len=131072, rope_theta=500000.0),
    "gpt3-175b": model_files.gelu_model(vocab_size=51200, dim=12288, n_layers=96, n_heads=96, n_kv_heads=96,
                                        ffn_hidden=49152, max_seq_len=2048, bias=True, dropout=True,
                                        tied_embeddings=True),
    "mixtral-8x7b": ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                                max_seq_len=32768, rope_theta=1e6, n_experts=8, top_k=2, expert_hidden=14336),
    "deepseek-v3": ModelConfig(vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128,
                               ffn_hidden=18432, max_seq_len=131072, n_experts=256, top_k=8, expert_hidden=2048),
}
MODELS = {**PRESETS, **PUBLISHED}


@dataclass(frozen=True)
class Device:
    name: str
    memory: float              # bytes one rank may hold
    peak: float                # FLOP/s of one rank in the run's dtype
    intra: float               # link rate inside a node, bytes sent + received per second
    inter: float               # across nodes
    latency_intra: float       # seconds one collective or message costs before its bytes
    latency_inter: float
    cores: int | None = None   # a CPU: ranks share these cores (None: one device per rank)
    efficiency: float = 0.5    # the share of `peak` the model's math reaches (the stated efficiency)
    # a CPU calibrated on this machine's runs (calibrate_cpu.py): seconds per collective and per byte of one
    # rank, before the W/C stretch of ranks sharing cores; None: the link probe's latency and rate instead
    call_s: float | None = None
    byte_s: float | None = None
    # a GPU: its device file (device_files.py), every operation's rate by size; the step is timed from it
    spec: object = None
    # the share of `memory` a run cannot use (working_set.py: a GPU's CUDA context and allocator fragmentation)
    headroom: float = 0.0


def gpu(name: str, dtype: str, efficiency: float | None = None) -> Device:
    """A GPU from its device file (device_files.py: devices/NAME.json or a path); `efficiency` (--efficiency)
    puts one share of the peak in place of the file's matmul table, the same for every size."""
    spec = device_files.load(name, dtype)
    if efficiency:
        spec = replace(spec, matmul=((0.0, efficiency),))
    inside, across = spec.tiers
    return Device(Path(name).stem if name.endswith(".json") else name, spec.memory_bytes, spec.peak["run"],
                  2 * inside.rate, 2 * across.rate, inside.latency, across.latency, efficiency=efficiency or 0.5,
                  spec=spec, headroom=import_module("07_choosing_a_layout.working_set").HEADROOM)   # stated


def cpu(dtype: str, world: int) -> Device:
    """This machine: all ranks share its cores and its memory; every group talks through gloo."""
    cores = os.cpu_count() or 1
    rate, latency = measured_link()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world
    dev = Device("cpu", memory, mfu.peak_flops("cpu", dtype) / torch.get_num_threads(), rate, rate, latency,
                 latency, cores=cores, efficiency=0.4)
    # calibrated on the course's runs on this CPU (calibrate_cpu.py), fp32: its efficiency, collective and byte
    # costs; without a calibration for this CPU, 0.4 (the share of one core's probed peak the 1-rank tiny run
    # turns into model FLOPs, its mfu) and the link probe
    model = import_module("07_choosing_a_layout.calibrate_cpu").load()
    if model and dtype == "fp32":
        dev = replace(dev, efficiency=model["efficiency"], call_s=model["seconds_per_call"],
                      byte_s=model["seconds_per_byte"])
    return dev


DEVICES = ("cpu", *device_files.ALIASES, *device_files.names())


def device_for(name: str, dtype: str, world: int, efficiency: float | None = None) -> Device:
    """`cpu` (this machine), a device file's name (devices/), or a path to one (device_files.load refuses a
    bad one naming its field)."""
    if name != "cpu":
        return gpu(name, dtype, efficiency)
    dev = cpu(dtype, world)
    return replace(dev, efficiency=efficiency) if efficiency else dev


def model_for(name: str) -> ModelConfig:
    """A course preset, a published shape, or a model file (model_files.py: `--model PATH.json`)."""
    if name.endswith(".json"):
        return model_files.load(name)
    require(name in MODELS, f"unknown --model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name]


# --- the gloo link of this machine, measured once -------------------------------------------------------
LINK_SMALL, LINK_LARGE = 1, 2 ** 21                  # floats: 4 bytes (latency), 8 MiB (bandwidth)


def _link_probe(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    result = {}
    for n, reps in ((LINK_SMALL, 50), (LINK_LARGE, 5)):
        t = torch.ones(n)
        dist.all_reduce(t)                                           # warm-up
        best = float("inf")
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            best = min(best, time.perf_counter() - t0)
        result[n] = best
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def measure_link() -> tuple[float, float]:
    """(bytes sent + received per second, seconds per collective) of a gloo all-reduce between two
    processes of this machine: the best of a few, as common/mfu's probe takes the best matmul."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), 29700 + os.getpid() % 200
    procs = [ctx.Process(target=_link_probe, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=120)
    for p in procs:
        p.join()
    latency = result[LINK_SMALL]
    moved = comm.collective_bytes("all_reduce", 4 * LINK_LARGE, 2)
    return moved / max(result[LINK_LARGE] - latency, 1e-9), latency


def measured_link(remeasure: bool = False) -> tuple[float, float]:
    """The gloo link's (rate, latency), cached in common/mfu's cache file under this CPU's name."""
    key = f"{mfu.cpu_model()} | gloo link (bytes/s, s)"
    return tuple(mfu.cached_measurement(key, lambda: list(measure_link()), remeasure))
