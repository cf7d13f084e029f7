"""Jobs for chapter 04's unit tests of two verbs of Trainer3D, each against the single-device model.

Every rank builds its piece of the grid exactly as train_3d.py does, and also the whole reference model,
which it runs on the whole global batch: the single-device gradients and norm it must reproduce. Each
rank compares only the tensors it holds (its stages, its TP shard), so no gathering is needed; the
result is a few numbers: the norms, the tensor furthest from one device's and by how much.

    sync_gradients_job(argv)   forward_backward, then sync_gradients: every local gradient is the slice
                               of the single-device gradient (DP summed, TP-replicated tensors summed)
    clip_norm_job(argv)        the single-device gradients put in by hand (so the check needs no other
                               verb), then clip_grad_norm(half the norm): the norm, and every gradient
                               scaled as on one device
"""
from importlib import import_module

from common.data import TextData, shard_rows
from common.distributed import init_distributed
from common.mesh import Mesh
from common.model import PRESETS, build_model, loss_sum
from common.optim import clip_by_global_norm
from common.timeline import Timeline

train_3d = import_module("04_3d_combined.train_3d")
parallel_3d = import_module("04_3d_combined.parallel_3d")
trainer_3d = import_module("04_3d_combined.trainer_3d")
tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")


def _trainer_and_reference(argv):
    """This rank's Trainer3D (its piece of the reference model), the step-1 batch, and the reference
    model after one forward/backward of that whole batch on this rank alone."""
    args = train_3d.parse_args(argv)
    cfg, rt = PRESETS[args.model], init_distributed("cpu")
    layout = parallel_3d.decide_layout(args, cfg, rt.world_size)
    specs, plan = parallel_3d.plan_pipeline(args, cfg, layout)
    mesh = Mesh(rt.rank, rt.world_size, **layout.grid())            # arange(world).view(dp, pp, tp)
    model, _ = parallel_3d.build_local_model(cfg, args, layout, specs, mesh, rt.device)
    tp_group = mesh.group("tp")
    loss_fn = (lambda logits, y: tensor_parallel.tp_loss_sum(logits, y, tp_group)) if layout.tp > 1 else loss_sum
    trainer = trainer_3d.build_trainer(model, specs, plan, mesh, layout, args, cfg, loss_fn,
                                       parallel_3d.act_shape(args, cfg, layout), rt.device, Timeline(rt.rank))
    x, y = TextData(args.data, args.seq_len, args.seed).global_batch(1, args.global_batch)   # (B, S)
    reference = build_model(cfg, args.seed)
    (loss_sum(reference(x), y) / y.numel()).backward()        # the mean over the global batch
    return trainer, mesh, layout, cfg, (x, y), reference


def _worst(trainer, mesh, layout, cfg, want: dict) -> dict:
    """The local gradient furthest from this rank's slice of `want` (full single-device tensors by name),
    relative to the full tensor's largest entry (a slice may be all zeros: the embedding rows of bytes
    the batch never holds)."""
    worst = {"name": None, "rel": 0.0}
    for name, p in trainer.named:
        ref = tensor_parallel.tp_to_local(name, want[name], mesh.coord("tp"), layout.tp, cfg.n_kv_heads)
        rel = ((p.grad - ref).abs().max() / want[name].abs().max()).item() if p.grad is not None else float("inf")
        if worst["name"] is None or rel > worst["rel"]:
            worst = {"name": name, "rel": rel}
    return worst


def sync_gradients_job(argv):
    trainer, mesh, layout, cfg, (x, y), reference = _trainer_and_reference(argv)
    dp_rank = mesh.coord("dp")
    trainer.forward_backward(shard_rows(x, dp_rank, layout.dp), shard_rows(y, dp_rank, layout.dp))
    trainer.sync_gradients()
    return _worst(trainer, mesh, layout, cfg, {n: p.grad for n, p in reference.named_parameters()})


def clip_norm_job(argv):
    trainer, mesh, layout, cfg, _, reference = _trainer_and_reference(argv)
    full = {n: p.grad for n, p in reference.named_parameters()}
    for name, p in trainer.named:             # this rank's slices, as a correct sync_gradients leaves them
        p.grad = tensor_parallel.tp_to_local(name, full[name], mesh.coord("tp"), layout.tp, cfg.n_kv_heads).clone()
    ref_norm = clip_by_global_norm(list(full.values()), 0.0)          # max_norm 0: measure only
    norm = trainer.clip_grad_norm(ref_norm / 2)                        # the verb under test: scales by ~1/2
    clip_by_global_norm(list(full.values()), ref_norm / 2)             # one device's clipping, the same
    return {"norm": norm, "ref_norm": ref_norm, **_worst(trainer, mesh, layout, cfg, full)}
