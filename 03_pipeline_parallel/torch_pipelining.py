"""The same stages run by PyTorch's own pipeline runtime, torch.distributed.pipelining, for comparison.

We hand it the very modules our executor runs (sharing the parameters, so our optimizer, DP
all-reduce, clipping and checkpoints work unchanged) and pick the schedule class that matches ours:
    gpipe -> ScheduleGPipe, 1f1b -> Schedule1F1B, interleaved -> ScheduleInterleaved1F1B,
    zb-h1 -> ScheduleInterleavedZeroBubble (its zero-bubble schedule; with one stage per rank it is
    the ZB-H1 idea: backward split into input- and weight-gradient), zb-v -> ScheduleZBVZeroBubble,
    dualpipev -> ScheduleDualPipeV (both place the 2p stages in a V, as ours: torch_order.py compares
    their action lists with ours, rank by rank).
Its loss is ours: summed cross-entropy / global tokens, with scale_grads=False (by default it would
divide the gradients by the number of micro-batches, which our normalisation already accounts for).
Its messages do not go through common/comm.py, so its pp bytes are not counted, and it records no
timeline, so its bubble is not measured.

`TorchPipelineTrainer` gives train_pp.py's loop the same verbs as ours, beside our PipelineTrainer
(pipeline_trainer.py) rather than inside it, stepping the same optimizer object (clipping, memory and the
all-reduce are its verbs). Only forward_backward differs: torch's runtime cuts the rows into micro-batches
itself, and tells nobody when a stage's gradients are final, so each stage is handed to the optimizer
(`grads_ready`: its data-parallel all-reduce) after the whole schedule.
"""
import torch
import torch.nn as nn
from torch.distributed import pipelining as tpp

from common.model import Transformer
from common.step_protocol import OptimizerVerbs

from . import pipeline_executor, pipeline_stages, pipeline_trainer

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zb-h1": "ScheduleInterleavedZeroBubble", "zb-v": "ScheduleZBVZeroBubble",
                   "dualpipev": "ScheduleDualPipeV"}       # our schedule's name -> torch's class (--impl torch)


class ChunkModule(nn.Module):
    """One stage as a module of its own (torch's PipelineStage wants one module per stage).
    It registers only this stage's pieces, which are the SAME objects as in the pruned model."""

    def __init__(self, model: Transformer, spec):
        super().__init__()
        self.spec = spec
        self.tok_emb = model.tok_emb if spec.first else None
        self.layers = pipeline_stages.SparseLayers({i: model.layers[i] for i in spec.layers})
        self.norm, self.lm_head = (model.norm, model.lm_head) if spec.last else (None, None)
        self.rope_cos, self.rope_sin = model.rope_cos, model.rope_sin      # plain attributes, not buffers

    def embed(self, tokens):
        return Transformer.embed(self, tokens)

    def head(self, h):
        return Transformer.head(self, h)

    def forward(self, x):
        return pipeline_stages.stage_forward(self, self.spec, x)


class TorchPipelineTrainer(OptimizerVerbs):
    """The step protocol with torch.distributed.pipelining running this rank's stages.

    schedule   the schedule's name (TORCH_SCHEDULES picks torch's class)
    model      the pruned stage model; my_specs its StageSpecs, n_stages the pipeline's p·v
    m          micro-batches per step; loss_fn(logits, y) -> this micro-batch's scaled loss sum
    optimizer  the same as ours: chapter 01's ReplicatedAdamW over the stage model's parameters, summing
               their gradients over the data-parallel group
    """

    def __init__(self, schedule: str, model, my_specs, n_stages: int, m: int, loss_fn, optimizer, pp_group,
                 device):
        self.model, self.optimizer, self.pp_group = model, optimizer, pp_group
        self.stage_params = {s.index: pipeline_executor.stage_parameters(model, s) for s in my_specs}
        pipeline_trainer.check_every_parameter_in_a_stage(model, self.stage_params)
        self.first, self.last = any(s.first for s in my_specs), any(s.last for s in my_specs)
        stages = [tpp.PipelineStage(ChunkModule(model, s), s.index, n_stages, device, group=pp_group)
                  for s in my_specs]
        cls = getattr(tpp, TORCH_SCHEDULES[schedule])
        multi = issubclass(cls, tpp.schedules.PipelineScheduleMulti)     # takes a list of stages, not one
        self.runtime = cls(stages if multi else stages[0], m, loss_fn=loss_fn,
                           scale_grads=False)

    def forward_backward(self, x, y, sync: bool = True) -> torch.Tensor:
        """x, y: (B/dp, S); torch cuts them into the m micro-batches itself. Returns the loss sum of
        the micro-batches this rank's last stage finished (0 elsewhere)."""
        losses = []
        self.runtime.step(*([x] if self.first else []), **({"target": y, "losses": losses} if self.last else {}))
        for params in self.stage_params.values():      # every stage's gradients are final only now
            self.optimizer.grads_ready(params)
        return torch.stack(losses).sum().detach() if losses else torch.zeros((), device=x.device)

    def sync_gradients(self) -> None:
        self.optimizer.sync_gradients()

    def clip_grad_norm(self, max_norm: float) -> float:
        return self.optimizer.clip_grad_norm(max_norm, [self.pp_group])     # stages: different parameters

    def memory(self) -> dict:
        return {**self.optimizer.memory(), "peak_activation_bytes": None,     # activations: not measured
                "activation_bytes_predicted": None}
