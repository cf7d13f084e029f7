"""The step protocol (common/step_protocol.py) for DP × TP × PP (× EP): chapter 03's pipeline trainer,
plus TP, plus chapter 05's experts.

Each verb of train_3d.py's loop is one call away from a chapter's collective:

    forward_backward(x, y)  chapter 03: the schedule runs every micro-batch (`executor.run`); TP talks
                            inside each layer (chapter 02's f and g), EP inside each MoE layer (chapter
                            05's all-to-alls); as soon as one of this rank's stages has its last
                            gradient, its DP all-reduces start (chapter 01): dense parameters over the
                            DP group, experts over the EDP group (the DP ranks holding the same experts)
    sync_gradients()        DP: wait for those all-reduces; then TP: sum the partial gradients of the
                            tensors replicated over the TP group (`sync_tp_gradients`: norm gains under
                            sequence parallelism, KV heads shared by several ranks)
    clip_grad_norm(max)     the norm of the whole model's gradient: TP shards, pipeline stages and EP
                            ranks' experts hold different parts (squares summed over the three groups),
                            a replicated tensor is counted by one holder (`counted_here`), DP replicas
                            not summed at all
    step()                  the router statistics summed over every rank (bias balancing), then AdamW
    zero_grad, set_lr, memory   AdamW on this rank's piece

The MoE auxiliary losses need nothing from the pipeline: each MoE layer adds its balancing terms to
the backward of its own output (chapter 05's AddRouterLoss), so their gradient starts on the stage
that computed them, inside the same B (or W) as the micro-batch's other gradients.

With --zero-stage 1, `Zero1Trainer3D`: the same verbs, with chapter 01's ZeRO-1 over the DP group as
the optimizer. `build_trainer` chooses, once, before the loop.
"""
from importlib import import_module

import torch

from common.moe_args import routing_options
from common.optim import build_adamw, clip_by_global_norm
from common.step_protocol import counted_here, replicas
from common.training import load_optim_state_by_name, optim_state_by_name

data_parallel = import_module("01_data_parallel.data_parallel")           # chapter 01: async all-reduce
zero_sharding = import_module("01_data_parallel.zero_sharding")           # chapter 01: ZeRO-1
tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")     # chapter 02: TP gradients, loss
measured_executor = import_module("03_pipeline_parallel.measured_executor")  # chapter 03: runs a schedule
pipeline_trainer = import_module("03_pipeline_parallel.pipeline_trainer")    # chapter 03: the pipeline's verbs
expert_parallel = import_module("05_moe_expert_parallel.expert_parallel")    # chapter 05: which are experts
router_statistics = import_module("05_moe_expert_parallel.router_statistics")  # chapter 05: summed over the grid


class Trainer3D(pipeline_trainer.PipelineTrainer):
    """One rank of the grid: its pipeline stage(s), TP-sharded, its experts, replicated over DP; AdamW."""

    def __init__(self, executor, schedule, named, optimizer, mesh, microbatches: int, router):
        super().__init__(executor, schedule, optimizer, microbatches, mesh.group("dp"), mesh.group("pp"))
        self.named, self.tp_group, self.tp_rank = named, mesh.group("tp"), mesh.coord("tp")
        self.coords = mesh.coords                               # this rank's place on the grid, for counted_here
        self.ep_group, self.ep_rank = mesh.group("ep"), mesh.coord("ep")
        self.experts = {id(p) for n, p in named if expert_parallel.is_expert_param(n)}     # (none if dense)
        self.expert_sync = data_parallel.AsyncGradAllReduce(mesh.group("edp"))
        self.router = router                   # router_statistics.RouterStatistics of this rank's MoE layers

    def _all_reduce_stage(self, stage: int) -> None:
        """A stage's gradients are final: dense ones are summed over all its DP replicas (each saw its own
        rows), an expert's over the DP ranks holding that expert (each saw its EP group's rows)."""
        params = self.executor.stage_params[stage]
        self.dp_sync.launch([p for p in params if id(p) not in self.experts])
        experts = [p for p in params if id(p) in self.experts]
        if experts:
            self.expert_sync.launch(experts)

    def forward_backward(self, x, y, sync: bool = True) -> torch.Tensor:
        self.router.reset()                    # this step's routing only (validation routes too)
        loss = super().forward_backward(x, y, sync)
        # The TP ranks of the last stage hold the same loss value: it is this rank's share on tp rank 0 only.
        return loss if self.tp_rank == 0 else torch.zeros_like(loss)

    def sync_gradients(self) -> None:
        super().sync_gradients()                                       # DP: the per-stage all-reduces
        self.expert_sync.wait()                                        # EDP: the experts' all-reduces
        tensor_parallel.sync_tp_gradients(self.model, self.tp_group)   # TP: all are sums, in any order

    def clip_grad_norm(self, max_norm: float) -> float:
        # Each tensor counted once (common.step_protocol.counted_here): a tensor replicated over TP (a norm
        # gain, a shared KV head) or over EP (a dense weight) by its first holder; DP replicas never summed.
        grads = [p.grad for p in self.model.parameters()]
        counted = [p.grad for p in self.model.parameters() if counted_here(replicas(p), self.coords)]
        return clip_by_global_norm(counted, max_norm, groups=[self.tp_group, self.pp_group, self.ep_group],
                                   all_grads=grads)

    def step(self) -> None:
        self.router.sum_over_ranks()           # the step's expert loads, aux and z terms; router biases
        self.optimizer.step()

    def router_metrics(self) -> dict:
        """Chapter 05's aux_loss, z_loss, dropped_fraction, expert_load, max_over_mean_load ({} if dense)."""
        return self.router.metrics()

    def optim_state(self) -> dict:
        """AdamW's moments by reference name, of this rank's (TP-local) tensors: for the checkpoint."""
        return optim_state_by_name(self.optimizer, self.named)


class Zero1Trainer3D(Trainer3D):
    """--zero-stage 1: each DP replica keeps the AdamW moments of 1/dp of its piece (chapter 01's
    ZeroOptimizer). Nothing starts during the schedule: the gradients are all-reduced after it."""

    def __init__(self, executor, schedule, named, optimizer, mesh, microbatches: int, router):
        super().__init__(executor, schedule, named, optimizer, mesh, microbatches, router)
        self.on_stage_grads_ready = None

    def sync_gradients(self) -> None:
        self.optimizer.sync_gradients()                                # DP: all-reduce every flat unit
        tensor_parallel.sync_tp_gradients(self.model, self.tp_group)

    def clip_grad_norm(self, max_norm: float) -> float:
        # squares of my DP shard, summed over the DP group (inside), then over TP and PP
        return self.optimizer.clip_grad_norm(max_norm, groups=(self.tp_group, self.pp_group), coords=self.coords)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def set_lr(self, lr: float) -> None:
        self.optimizer.set_lr(lr)

    def memory(self) -> dict:
        return {**self.optimizer.memory(), "peak_activation_bytes": self.peak_activation_bytes}

    def optim_state(self) -> dict:
        """The full (TP-local) moments: each unit's shards all-gathered over DP (a collective)."""
        opt = self.optimizer
        return zero_sharding.gather_optim_state(opt.units, opt.pieces, opt.optimizer, opt.group)


def build_trainer(model, specs, plan, mesh, args, cfg, loss_fn, act_shape, device, timeline,
                  full_optim=None) -> Trainer3D:
    """This rank's trainer, its optimizer chosen once: AdamW on its piece, or ZeRO-1 over the DP group.
    `full_optim`: a checkpoint's single-device AdamW state, cut here to this rank's TP shards.
    The optimizer comes before the executor: ZeRO moves the parameters into flat buffers, and the
    executor notes where the parameters live (to leave them out of its activation bytes)."""
    named = list(model.named_parameters())
    to_local = (lambda name, t: tensor_parallel.tp_to_local(name, t, mesh.coord("tp"), args.tp, cfg.n_kv_heads)) \
        if args.tp > 1 else (lambda name, t: t)
    local = None if full_optim is None else {
        n: {"step": s["step"], "exp_avg": to_local(n, s["exp_avg"]), "exp_avg_sq": to_local(n, s["exp_avg_sq"])}
        for n, s in full_optim.items()}
    if args.zero_stage == 1:
        optimizer = zero_sharding.ZeroOptimizer(named, mesh.group("dp"), args.lr, args.weight_decay, stage=1)
        if local is not None:
            zero_sharding.load_optim_pieces(optimizer.units, optimizer.pieces, optimizer.optimizer, local)
        trainer_class = Zero1Trainer3D
    else:
        optimizer = build_adamw(named, args.lr, args.weight_decay)
        if local is not None:
            load_optim_state_by_name(optimizer, named, local)
        trainer_class = Trainer3D
    executor = measured_executor.MeasuredExecutor(
        model, specs, mesh.coord("pp"), mesh.group_ranks["pp"], mesh.group("pp"), act_shape,   # (mb, S or S/tp, D)
        loss_fn=loss_fn, loss_scale=args.global_batch * args.seq_len, device=device,
        autocast_dtype=torch.bfloat16 if args.dtype == "bf16" else None, timeline=timeline)
    # this rank's MoE layers under their global index (chapter 03's stages keep it), for chapter 05's
    # router statistics: every stage fills the rows of its own layers, tp rank 0 only (router_statistics.py)
    layers = {int(i): block.mlp for i, block in model.layers.items() if hasattr(block.mlp, "stats")}
    router = router_statistics.RouterStatistics(layers, cfg.n_layers, cfg.n_experts,
                                                routing_options(args, args.global_batch, args.seq_len),
                                                args.router_bias_rate, device,
                                                counted=counted_here({"tp": args.tp}, mesh.coords))
    return trainer_class(executor, plan, named, optimizer, mesh, args.microbatches, router)
