"""The step protocol (common/step_protocol.py) for a pipeline: the verbs train_pp.py's loop calls.

    forward_backward(x, y)  this data-parallel rank's rows, cut into m micro-batches, run through the
                            schedule in ONE call (`executor.run(schedule, ...)`): every F, B (and W)
                            of the step, with the sends and receives between stages. As soon as one
                            of this rank's stages has run its last backward, that stage's gradients
                            are final: the trainer hands them to its optimizer (`grads_ready`), whose
                            data-parallel all-reduce starts in the background (chapter 01's
                            ReplicatedAdamW over the dp group) while the schedule goes on (cool-down)
    sync_gradients()        the optimizer waits for those all-reduces: every replica of a stage holds the sum
    clip_grad_norm(max)     each stage holds different parameters: squared norms add up over the pipeline
                            (`norm_groups`)
    step(), zero_grad(), set_lr(lr), memory()   the optimizer's, on this rank's stages

The optimizer is an object passed in (common/step_protocol.py): replicated AdamW here; chapter 04 passes
ZeRO (zero_3d.ShardedOptimizers) to the same trainer, whose `grads_ready` starts nothing (its gradients
are reduced once, after the schedule). The comparison with PyTorch, torch_pipelining.TorchPipelineTrainer,
implements the same verbs beside this class, with the same optimizer. Chapter 04 extends this class with
tensor parallelism (04_3d_combined/trainer_3d.py).
`step_stats` turns a step's timeline into what a pipeline step is about: its bubble and each stage's
activation peak.
"""
import math

import torch
import torch.distributed as dist

from common import activation_ledger
from common.data import shard_rows
from common.step_protocol import OptimizerVerbs
from common.timeline import busy_seconds


class PipelineTrainer(OptimizerVerbs):
    """One pipeline rank's stages, trained by the optimizer it is given.

    executor   a MeasuredExecutor holding this rank's stage model (measured_executor.py): it offers
               `model`, `stage_params` ({stage: its parameters}), `run` and, after a step,
               `peak_activation_bytes`
    schedule   every rank's action list (pipeline_schedules.build_schedule); the executor runs ours
    optimizer  the step verbs over the stage model's parameters (common/step_protocol.Optimizer): chapter
               01's ReplicatedAdamW over the ranks holding the same stages, each with its own rows, whose
               gradients it sums. The runs built on this one name that group from their layout
               (04_3d_combined/parallel_3d.py, `Layout.gradient_groups()`: dp, or dp × cp with CP)
    predicted  each stage's activation peak as common/activation_ledger.py predicts it (None: it does
               not apply), reported by memory() beside the measured peak
    """

    def __init__(self, executor, schedule, optimizer, microbatches: int, pp_group, predicted=None):
        self.executor, self.schedule, self.optimizer, self.m = executor, schedule, optimizer, microbatches
        self.model, self.pp_group = executor.model, pp_group
        self.norm_groups = [pp_group]           # the ranks holding different parameters: the pipeline's
        # The optimizer may sum each stage's gradients from inside the schedule (`grads_ready`), which
        # covers every parameter only if each one is in a stage.
        check_every_parameter_in_a_stage(self.model, executor.stage_params)
        self.peak_activation_bytes, self.predicted = None, predicted

    def forward_backward(self, x, y, sync: bool = True) -> torch.Tensor:
        """x, y: (B/dp, S) this replica's rows. All m micro-batches go through the schedule in this one
        call (so `sync` has nothing to defer). Returns this rank's share of the loss: the scaled sum
        over the micro-batches its last stage finished (0 on the other ranks)."""
        xs = [shard_rows(x, i, self.m) for i in range(self.m)]                   # m × (mb, S)
        ys = [shard_rows(y, i, self.m) for i in range(self.m)]
        self.optimizer.begin_step()             # (ZeRO 2, 3 on the grid: the full buffers; 3: the weights)
        loss = self.executor.run(self.schedule, xs, ys, on_stage_grads_ready=self.stage_grads_ready)
        self.peak_activation_bytes = self.executor.peak_activation_bytes
        return loss

    def stage_grads_ready(self, stage: int) -> None:
        """Called by the executor after `stage`'s last B (or W) of the step: its gradients are final, the
        optimizer's to sum (replicated: one flat buffer, one async all-reduce over the stage's replicas,
        2(N-1)/N of its gradient bytes)."""
        self.optimizer.grads_ready(self.executor.stage_params[stage])

    def sync_gradients(self) -> None:
        self.optimizer.sync_gradients()

    def clip_grad_norm(self, max_norm: float) -> float:
        return self.optimizer.clip_grad_norm(max_norm, self.norm_groups)

    def memory(self) -> dict:
        return {**self.optimizer.memory(), "peak_activation_bytes": self.peak_activation_bytes,
                "activation_bytes_predicted": self.predicted}


# --- what both pipeline trainers (ours and torch_pipelining's) do alike -------------------------------
def check_every_parameter_in_a_stage(model, stage_params: dict) -> None:
    in_stages = {id(p) for params in stage_params.values() for p in params}
    assert all(id(p) in in_stages for p in model.parameters() if p.requires_grad), "a parameter in no stage"


def predicted_peaks(cfg, args, plan, specs, mb_rows: int, tp: int = 1, sequence_parallel: bool = False,
                    cp: int = 1, gathered_kv: bool = False):
    """Each stage's predicted activation peak under `--recompute`, from the schedule's actions
    (common/activation_ledger.py); None where the ledger does not apply (bf16, MoE). `cp`: the ranks
    that split each sequence (chapter 06), `gathered_kv`: whether its attention all-gathers K/V."""
    if not activation_ledger.ledger_applies(cfg, args.dtype):
        return None
    return activation_ledger.pipeline_peaks(cfg, args.recompute, plan, specs, mb_rows, args.seq_len // cp, tp,
                                            sequence_parallel, cp, gathered_kv, recomputed=args.recompute_layers)


def step_stats(timeline, peak: int | None, pp_group, pp: int, device) -> dict:
    """Measured bubble fraction of this step over the pipeline, and each stage's activation peak.
    Both None where not measured (PyTorch's runtime records no timeline and counts no bytes)."""
    busy = first = last = 0.0
    evs = [e for e in timeline.step_events() if e["kind"] in ("F", "B", "W")]
    if evs:
        busy = busy_seconds(evs)                        # (two threads of a rank computing at once: counted once)
        first, last = min(e["start"] for e in evs), max(e["end"] for e in evs)
    mine = torch.tensor([busy, first, last, math.nan if peak is None else float(peak)], dtype=torch.float64,
                        device=device)
    every = [torch.zeros_like(mine) for _ in range(pp)]
    if pp > 1:
        dist.all_gather(every, mine, group=pp_group)     # four numbers per rank: bookkeeping, not counted
    else:
        every = [mine]
    span = max(t[2].item() for t in every) - min(t[1].item() for t in every)
    bubble = 1 - sum(t[0].item() for t in every) / (pp * span) if span > 0 else None
    peaks = [t[3].item() for t in every]
    return {"bubble_fraction": bubble,
            "peak_activation_bytes": None if any(map(math.isnan, peaks)) else [int(b) for b in peaks]}
