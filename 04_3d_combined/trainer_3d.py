"""The step protocol (common/step_protocol.py) for DP × TP × PP: chapter 03's pipeline trainer, plus TP.

Each verb of train_3d.py's loop is one call away from a chapter's collective:

    forward_backward(x, y)  chapter 03: the schedule runs every micro-batch (`executor.run`); TP talks
                            inside each layer (chapter 02's f and g); as soon as one of this rank's
                            stages has its last gradient, the optimizer is told (`grads_ready`: a
                            replicated one starts that stage's DP all-reduce, chapter 01)
    sync_gradients()        DP, the optimizer's: every gradient summed over the ranks holding the same
                            piece; and TP, this chapter's: the partial gradients of the tensors
                            replicated over the TP group summed (`sync_tp_gradients`: norm gains under
                            sequence parallelism, KV heads shared by several ranks), which the optimizer
                            runs where the whole gradient is on this rank
    clip_grad_norm(max)     the norm of the whole model's gradient: TP shards and pipeline stages hold
                            different parts (squares summed over `norm_groups`), a replicated tensor is
                            counted by one holder (common.step_protocol.counted_here), DP replicas not
                            summed at all
    step, zero_grad, set_lr, memory   the optimizer's, on this rank's piece

The optimizer is passed in, chosen once before the loop by `build_optimizer`: replicated AdamW
(replicated_3d.py: each stage's gradients all-reduced during the schedule) or, with --zero-stage 1, 2 or
3, chapter 01's ZeRO (zero_3d.py: the gradients reduced once, after the schedule), each over the groups
the layout names for each kind of gradient (`Layout.gradient_groups()`: dp). One trainer class for both.
A later chapter extends `Trainer3D` with its dimension (chapter 05: the router's statistics) and builds it
from the same `build_executor` and `build_optimizer`.
"""
from contextlib import contextmanager
from importlib import import_module

import torch

from common import comm
from common.data import shard_rows
from common.optim import build_adamw
from common.step_protocol import counted_here
from common.training import global_sum, load_optim_state_by_name

tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")     # chapter 02: TP gradients, loss
pipeline_validation = import_module("03_pipeline_parallel.pipeline_validation")  # chapter 03: forward-only pass
measured_executor = import_module("03_pipeline_parallel.measured_executor")  # chapter 03: runs a schedule, measured
pipeline_trainer = import_module("03_pipeline_parallel.pipeline_trainer")    # chapter 03: the pipeline's verbs
zero_3d = import_module("04_3d_combined.zero_3d")                            # this chapter: ZeRO on the grid
replicated_3d = import_module("04_3d_combined.replicated_3d")                # this chapter: AdamW on the grid
scatter_gather = import_module("04_3d_combined.scatter_gather")              # this chapter: --pp-sends


class Trainer3D(pipeline_trainer.PipelineTrainer):
    """One rank of the grid: its pipeline stage(s), TP-sharded, stepped by `optimizer` (replicated AdamW or
    ZeRO over the ranks holding the same piece: build_optimizer)."""

    def __init__(self, executor, schedule, named, optimizer, mesh, microbatches: int, predicted=None):
        super().__init__(executor, schedule, optimizer, microbatches, mesh.group("pp"), predicted)
        self.named, self.tp_group, self.mesh = named, mesh.group("tp"), mesh
        # The norm sums squares over the groups whose ranks hold different parts of the model.
        self.norm_groups = [self.tp_group, self.pp_group]

    def forward_backward(self, x, y, sync: bool = True) -> torch.Tensor:
        loss = super().forward_backward(x, y, sync)
        # The TP ranks of the last stage hold the same loss value: counted once, by tp rank 0.
        return loss if counted_here({"tp": self.mesh.size("tp")}, self.mesh.coords) else torch.zeros_like(loss)

    def sync_gradients(self) -> None:
        # TP, this chapter's: the sums of the tensors replicated over TP (each rank's gradient a partial
        # sum); DP, the optimizer's (replicated: wait for the per-stage all-reduces; ZeRO: its collectives
        # now), which runs the TP sums where the whole gradient is here. All are sums, in either order.
        # >>> exercise 04.grad_sync
        def tp_sums():                                      # TP: chapter 02's sums of the partial gradients
            tensor_parallel.sync_tp_gradients(self.model, self.tp_group)
        self.optimizer.sync_gradients(partial_sums=tp_sums)   # DP: the optimizer's, around them
        # <<< exercise 04.grad_sync

    def optim_state(self) -> dict:
        """AdamW's moments by reference name, of this rank's (TP-local) tensors: for the checkpoint (ZeRO:
        each kind's shards all-gathered over its group, a collective)."""
        return self.optimizer.optim_state()

    @contextmanager
    def full_weights(self):
        """A context in which the model's weights are whole on this rank: always with AdamW; ZeRO-3 gathers
        them for a forward outside the step (validation, a checkpoint), then frees them."""
        self.optimizer.gather()
        try:
            yield
        finally:
            self.optimizer.release()

    def memory_formula(self) -> dict:
        """Bytes this rank should hold between steps, by component (chapter 01's formulas): M, M, αM for
        AdamW on its piece; ZeRO's each kind's M over its group's N."""
        return self.optimizer.formula()


def local_optim_state(full_optim, mesh, layout, cfg):
    """A checkpoint's single-device AdamW state, cut to this rank's TP shards (None: no checkpoint)."""
    if full_optim is None:
        return None
    to_local = (lambda name, t: tensor_parallel.tp_to_local(name, t, mesh.coord("tp"), layout.tp, cfg.n_kv_heads)) \
        if layout.tp > 1 else (lambda name, t: t)
    return {n: {"step": s["step"], "exp_avg": to_local(n, s["exp_avg"]), "exp_avg_sq": to_local(n, s["exp_avg_sq"])}
            for n, s in full_optim.items()}


def build_adamw_for(named, args, local_optim=None):
    """Plain AdamW on this rank's piece, with a checkpoint's moments if resuming."""
    optimizer = build_adamw(named, args.lr, args.weight_decay)
    if local_optim is not None:
        load_optim_state_by_name(optimizer, named, local_optim)
    return optimizer


def build_optimizer(named, mesh, layout, args, cfg, full_optim=None, kind_of=lambda name: "dense"):
    """This rank's optimizer, chosen once: replicated AdamW on its piece, or ZeRO (--zero-stage 1-3) on each
    kind of state; either sums each kind (`kind_of(name)`: chapter 05 tells the experts apart) over the
    group the layout names for that kind. `full_optim`: a checkpoint's single-device AdamW state, cut here
    to this rank's TP shards."""
    local = local_optim_state(full_optim, mesh, layout, cfg)
    groups = layout.gradient_groups()                               # {"dense": "dp", ...}: the mesh's names
    by_kind = {kind: ([(n, p) for n, p in named if kind_of(n) == kind], group) for kind, group in groups.items()}
    if not args.zero_stage:
        return replicated_3d.ReplicatedOptimizer(named, by_kind, mesh, args.lr, args.weight_decay,
                                                 optimizer=build_adamw_for(named, args, local))
    optimizer = zero_3d.ShardedOptimizers(by_kind, mesh, args.zero_stage, args.lr, args.weight_decay)
    if local is not None:
        optimizer.load_optim_state(local)
    return optimizer


def build_executor(model, specs, mesh, args, loss_fn, act_shape, device, timeline,
                   executor_class=measured_executor.MeasuredExecutor, **more):
    """Chapter 03's executor for this rank's stages. Build it after the optimizer: ZeRO moves the
    parameters into flat buffers, and the executor notes where the parameters live (to leave them
    out of its activation bytes). `executor_class`, `more`: a later chapter's executor and its arguments
    (chapter 05's PairedExecutor and its twin groups)."""
    return executor_class(
        model, specs, mesh.coord("pp"), mesh.group_ranks["pp"], mesh.group("pp"), act_shape,   # (mb, S or S/tp, D)
        loss_fn=loss_fn, loss_scale=args.global_batch * args.seq_len, device=device,
        autocast_dtype=torch.bfloat16 if args.dtype == "bf16" else None, timeline=timeline,
        meter_activations=not args.no_activation_meter, wire=scatter_gather.wire_of(args.pp_sends, mesh.group("tp")),
        **more)


def build_trainer(model, specs, plan, mesh, layout, args, cfg, loss_fn, act_shape, device, timeline,
                  full_optim=None) -> Trainer3D:
    """This rank's trainer, its optimizer chosen once (build_optimizer): AdamW on its piece, or ZeRO
    (--zero-stage 1-3) over the group its layout names. `full_optim`: a checkpoint's single-device AdamW
    state, cut here to this rank's TP shards."""
    named = list(model.named_parameters())
    optimizer = build_optimizer(named, mesh, layout, args, cfg, full_optim)
    executor = build_executor(model, specs, mesh, args, loss_fn, act_shape, device, timeline)
    predicted = pipeline_trainer.predicted_peaks(cfg, args, plan, specs, act_shape[0], layout.tp,
                                                 args.sequence_parallel)                 # each stage's peak
    return Trainer3D(executor, plan, named, optimizer, mesh, layout.microbatches, predicted)


def step_metrics(memory: dict, timeline, mesh, layout, device, groups: tuple, counted_as: dict | None = None) -> dict:
    """The step's bytes by group (common.comm's counter: `comm_bytes_<group>`, read under the counter's name
    `counted_as[group]` where it differs), AdamW's bytes, and chapter 03's measured bubble and per-stage
    activation peaks (an all-gather of four numbers over the pipeline group)."""
    counted_as = counted_as or {}
    return {"comm_bytes": comm.COUNTER.total(),
            **{f"comm_bytes_{g}": comm.COUNTER.total(counted_as.get(g, g)) for g in groups},
            **{k: memory[k] for k in ("param_bytes", "grad_bytes", "optim_bytes")},
            "activation_bytes_predicted": memory["activation_bytes_predicted"],
            **({"live_peak_bytes": memory["live_peak_bytes"]} if "live_peak_bytes" in memory else {}),
            **pipeline_trainer.step_stats(timeline, memory["peak_activation_bytes"], mesh.group("pp"), layout.pp, device)}


def validation_loss(trainer, my_specs, data, step: int, args, layout, mesh, loss_fn, act_shape, device,
                    take=None) -> float:
    """Mean cross-entropy of `--val-batches` held-out global batches: a forward-only pass of the pipeline
    (chapter 03), each data-parallel rank on its rows; the TP ranks of the last stage count it once.
    `take(t)`: a later chapter's cut of those rows (chapter 06: this rank's positions)."""
    m, dp_rank = layout.microbatches, mesh.coord("dp")
    total = torch.zeros((), device=device)
    for i in range(args.val_batches):
        x, y = data.global_batch(step * 1000 + i, args.global_batch, split="valid")
        x, y = shard_rows(x, dp_rank, layout.dp), shard_rows(y, dp_rank, layout.dp)
        if take is not None:
            x, y = take(x), take(y)
        x, y = x.to(device), y.to(device)
        total += pipeline_validation.forward_only_loss_sum(
            trainer.model, my_specs, mesh.coord("pp"), mesh.group_ranks["pp"], mesh.group("pp"),
            [shard_rows(x, k, m) for k in range(m)], [shard_rows(y, k, m) for k in range(m)], loss_fn, act_shape, device,
            rank_of=trainer.executor.rank_of, wire=trainer.executor.wire)   # where each stage lives; how sent
    mine = total if counted_here({"tp": layout.tp}, mesh.coords) else torch.zeros_like(total)
    return global_sum(mine, torch.distributed.group.WORLD) / (args.global_batch * args.seq_len * args.val_batches)
