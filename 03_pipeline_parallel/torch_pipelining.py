"""The same stages run by PyTorch's own pipeline runtime, torch.distributed.pipelining, for comparison.

We hand it the very modules our executor runs (sharing the parameters, so our optimizer, DP
all-reduce, clipping and checkpoints work unchanged) and pick the schedule class that matches ours:
    gpipe -> ScheduleGPipe, 1f1b -> Schedule1F1B, interleaved -> ScheduleInterleaved1F1B,
    zb-h1 -> ScheduleInterleavedZeroBubble (its zero-bubble schedule; with one stage per rank it is
    the ZB-H1 idea: backward split into input- and weight-gradient).
Its loss is ours: summed cross-entropy / global tokens, with scale_grads=False (by default it would
divide the gradients by the number of micro-batches, which our normalisation already accounts for).
Its messages do not go through common/comm.py, so its pp bytes are not counted, and it records no
timeline, so its bubble is not measured.

`TorchPipelineTrainer` gives train_pp.py's loop the same verbs as ours (pipeline_trainer.py): only
forward_backward differs, and torch's runtime tells nobody when a stage's gradients are final, so
each stage's data-parallel all-reduce starts after the whole schedule.
"""
import torch
import torch.nn as nn
from torch.distributed import pipelining as tpp

from common.model import Transformer

from . import pipeline_executor, pipeline_stages, pipeline_trainer

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zb-h1": "ScheduleInterleavedZeroBubble"}


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


class TorchPipeline:
    """torch.distributed.pipelining's runtime over this rank's stages; `model` and `stage_params` as in
    our PipelineExecutor, so PipelineTrainer can drive either."""

    def __init__(self, schedule: str, model, my_specs, n_stages: int, m: int, group, device, loss_fn):
        self.model = model
        self.stage_params = {s.index: pipeline_executor.stage_parameters(model, s) for s in my_specs}
        self.stages = [tpp.PipelineStage(ChunkModule(model, s), s.index, n_stages, device, group=group)
                       for s in my_specs]
        self.first = any(s.first for s in my_specs)
        self.last = any(s.last for s in my_specs)
        cls = getattr(tpp, TORCH_SCHEDULES[schedule])
        stages = self.stages if schedule in ("interleaved", "zb-h1") else self.stages[0]
        self.schedule = cls(stages, m, loss_fn=loss_fn, scale_grads=False)

    def run(self, x, y, on_stage_grads_ready=None) -> torch.Tensor:
        """One step on the whole local batch (torch splits it into micro-batches); returns the loss sum.
        on_stage_grads_ready(stage) is called for each stage once the schedule is over."""
        losses = []
        kwargs = {"target": y, "losses": losses} if self.last else {}
        self.schedule.step(*([x] if self.first else []), **kwargs)
        if on_stage_grads_ready:
            for stage in self.stage_params:
                on_stage_grads_ready(stage)
        return torch.stack(losses).sum().detach() if losses else torch.zeros((), device=x.device)


class TorchPipelineTrainer(pipeline_trainer.PipelineTrainer):
    """PipelineTrainer with a TorchPipeline in the executor's place, running torch's schedule object."""

    def __init__(self, runtime: TorchPipeline, optimizer, microbatches: int, dp_group, pp_group):
        super().__init__(runtime, runtime.schedule, optimizer, microbatches, dp_group, pp_group)

    def forward_backward(self, x, y, sync: bool = True) -> torch.Tensor:
        """x, y: (B/dp, S); torch cuts them into the m micro-batches itself."""
        return self.executor.run(x, y, on_stage_grads_ready=self.on_stage_grads_ready)
