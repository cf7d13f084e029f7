"""ZeRO stage 3 by hand: the parameters are sharded at rest too, and gathered one unit at a time.

After stages 1 and 2 (zero_sharding.py) every rank still holds all M bytes of parameters. Stage 3
keeps only rank i's chunk of each unit (embedding, each block, final norm + head) and rebuilds a
unit's full weights just before they are needed, then drops them:

  forward of unit u   all-gather u's weights ((N-1)/N of its bytes in and out), run it, free them.
                      Meanwhile the all-gather of unit u+1 is already in flight (prefetch), so the
                      network works while the CPU/GPU computes.
  backward of unit u  autograd needs the weights again (dL/dx = dL/dy·Wᵀ): all-gather them again,
                      prefetching u-1's; as soon as u's weight gradients exist, reduce-scatter them
                      (each rank keeps the sum of its chunk) and free the full gradients.
  step                AdamW on the local shard only: no collective at all.

  Per rank: (1+1+α)M/N at rest, plus the gathered weights of about two units at a time.
  Bytes per step: 2·(N-1)/N·M (two all-gathers) + (N-1)/N·M (reduce-scatter) = 1.5× plain DP.

The trick that frees the weights between forward and backward: autograd *saves* the weight of every
matmul for the backward pass, which would keep every gathered unit alive until backward — the whole
model again. `torch.autograd.graph.saved_tensors_hooks` lets us replace each saved tensor that lives
in a gathered buffer by a small note ("unit u, this shape/stride/offset") and rebuild it from a fresh
all-gather when backward asks for it. (FSDP does the same with storage resizing and its own hooks.)

Recomputation (--recompute) reruns a block's forward in backward, where its unit holds no weights:
common/recompute.py enters `_weights_again` around the rerun, which gathers them again first (FSDP
gathers them again too).

In a group of one (world size 1) each shard is its whole unit: nothing is gathered, noted or scattered,
and the gradients add straight into the shard's: the step does the plain loop's work (`make overhead`
compares the two).
"""
from contextlib import contextmanager

import torch

from common import comm, recompute
from common.optim import build_adamw, clip_by_global_norm, optim_bytes, set_lr

from . import zero_accounting, zero_sharding
from .dp_trainer import ForwardBackward
from .flat_buffers import FlatLayout


class _GatherParams(torch.autograd.Function):
    """Forward: shard -> the unit's full weights (all-gather). Backward: their gradients -> the
    shard's gradient (reduce-scatter). The gradient of an all-gather is a reduce-scatter."""

    @staticmethod
    def forward(ctx, zero, u, shard):
        ctx.zero, ctx.u = zero, u
        return tuple(zero.units[u].split(zero.gathered(u)))       # views of the (padded,) buffer

    @staticmethod
    def backward(ctx, *grads):
        ctx.zero.reduce_scatter_grads(ctx.u, grads)
        return None, None, None         # the shard's gradient is accumulated by hand (async)


class _Saved:
    """What autograd keeps instead of a gathered weight: where it lives, not its bytes."""
    __slots__ = ("u", "size", "stride", "offset")

    def __init__(self, u, t):
        self.u, self.size, self.stride, self.offset = u, t.size(), t.stride(), t.storage_offset()


class ZeroStage3(ForwardBackward):
    """ZeRO stage 3 over a model whose units are zero_sharding.model_units(model), with every verb of the
    step protocol (train_zero.py). `prefetch`: start the next unit's all-gather before this one runs.
    Per unit, stage 3 is its own optimizer: the shards AdamW steps are the ones its forward gathers, so it
    builds them (and their AdamW) itself rather than being handed an optimizer; under a pipeline, where the
    weights are gathered once per step, it is an optimizer like the others (zero_sharding.ZeroOptimizer)."""

    def __init__(self, model, units, group, lr: float, weight_decay: float, tokens_per_step: int,
                 bf16: bool = False, prefetch: bool = True, name: str = "dp"):
        super().__init__(None, tokens_per_step, bf16)            # the optimizer: built below, on the shards
        self.model, self.group, self.prefetch, self.comm_name = model, group, prefetch, name
        world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        self.alone = world == 1            # a group of one: each shard IS its whole unit (see _issue_gather)
        self.units, self.shards, self.shard_grads, self.slots, pieces = [], [], [], [], []
        for _, named in units:
            unit = FlatLayout([p for _, p in named], world, rank, names=[n for n, _ in named])
            flat = unit.flatten([p.detach() for _, p in named])             # (padded,) once, at start
            shard = torch.nn.Parameter(flat[unit.lo:unit.hi].clone())         # (padded/N,) kept at rest
            shard_grad = torch.zeros_like(shard)                              # (padded/N,)
            pieces += zero_sharding.shard_pieces(unit, shard.data, shard_grad)
            self.units.append(unit)
            self.shards.append(shard)
            self.shard_grads.append(shard_grad)
            self.slots.append([_slot(model, n) for n, _ in named])
            for module, attr in self.slots[-1]:           # the full parameters leave the model
                del module._parameters[attr]
                setattr(module, attr, None)
        self.pieces = pieces
        self.optimizer = build_adamw(pieces, lr, weight_decay)
        n = len(self.units)
        self._full = [None] * n            # gathered (padded,) buffers alive now, by unit
        self._work = [None] * n            # in-flight all-gathers
        self._by_ptr = {}                  # storage address of a gathered buffer -> unit
        self._needs_backward = [False] * n  # did autograd save any of its weights?
        self.reduce_scatter = zero_sharding.GradientReduceScatter(self.units, self.shard_grads, group, name)
        self.alive_bytes = self.peak_param_bytes = 0

    # --- gathering and freeing --------------------------------------------------------------------
    def _issue_gather(self, u: int) -> None:
        if u < 0 or u >= len(self.units) or self._full[u] is not None:
            return
        if self.alone:                     # nothing to gather: use the shard itself (no copy, no bytes
            self._full[u] = self.shards[u].detach()       # gathered; autograd saves its views as usual)
            return
        unit = self.units[u]
        full = torch.empty(unit.padded, dtype=self.shards[u].dtype, device=self.shards[u].device)
        self._work[u] = comm.all_gather_into(full, self.shards[u].detach(), group=self.group,
                                             name=self.comm_name, async_op=True)
        self._full[u] = full
        self._by_ptr[full.untyped_storage().data_ptr()] = u
        self.alive_bytes += full.numel() * full.element_size()
        self.peak_param_bytes = max(self.peak_param_bytes, self.alive_bytes)

    def gathered(self, u: int) -> torch.Tensor:
        """Unit u's full (padded,) weights: issue the all-gather unless prefetched, and wait for it."""
        self._issue_gather(u)
        if self._work[u] is not None:
            self._work[u].wait()
            self._work[u] = None
        return self._full[u]

    def _free(self, u: int) -> None:
        """Drop our reference; the buffer dies when autograd holds none (it holds only _Saved notes)."""
        full, self._full[u] = self._full[u], None
        if full is not None and self._by_ptr.pop(full.untyped_storage().data_ptr(), None) is not None:
            self.alive_bytes -= full.numel() * full.element_size()

    # --- forward ------------------------------------------------------------------------------------
    def forward(self, tokens):
        """The model's forward, unit by unit, each unit's weights gathered just in time (`run`)."""
        model = self.model
        h = self.run(0, model.embed, tokens)                                    # (B, S) -> (B, S, D)
        for i, layer in enumerate(model.layers):
            h = self.run(1 + i, layer, h, model.rope_cos, model.rope_sin)       # (B, S, D)
        return self.run(1 + len(model.layers), model.head, h)                  # (B, S, V)

    def run(self, u: int, fn, *args):
        """Forward of unit u: gather its weights, prefetch u+1's, run `fn`, free the weights."""
        weights = _GatherParams.apply(self, u, self.shards[u])
        if self.prefetch:
            self._issue_gather(u + 1)          # async: travels while unit u computes
        for (module, attr), w in zip(self.slots[u], weights):
            setattr(module, attr, w)
        # a recomputation of this unit's forward (--recompute) runs in backward, where the unit holds no
        # weights: it gathers them again first (`_weights_again`)
        with recompute.around_recomputation(lambda: self._weights_again(u)):
            if self.alone:                     # a group of one: nothing gathered, so nothing to note (the hooks'
                out = fn(*args)                # Python call per saved tensor would be their only effect)
            else:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    out = fn(*args)
        for module, attr in self.slots[u]:
            setattr(module, attr, None)
        self._free(u)
        return out

    def _pack(self, t: torch.Tensor):
        u = self._by_ptr.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        if u is None:
            return t                            # an activation: autograd keeps it as usual
        self._needs_backward[u] = True
        return _Saved(u, t)

    # --- backward -----------------------------------------------------------------------------------
    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        u = saved.u
        prefetching = self._full[u] is None
        full = self.gathered(u)                 # gather again (or collect the prefetch)
        if prefetching and self.prefetch:
            self._prefetch_previous(u)
        return full.as_strided(saved.size, saved.stride, saved.offset)

    def _prefetch_previous(self, u: int) -> None:
        """Start gathering the unit whose backward comes after unit u's and needs its weights: the nearest
        earlier one that noted a saved weight or reruns its forward (a recomputed block)."""
        self._issue_gather(max((v for v in range(u) if self._needs_backward[v] or self._reruns(v)), default=-1))

    def _reruns(self, u: int) -> bool:
        """Does unit u rerun its forward in backward (a block under --recompute)?"""
        layers = self.model.layers
        return 1 <= u <= len(layers) and layers[u - 1].recompute_mode != "none"

    @contextmanager
    def _weights_again(self, u: int):
        """Around a recomputation of unit u in backward: its weights gathered again (and the previous
        unit's prefetched, its backward comes next), in the module for the rerun forward to read. They need
        no path to the shard: the rerun only rebuilds saved tensors, the forward's graph carries the
        gradients. They require grad, as in the forward, so the rerun saves what the forward saved."""
        full = self.gathered(u)
        if self.prefetch:
            self._prefetch_previous(u)
        for (module, attr), w in zip(self.slots[u], self.units[u].split(full)):
            setattr(module, attr, w.detach().requires_grad_())
        try:
            yield
        finally:
            for module, attr in self.slots[u]:
                setattr(module, attr, None)

    def reduce_scatter_grads(self, u: int, grads) -> None:
        """Unit u's weight gradients are complete: reduce-scatter them and free the full ones."""
        unit = self.units[u]
        if self.alone:                          # a group of one: add into the shard's gradient in place
            for view, g in zip(unit.split(self.shard_grads[u]), grads):
                if g is not None:
                    view.add_(g)
            self._free(u)
            return
        full = unit.flatten([g if g is not None else torch.zeros(s, device=self.shards[u].device)
                             for g, s in zip(grads, unit.shapes)])
        self._free(u)                           # its backward is done: no more unpacks of unit u
        self.reduce_scatter.launch(u, full)     # (padded,) -> my (padded/N,) shard

    def sync_gradients(self) -> None:
        """Wait for the reduce-scatters that backward started, unit by unit (my shard of each sum)."""
        self.reduce_scatter.wait()
        for u in range(len(self.units)):        # nothing may stay gathered between steps
            if self._work[u] is not None:
                self._work[u].wait()
                self._work[u] = None
            self._free(u)
        self._needs_backward = [False] * len(self.units)

    # --- the update (the same verbs as zero_sharding.ZeroOptimizer) ---------------------------------
    def clip_grad_norm(self, max_norm: float) -> float:
        grads = [p.grad for _, p in self.pieces]
        return clip_by_global_norm(grads, max_norm, groups=(self.group,))

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def step(self) -> None:
        self.optimizer.step()                   # on the shards; the next forward gathers them

    def zero_grad(self) -> None:
        for g in self.shard_grads:
            g.zero_()

    def memory(self) -> dict:
        """Bytes at rest (shards), and the most gathered at once since the last call (one step)."""
        chunk = sum(s.numel() * s.element_size() for s in self.shards)
        peak, self.peak_param_bytes = self.peak_param_bytes, self.alive_bytes      # the peak is per step
        return {"param_bytes": chunk, "grad_bytes": chunk, "optim_bytes": optim_bytes(self.optimizer),
                "peak_param_bytes": peak}

    def full_state(self):
        """(model state, AdamW state by name): the single-device checkpoint, on every rank."""
        model = {}
        for u, unit in enumerate(self.units):
            flat = torch.empty(unit.padded, device=self.shards[u].device)      # (padded,)
            comm.all_gather_into(flat, self.shards[u].detach(), group=self.group, name=self.comm_name)
            model.update({n: t.clone() for n, t in zip(unit.names, unit.split(flat.cpu()))})
        out = zero_accounting.gather_optim_state(self.units, self.pieces, self.optimizer, self.group, self.comm_name)
        return model, out

    def load_optim_state(self, states: dict) -> None:
        """Resume: AdamW's saved full moments (by name), each piece takes its slice."""
        zero_accounting.load_optim_pieces(self.units, self.pieces, self.optimizer, states)


def _slot(model, name: str):
    """(module, attribute) of a dotted parameter name."""
    *path, attr = name.split(".")
    module = model
    for part in path:
        module = getattr(module, part)
    return module, attr
