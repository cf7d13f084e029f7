"""The explained layout in the terms people run it: Megatron-LM's flags and torchtitan's parallelism settings.

    python 07_choosing_a_layout/choose_layout.py --explain gpt3-175b-selective     # beside the course's command

The course's levers and theirs, one to one where both have it:

    course           Megatron-LM (pretrain_gpt.py)                  torchtitan (train.py)
    tp, sp           --tensor-model-parallel-size, --sequence-      --parallelism.tensor_parallel_degree
                     parallel                                       (sequence parallel with it)
    tpo              --tp-comm-overlap                              --parallelism.enable_async_tensor_parallel
    pp, schedule, v  --pipeline-model-parallel-size, --num-layers-  --parallelism.pipeline_parallel_degree and
                     per-virtual-pipeline-stage (interleaved)       _schedule (1F1B, Interleaved1F1B,
                                                                    ZBVZeroBubble, DualPipeV)
    cp               --context-parallel-size                        --parallelism.context_parallel_degree
    cp attention     --cp-comm-type p2p (ring) | allgather          --parallelism.context_parallel_rotate_method
                                                                    alltoall (ring) | allgather
    ep               --expert-model-parallel-size                   --parallelism.expert_parallel_degree
    dp, ZeRO         the ranks left; ZeRO-1/2: --use-distributed-   ZeRO-0: data_parallel_replicate_degree;
                     optimizer; ZeRO-3: --use-torch-fsdp2           1-3: data_parallel_shard_degree (FSDP; ZeRO-1/2
                                                                    keep the weights: fsdp_reshard_after_forward
                                                                    never)
    recompute, K     --recompute-granularity selective|full,        --activation_checkpoint.mode
                     --recompute-method block --recompute-num-layers K
    m                --micro-batch-size (rows per micro-batch)      --parallelism.pipeline_parallel_microbatch_size
    --pp-sends       whole, no SP: --no-scatter-gather-tensors-in-  (no such setting: a stage's output is
                     pipeline (scatter-gather: its default)         sent as it is)

A lever one framework lacks is said, not invented (ZB-H1 in Megatron-LM; ZeRO-1 exactly in torchtitan).
"""
from importlib import import_module

published = import_module("07_choosing_a_layout.published")
scatter_gather = import_module("04_3d_combined.scatter_gather")    # chapter 04: what --pp-sends splits

TITAN_SCHEDULES = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zb-v": "ZBVZeroBubble",
                   "dualpipev": "DualPipeV", "zb-h1": None}
# chapter 06's CP attention: (Megatron-LM's --cp-comm-type, torchtitan's rotate method: its ring passes the
# K/V shards with all-to-alls)
CP_COMM = {"ring": ("p2p", "alltoall"), "allgather": ("allgather", "allgather")}


def cp_comm(r: dict) -> tuple[str, str]:
    """Row `r`'s CP attention as (Megatron-LM's --cp-comm-type, torchtitan's rotate method); a row written
    before cp_attention was a field is the ring's."""
    return CP_COMM[r.get("cp_attention", "ring")]


def megatron(r: dict, cfg, global_batch: int, seq_len: int, pp_sends: str = "whole") -> str:
    """Megatron-LM's flags for row `r` (pretrain_gpt.py), its stages sending as `pp_sends` says (--pp-sends)."""
    rows = global_batch // r["dp"] // r["microbatches"]
    flags = [f"--tensor-model-parallel-size {r['tp']}", f"--pipeline-model-parallel-size {r['pp']}"]
    if r["schedule"] == "interleaved" and r["virtual_stages"] > 1:
        flags.append(f"--num-layers-per-virtual-pipeline-stage {cfg.n_layers // (r['pp'] * r['virtual_stages'])}")
    flags += ["--sequence-parallel"] if r["sequence_parallel"] else []
    # without SP Megatron-LM sends 1/tp of an activation and gathers it (its default); the course sends it whole
    whole = pp_sends == "whole" and scatter_gather.splits(r["tp"], r["pp"], r["sequence_parallel"])
    flags += ["--no-scatter-gather-tensors-in-pipeline"] if whole else []
    flags += ["--tp-comm-overlap"] if r.get("tp_overlap") else []
    flags += [f"--context-parallel-size {r['cp']}", f"--cp-comm-type {cp_comm(r)[0]}"] if r["cp"] > 1 else []
    flags += [f"--expert-model-parallel-size {r['ep']}"] if r["ep"] > 1 else []
    flags += {0: [], 1: ["--use-distributed-optimizer"], 2: ["--use-distributed-optimizer"],
              3: ["--use-torch-fsdp2"]}[r["zero_stage"]]
    if r["recompute"] != "none":
        flags.append(f"--recompute-granularity {r['recompute']}")
    if r["recompute"] == "full":
        layers = r.get("recompute_layers")
        flags.append(f"--recompute-method block --recompute-num-layers {layers}" if layers else
                     "--recompute-method uniform --recompute-num-layers 1")
    flags += [f"--micro-batch-size {rows}", f"--global-batch-size {global_batch}", f"--seq-length {seq_len}"]
    missing = "" if r["pp"] == 1 or r["schedule"] in ("1f1b", "interleaved") else \
        f" (no flag runs {r['schedule']}: Megatron-LM's schedules are 1F1B and interleaved 1F1B)"
    return " ".join(flags) + missing


def torchtitan(r: dict, global_batch: int, seq_len: int) -> str:
    """torchtitan's settings for row `r`, as its command-line overrides."""
    rows = global_batch // r["dp"] // r["microbatches"]
    shard = r["zero_stage"] > 0
    flags = [f"--parallelism.data_parallel_replicate_degree {1 if shard else r['dp']}",
             f"--parallelism.data_parallel_shard_degree {r['dp'] if shard else 1}",
             f"--parallelism.tensor_parallel_degree {r['tp']}", f"--parallelism.pipeline_parallel_degree {r['pp']}",
             f"--parallelism.context_parallel_degree {r['cp']}"]
    flags += [f"--parallelism.context_parallel_rotate_method {cp_comm(r)[1]}"] if r["cp"] > 1 else []
    flags += ["--parallelism.enable_async_tensor_parallel"] if r.get("tp_overlap") else []
    flags += [f"--parallelism.expert_parallel_degree {r['ep']}"] if r["ep"] > 1 else []
    if r["zero_stage"] in (1, 2):
        flags.append("--parallelism.fsdp_reshard_after_forward never")
    if r["pp"] > 1:
        flags += [f"--parallelism.pipeline_parallel_schedule {TITAN_SCHEDULES[r['schedule']] or '(none: ZB-H1)'}",
                  f"--parallelism.pipeline_parallel_microbatch_size {rows}"]
    flags += [f"--activation_checkpoint.mode {r['recompute']}",
              f"--training.local_batch_size {global_batch // r['dp']}", f"--training.seq_len {seq_len}"]
    return " ".join(flags)


def explained(spec: dict, rows: list[dict], cfg, global_batch: int, seq_len: int, pp_sends: str = "whole") -> list[str]:
    """The lines for the layout --explain picked (the best-ranked row with its fields), or none."""
    wanted = published.BY_NAME[spec["name"]].layout if "name" in spec else spec
    found = [r for r in rows if published.matches(r, wanted)]
    if not found:
        return []
    return [f"  Megatron-LM: {megatron(found[0], cfg, global_batch, seq_len, pp_sends)}",
            f"  torchtitan: {torchtitan(found[0], global_batch, seq_len)}"]
