"""Published training runs, as the planner spells them: the flags that plan each one's cluster and batch,
the layout it ran, and what its authors measured (the targets check_layouts.py compares against).

A name works as `--explain NAME` in choose_layout.py: the planner then plans that run's cluster and batch
and explains the published layout in it. MFU is the authors' own figure (model FLOPs over the datasheet
peak), compared with the planner's counted the way the authors count it (`mfu_as_published`); a step time
is in seconds; a memory is GiB per GPU at the peak of a step, as the authors' logs count it (the CUDA
caching allocator's most reserved bytes: what the tensors took plus the allocator's slack), against the
planner's total for its fullest rank.
"""
from dataclasses import dataclass, field

from common.mfu import flops_per_token


@dataclass(frozen=True)
class Published:
    name: str
    argv: tuple                   # choose_layout.py's flags for its cluster and batch
    layout: dict = field(hash=False)   # the published degrees and levers (the fields of a planner row)
    measured: dict = field(hash=False)  # {"mfu": 0.41}, {"step_time_s": 13.75} or {"memory_gib": 82.4}
    source: str = ""
    # how the authors count attention's FLOPs in their MFU: its causal half, as the course does (common/mfu),
    # or its whole square (PaLM's definition, Chowdhery et al. 2022, Appendix B: 6N + 12·L·H·Q·T per token)
    mfu_attention: str = "causal"
    schedules: tuple = ()         # the pipeline schedules its framework ran (none named: every one the planner has)
    framework: str = ""           # the framework that ran it: "torchtitan" (its own code's memory is modelled:
                                  # torchtitan_memory.py), "llama3" (Meta's: its memory known by what it ran)
    # the levers its source says it ran with beyond `layout` (the 8K Llama 3 runs: no activation checkpointing):
    # the form known to fit on its GPUs, the yardstick of what its framework fits (check_published.known_to_fit)
    ran: dict = field(default_factory=dict, hash=False)


def _llama(world: int, seq: int, batch: int) -> tuple:
    """Llama 3's cluster and batch, every layout with cp > 1 planned with its framework's context parallelism:
    K and V all-gathered before attention, the all-gather exposed (§3.3.2; --cp-attention allgather)."""
    return ("--model", "llama3-405b", "--world", str(world), "--device", "h100", "--dtype", "bf16",
            "--global-batch", str(batch), "--seq-len", str(seq), "--cp-attention", "allgather")


ONE_F_ONE_B = ("1f1b", "interleaved")      # Megatron-LM's schedules, and Llama 3's (its interleaved 1F1B)
# §3.3.2, after its pipeline's memory changes: "we could pre-train Llama 3 on sequences of 8K tokens without
# activation checkpointing"
NO_CHECKPOINTING = {"recompute": "none"}
RUNS = [
    # The Llama 3 Herd of Models, Table 4 (16M tokens per batch; FSDP shards the optimizer state and the
    # gradients: ZeRO-2 here; the 8K runs at TP 8 with sequence parallelism, interleaved 1F1B). Its MFU is
    # PaLM's ("MFU; Chowdhery et al."): attention counted as the whole square
    Published("llama3-405b-8k-8192gpu", _llama(8192, 8192, 2048),
              dict(dp=64, tp=8, pp=16, cp=1, zero_stage=2, sequence_parallel=True, schedule="interleaved"),
              {"mfu": 0.43}, "Llama 3 Herd of Models, Table 4: 8,192 H100, TP 8 × CP 1 × PP 16 × DP 64, 8K, "
              "43 % MFU; §3.3.2: 8K sequences without activation checkpointing", "square", ONE_F_ONE_B,
              framework="llama3", ran=NO_CHECKPOINTING),
    Published("llama3-405b-8k-16384gpu", _llama(16384, 8192, 2048),
              dict(dp=128, tp=8, pp=16, cp=1, zero_stage=2, sequence_parallel=True, schedule="interleaved"),
              {"mfu": 0.41}, "Llama 3 Herd of Models, Table 4: 16,384 H100, TP 8 × PP 16 × DP 128, 8K, 41 % MFU; "
              "§3.3.2: 8K sequences without activation checkpointing", "square", ONE_F_ONE_B,
              framework="llama3", ran=NO_CHECKPOINTING),
    Published("llama3-405b-131k", _llama(16384, 131072, 128),
              dict(dp=8, tp=8, pp=16, cp=16, zero_stage=2, sequence_parallel=True, schedule="interleaved",
                   cp_attention="allgather"),
              {"mfu": 0.38}, "Llama 3 Herd of Models, Table 4: 16,384 H100, TP 8 × CP 16 × PP 16 × DP 8, 131K, "
              "38 % MFU (whether it checkpointed activations is not said)", "square", ONE_F_ONE_B,
              framework="llama3"),
    # Korthikanti et al. 2022 (Reducing Activation Recomputation in Large Transformer Models), Table 4; Megatron-LM
    # of 2022 computed attention unfused (its scale-mask-softmax kernel, then dropout: --attention unfused), its
    # selective recomputation reruns that attention core, and its full recomputation the whole block's forward
    # (--full-recompute whole-block); between stages it sent 1/tp of an activation SP did not split and gathered
    # it over TP at the receiver (its scatter_gather_tensors_in_pipeline, on by default: --pp-sends scatter-gather)
    Published("gpt3-175b-selective", ("--model", "gpt3-175b", "--world", "64", "--device", "a100", "--dtype",
                                      "bf16", "--global-batch", "64", "--seq-len", "2048", "--attention", "unfused",
                                      "--full-recompute", "whole-block", "--pp-sends", "scatter-gather"),
              dict(dp=1, tp=8, pp=8, cp=1, sequence_parallel=True, recompute="selective", schedule="interleaved",
                   virtual_stages=3, microbatches=64),
              {"step_time_s": 13.75}, "Korthikanti et al. 2022: 64 A100, TP 8 × PP 8, 3 interleaved stages, SP + "
                                      "selective recomputation, 13.75 s per step (MFU 51.4 %)", schedules=ONE_F_ONE_B),
    Published("gpt3-175b-full", ("--model", "gpt3-175b", "--world", "64", "--device", "a100", "--dtype", "bf16",
                                 "--global-batch", "64", "--seq-len", "2048", "--attention", "unfused",
                                 "--full-recompute", "whole-block", "--pp-sends", "scatter-gather"),
              dict(dp=1, tp=8, pp=8, cp=1, sequence_parallel=False, recompute="full", recompute_layers=None,
                   schedule="interleaved", virtual_stages=3, microbatches=64),      # every block recomputed
              {"step_time_s": 18.13}, "Korthikanti et al. 2022: the same run with full recomputation, 18.13 s",
              schedules=ONE_F_ONE_B),
    # DeepSeek-V3 Technical Report §3.2 (H800 planned as H100: same FLOP/s, NVLink 400 GB/s instead of 900)
    Published("deepseek-v3", ("--model", "deepseek-v3", "--world", "2048", "--device", "h100", "--dtype", "bf16",
                              "--global-batch", "15360", "--seq-len", "4096"),
              dict(dp=128, tp=1, pp=16, cp=1, ep=64, zero_stage=1), {},
              "DeepSeek-V3 report §3.2: 2,048 H800, PP 16 × EP 64 × ZeRO-1 DP, no TP; batch 15,360 × 4K"),
    # torchtitan's docs/performance.md, Table 1 (1D parallelism: FSDP2 alone, ZeRO-3 over 8 ranks): bf16 weights
    # gathered one block at a time and freed after its forward, fp32 sharded master weights, gradients and AdamW;
    # 2 sequences of 8K per GPU in one micro-batch, selective recomputation. Its GPUs are H100 of 96 GB: the
    # planner's H100 holds 80 GiB, so only the memory itself is compared
    Published("torchtitan-llama3-8b", ("--model", "llama3-8b", "--world", "8", "--device", "h100", "--dtype", "bf16",
                                       "--global-batch", "16", "--seq-len", "8192"),
              dict(dp=8, tp=1, pp=1, cp=1, zero_stage=3, recompute="selective", microbatches=1), {"memory_gib": 82.4},
              "torchtitan docs/performance.md, Table 1 (1D Parallelism, FSDP): Llama 3.1 8B on 8 H100 (96 GB), local "
              "batch 2, global batch 16, seq len 8192, bf16, selective activation checkpointing: 82.4 GiB per GPU "
              "(max reserved) eager, 77.0 GiB with torch.compile", framework="torchtitan"),
]
BY_NAME = {r.name: r for r in RUNS}


def mfu_as_published(run: Published, row: dict, cfg, seq_len: int) -> float:
    """A planner row's MFU counted as `run`'s authors count theirs: the same step time, the model's FLOPs
    with attention's causal half (the row's own, common/mfu) or its whole square (PaLM's definition)."""
    if run.mfu_attention == "causal":
        return row["mfu"]
    return row["mfu"] * flops_per_token(cfg, seq_len, causal=False) / flops_per_token(cfg, seq_len)


def matches(row: dict, layout: dict) -> bool:
    return all(row.get(k) == v for k, v in layout.items())
