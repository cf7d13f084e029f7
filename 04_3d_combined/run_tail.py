"""What a run does around its step verbs, written once: train_3d.py's, and the runs the later chapters
build on it (chapter 05's train_4d.py, chapter 06's train_5d.py) reuse it as it is.

Each script writes its loop out, because the loop is the lesson: the batch, then forward_backward,
sync_gradients, clip_grad_norm, step, zero_grad. What comes before and after it is bookkeeping, the
same for every dimension, so it lives here:

    print_start(...)   rank 0: the configuration table, the ranks of the grid, its groups
    after_step(...)    the step's loss summed over the ranks and checked finite; its metrics row (bytes
                       by group, memory, the measured bubble, a later chapter's own numbers); the
                       validation loss every --val-every steps and at the last; the consolidated
                       checkpoint every --checkpoint-every steps
    finish()           the timeline file, the summary table, every rank's memory beside the formulas, a
                       text sample from the trained model; the process groups closed

A later chapter passes what it adds by name (its groups, its numbers, its cut of the validation rows,
its replicas), never a copy of this file.
"""
import torch.distributed as dist

from common import checkpoint
from common.distributed import shutdown
from common.training import global_sum, run_identity, should_save, stop_if_not_finite

from . import console_3d, parallel_3d, trainer_3d


class RunTail:
    """The bookkeeping of one run of the grid. What a later chapter adds, by keyword:

        groups           the groups whose bytes every row reports (`comm_bytes_<group>`): dp, tp, pp here
        counted_as       {group: the name its collectives count their bytes under}, where the two differ
                         (chapter 06: the gradient all-reduces, counted as "dp", run over dp × cp)
        chapter_metrics  functions () -> dict: the chapter's own numbers for the row (chapter 05: the
                         router's), taken in order before validation, which routes and attends too
        take             the chapter's cut of each validation batch's rows (chapter 06: my positions)
        replica_dims     the dimensions whose ranks hold the same tensors: coordinate 0 of each writes
                         the checkpoint, so every tensor is written once
    """

    def __init__(self, log, rt, args, cfg, layout, mesh, data, trainer, timeline, my_specs, loss_fn, act_shape, *,
                 groups=("dp", "tp", "pp"), counted_as=None, chapter_metrics=(), take=None, replica_dims=("dp",)):
        self.log, self.rt, self.args, self.cfg, self.layout, self.mesh = log, rt, args, cfg, layout, mesh
        self.data, self.trainer, self.timeline = data, trainer, timeline
        self.my_specs, self.loss_fn, self.act_shape = my_specs, loss_fn, act_shape
        self.groups, self.counted_as, self.replica_dims = groups, counted_as or {}, replica_dims
        self.chapter_metrics, self.take = chapter_metrics, take
        self.full_model = None                 # the consolidated weights, for the text sample at the end

    def print_start(self, title: str, launch_hint: str, start: int, config=None, columns=None) -> None:
        """The configuration table (a later chapter's rows added: `config`), the grid's ranks (its own
        columns added: `columns`, {title: function of a rank's row}) and groups; at world size 1, how to
        launch more ranks."""
        self.log.config_table(title, {**console_3d.config_rows(self.args, self.cfg, self.layout, self.rt, self.data,
                                                               start), **(config or {})})
        self.log.print(console_3d.rank_table(self.mesh, columns))
        self.log.print(console_3d.group_table(self.mesh))
        if self.rt.world_size == 1:
            self.log.print(f"world size 1: the single-device reference. More ranks: {launch_hint}")

    def after_step(self, step: int, local_loss, lr: float, tokens: int, seconds: float, grad_norm: float) -> None:
        """The step's loss and row; the validation loss, the checkpoint when their step comes. `local_loss`:
        forward_backward's share of this rank (only the last stage's ranks of tp index 0 hold one)."""
        args = self.args
        loss = global_sum(local_loss, dist.group.WORLD)         # the mean over the global batch's tokens
        stop_if_not_finite(step, loss, grad_norm, args)         # a clean stop at this step, on every rank
        # the step's bytes by group (before validation adds its sends), memory, the bubble (chapter 03)
        row = trainer_3d.step_metrics(self.trainer.memory(), self.timeline, self.mesh, self.layout, self.rt.device,
                                      self.groups, self.counted_as)
        row["memory_formula"] = self.trainer.memory_formula()     # beside param, grad and optim bytes
        for more in self.chapter_metrics:
            row.update(more())
        if (args.val_every and step % args.val_every == 0) or step == args.steps:
            with self.trainer.full_weights():               # (ZeRO-3: gathered for this forward, then freed)
                row["val_loss"] = trainer_3d.validation_loss(self.trainer, self.my_specs, self.data, step, args,
                                                             self.layout, self.mesh, self.loss_fn, self.act_shape,
                                                             self.rt.device, take=self.take)
            self.log.note(f"step {step}: validation loss {row['val_loss']:.4f}")
        self.log.log_step(step, loss, lr, tokens, seconds, grad_norm=grad_norm, **row)
        if should_save(args, step) or (step == args.steps and args.sample_tokens):
            # a collective: every TP group gathers its shards; one replica of each stage sends its tensors
            with self.trainer.full_weights():
                self.full_model, full_optim = parallel_3d.consolidated_state(self.trainer, self.mesh, self.layout,
                                                                             self.cfg, self.replica_dims)
            if self.rt.is_main and should_save(args, step):
                path = checkpoint.save(args.checkpoint_dir, step, self.full_model, full_optim, run_identity(args))
                self.log.note(f"checkpoint saved: {path}")

    def finish(self) -> list[dict]:
        """The timeline (a collective: every rank's events gathered on rank 0), the summary with the
        measured bubble beside the theory, a text sample from the consolidated weights; then the process
        groups closed. Returns the metrics rows."""
        if self.args.timeline:
            console_3d.write_timeline(self.args.timeline, self.timeline, self.rt, self.log, self.args, self.layout)
        self.log.finish(console_3d.bubble_row(self.log.history, self.args, self.layout))
        per_rank = [None] * self.rt.world_size                 # a collective: every rank's memory, on every rank
        dist.all_gather_object(per_rank, console_3d.memory_of(self.trainer, self.mesh))
        self.log.print(console_3d.memory_table(per_rank))
        console_3d.print_sample(self.log, self.rt, self.full_model, self.cfg, self.args)
        shutdown(self.rt)
        return self.log.history
