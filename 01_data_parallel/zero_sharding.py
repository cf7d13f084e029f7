"""ZeRO stages 1 and 2 by hand: shard the optimizer state (1), then the gradients too (2).

Plain data parallelism keeps on every one of N ranks a full copy of the parameters (M bytes), of the
gradients (M) and of AdamW's two moments (αM, α = 2 in fp32): M(1+1+α) per rank, N times over.
But after the gradient all-reduce every rank holds the same gradient and takes the same AdamW step:
the optimizer work and its state are replicated for nothing. ZeRO (Rajbhandari et al., 2020) gives
each rank 1/N of that work and of that state:

  stage 1  (P_os)      rank i keeps AdamW state only for its shard i and updates only shard i of the
                       parameters; the full gradient is still all-reduced (every rank needs only its
                       shard of it, but gets all of it); then the updated shards are all-gathered.
                       Per rank: 2M + αM/N.  Bytes per step: 2(N-1)/N·M (all-reduce) + (N-1)/N·M.
  stage 2  (P_os+g)    nobody needs the other ranks' gradient shards, so the all-reduce becomes a
                       reduce-scatter (half its volume), and each rank frees the full gradient as soon
                       as its shard has been reduced.  Per rank: M + (1+α)M/N.
                       Bytes per step: (N-1)/N·M (reduce-scatter) + (N-1)/N·M (all-gather) = plain DP.
  stage 3  (P_os+g+p)  see zero_stage3.py: the parameters are sharded at rest too.

When a step accumulates micro-batches (a pipeline, chapter 04), stage 2 has two forms: reduce-scatter
each micro-batch's gradient as it appears (`per_microbatch=True`, train_zero.py: m times the bytes), or
let the full gradients accumulate in flat buffers and reduce-scatter them once after the last backward,
then free them (`per_microbatch=False`, the pipeline form, as Megatron's distributed optimizer). In that
form stage 3 runs as FSDP does under a pipeline: the weights gathered once per step (`begin_step`), kept
for every micro-batch, freed after the reduce-scatter (04_3d_combined/zero_3d.py says what it costs).

How a shard is cut. The parameters are grouped into *units* (the embedding, each transformer block,
the final norm with the head). A unit's tensors are laid end to end in one flat buffer, padded with
zeros to a multiple of N, and rank i owns the i-th contiguous chunk (flat_buffers.FlatLayout). One
collective per unit moves the whole unit, instead of one small message per tensor.
AdamW decays by parameter *name* (matrices yes, norm gains no), and a chunk can straddle two tensors,
so the optimizer sees one *piece* per (tensor ∩ chunk), named after its tensor. AdamW is elementwise,
so updating the pieces gives exactly the slices of the single-device update.
"""
import torch
import torch.nn as nn

from common import comm
from common.optim import build_adamw, clip_by_global_norm, optim_bytes, set_lr, sum_of_squares
from common.step_protocol import counted_here, mark_replicated, replicas

from .dp_trainer import ForwardBackward
from .flat_buffers import FlatLayout, groups_by_size
from .zero_accounting import gather_optim_state, load_optim_pieces


UNIT_MB = 25.0      # a unit's size where the model gives none: each unit's buffers take one collective


def model_units(model) -> list[tuple[str, list]]:
    """The units of the Transformer: embedding, each block, final norm + head (forward order)."""
    units = [("embed", [("tok_emb." + n, p) for n, p in model.tok_emb.named_parameters()])]
    for i, layer in enumerate(model.layers):
        units.append((f"layers.{i}", [(f"layers.{i}.{n}", p) for n, p in layer.named_parameters()]))
    units.append(("head", [("norm.weight", model.norm.weight), ("lm_head.weight", model.lm_head.weight)]))
    return units


def shard_pieces(unit: FlatLayout, shard: torch.Tensor, shard_grad: torch.Tensor) -> list:
    """nn.Parameters that *alias* slices of this rank's shard (AdamW updates the shard in place),
    each named after its tensor so weight decay is chosen exactly as on one device."""
    out = []
    for name, a, b, _, _ in unit.pieces():
        piece = nn.Parameter(shard[a:b], requires_grad=True)   # shares storage with `shard`
        piece.grad = shard_grad[a:b]                          # a view as well: no copy
        out.append((name, piece))
    return out


class GradientReduceScatter:
    """Stages 2 and 3: as soon as a unit's full gradient exists, reduce-scatter it into this rank's
    gradient shard. At most one reduce-scatter is in flight, which bounds how many full gradients
    are alive at once; micro-batches accumulate into the shard."""

    def __init__(self, units, shard_grads, group, name: str):
        self.units, self.shard_grads, self.group, self.name = units, shard_grads, group, name
        self.pending = []       # in-flight (unit, work, output, input): the input must outlive the work

    def launch(self, u: int, full: torch.Tensor) -> None:
        self.wait(keep=0)
        out = torch.empty(self.units[u].chunk, dtype=full.dtype, device=full.device)   # (padded/N,)
        work = comm.reduce_scatter_into(out, full, group=self.group, name=self.name, async_op=True)
        self.pending.append((u, work, out, full))

    def wait(self, keep: int = 0) -> None:
        while len(self.pending) > keep:
            u, work, out, _ = self.pending.pop(0)
            if work is not None:
                work.wait()
            self.shard_grads[u].add_(out)


class ZeroOptimizer:
    """ZeRO stage 1 or 2 (or 3, in the pipeline form) for any list of (name, parameter) on a data-parallel
    group.

        opt = ZeroOptimizer(named_params, dp_group, lr, weight_decay, stage=1)
        opt.begin_step()                # the pipeline forms (per_microbatch=False): full buffers back
        loss.backward()                 # stage 2: gradients are reduce-scattered during backward
        opt.sync_gradients()            # stage 1: all-reduce; stage 2: wait for the reduce-scatters
        norm = opt.clip_grad_norm(1.0)  # global norm from the shards (+ groups=[tp, pp] if sharded there)
        opt.step()                      # AdamW on my shard, then all-gather the updated parameters
        opt.zero_grad()

    The parameters may be anything this rank holds (tensor-parallel shards, a pipeline stage's
    subset): ZeRO only needs the DP group whose ranks hold the *same* tensors. Each parameter's
    storage is re-pointed into a flat per-unit buffer (`p.data = view`), as DDP does for gradients.
    """

    def __init__(self, named_params, group, lr: float, weight_decay: float, stage: int = 1,
                 units=None, name: str = "dp", per_microbatch: bool = True):
        assert stage in (1, 2) or (stage == 3 and not per_microbatch), "stage 3 per unit: zero_stage3.py"
        self.group, self.stage, self.comm_name = group, stage, name
        self.hooked = stage == 2 and per_microbatch        # reduce-scatter inside backward, per micro-batch
        world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        if units is None:       # no natural layers (a pipeline stage's TP shards): units of ~25 MB
            units = [(f"unit{i}", g) for i, g in enumerate(groups_by_size(named_params, UNIT_MB))]
        self.units, self.params, self.flat_params, self.flat_grads, self.shard_grads = [], [], [], [], []
        self.shards = []                   # this rank's (padded/N,) slice of each unit's parameters
        self.pieces = []                   # (name, nn.Parameter viewing a slice of my shard), for AdamW
        for _, named in units:
            params = [p for _, p in named]
            unit = FlatLayout(params, world, rank, names=[n for n, _ in named])
            flat = unit.flatten([p.detach() for p in params])             # (padded,)
            for p, view in zip(params, unit.split(flat)):
                p.data = view                                              # the model now reads `flat`
            if not self.hooked:
                # The full gradient accumulates in one flat buffer per unit (every .grad a view of it), so
                # one collective per unit reduces them all; stage 1's shard is a slice of it.
                flat_grad = torch.zeros_like(flat)
                for p, view in zip(params, unit.split(flat_grad)):
                    p.grad = view
            else:
                flat_grad = None
                for p in params:
                    p.register_post_accumulate_grad_hook(self._on_grad_ready)
            shard_grad = flat_grad[unit.lo:unit.hi] if stage == 1 else \
                torch.zeros(unit.chunk, dtype=flat.dtype, device=flat.device)            # (padded/N,)
            # stage 3's shard lives apart from the flat buffer, which is freed between steps
            shard = flat[unit.lo:unit.hi] if stage < 3 else flat[unit.lo:unit.hi].clone()  # (padded/N,)
            pieces = shard_pieces(unit, shard, shard_grad)
            for name, piece in pieces:                    # a piece is replicated where its tensor is (TP)
                for dim, copies in replicas(dict(named)[name]).items():
                    mark_replicated(piece, dim, copies)
            self.pieces += pieces
            self.units.append(unit)
            self.params.append(params)
            self.flat_params.append(flat)
            self.flat_grads.append(flat_grad)
            self.shard_grads.append(shard_grad)
            self.shards.append(shard)
        self.optimizer = build_adamw(self.pieces, lr, weight_decay)
        self.gathered = True                   # stage 3: are the full parameters in the flat buffers now?
        self.release()                         # the pipeline forms: nothing full between steps
        self.unit_of = {p: i for i, ps in enumerate(self.params) for p in ps}
        self._ready = [0] * len(self.units)
        self.reduce_scatter = GradientReduceScatter(self.units, self.shard_grads, group, name)   # stage 2

    # --- gradients ---------------------------------------------------------------------------
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """Stage 2, during backward: once a unit's gradients all exist, reduce-scatter them and free them."""
        # >>> exercise 01.zero2_reduce_scatter
        u = self.unit_of[p]
        self._ready[u] += 1
        if self._ready[u] < len(self.params[u]):
            return
        self._ready[u] = 0
        full = self.units[u].flatten([q.grad for q in self.params[u]])    # (padded,) full gradient
        for q in self.params[u]:
            q.grad = None                                                  # the full gradient is freed
        self.reduce_scatter.launch(u, full)
        # <<< exercise 01.zero2_reduce_scatter

    def sync_gradients(self) -> None:
        """Stage 1: all-reduce every unit's full gradient (2(N-1)/N·M). Stage 2 per micro-batch: finish the
        reduce-scatters. Stages 2 and 3 in the pipeline form: reduce-scatter every unit's accumulated
        gradient into my shard ((N-1)/N·M), then free the full gradients (and stage 3's parameters)."""
        if self.hooked:
            self.reduce_scatter.wait()
            return
        if self.stage == 1:
            works = [comm.all_reduce(g, group=self.group, name=self.comm_name, async_op=True) for g in self.flat_grads]
        else:
            works = [comm.reduce_scatter_into(mine, full, group=self.group, name=self.comm_name, async_op=True)
                     for mine, full in zip(self.shard_grads, self.flat_grads)]
        for w in works:
            if w is not None:
                w.wait()
        self.release()

    # --- the pipeline forms: what is full only during a step ----------------------------------------
    def begin_step(self) -> None:
        """Before the step's first forward: stages 2 and 3 (pipeline form) get their full gradient buffers
        back, zeroed; stage 3 gathers its parameters, kept for every micro-batch of the step."""
        if self.stage == 1 or self.hooked:
            return
        for g in self.flat_grads:
            _allocate(g).zero_()
        self.gather()

    def gather(self) -> None:
        """Stage 3: the full parameters, all-gathered from the shards ((N-1)/N·M); a no-op if they are
        here (also for validation and checkpoints between steps; `release` frees them again)."""
        if self.stage < 3 or self.gathered:
            return
        works = [comm.all_gather_into(_allocate(flat), shard, group=self.group, name=self.comm_name, async_op=True)
                 for flat, shard in zip(self.flat_params, self.shards)]
        for w in works:
            if w is not None:
                w.wait()
        self.gathered = True

    def release(self) -> None:
        """Free what the pipeline forms hold only during a step: the full gradients (stages 2 and 3), the
        full parameters (stage 3). The tensors stay, their storage is emptied (FSDP's way)."""
        if self.stage == 1 or self.hooked:
            return
        for g in self.flat_grads:
            g.untyped_storage().resize_(0)
        if self.stage == 3:
            for flat in self.flat_params:
                flat.untyped_storage().resize_(0)
            self.gathered = False

    def clip_grad_norm(self, max_norm: float, groups=(), coords=None) -> float:
        """Clip by the global norm. Each element lives in exactly one rank's shard (the padding is
        zero), so sum the squares of my shard and add them up over the DP group (and over `groups`
        whose ranks hold different tensors; a tensor replicated over those is counted once, by
        counted_here at this rank's `coords`)."""
        owned = [p.grad for _, p in self.pieces if counted_here(replicas(p), coords or {})]
        return clip_by_global_norm(owned, max_norm, groups=(self.group, *groups),
                                   all_grads=[p.grad for _, p in self.pieces])

    def grad_squares(self, coords: dict) -> torch.Tensor:
        """Σ g² of the whole gradient this group's ranks hold together: my shard's squares (a piece
        replicated over TP counted by one holder), summed over the group. The same on its every rank."""
        return sum_of_squares([p.grad for _, p in self.pieces if counted_here(replicas(p), coords)], [self.group])

    # --- the update ----------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def step(self) -> None:
        """AdamW on my shard only, then all-gather the updated shards: (N-1)/N·M per rank (stage 3: the
        next step's `begin_step` gathers them)."""
        self.optimizer.step()
        if self.stage == 3:
            return
        works = []
        for unit, flat in zip(self.units, self.flat_params):
            mine = flat[unit.lo:unit.hi].clone()   # the gather's input must not alias its output
            works.append(comm.all_gather_into(flat, mine, group=self.group, name=self.comm_name, async_op=True))
        for w in works:
            if w is not None:
                w.wait()

    def zero_grad(self) -> None:
        for g in self.flat_grads if self.stage == 1 else self.shard_grads:
            g.zero_()             # (the pipeline forms' full buffers are zeroed when begin_step allocates them)

    # --- accounting and checkpoints --------------------------------------------------------------
    def memory(self) -> dict:
        """Bytes held at rest by this rank (padding included), and the most held during a step."""
        padded = sum(f.numel() * f.element_size() for f in self.flat_params)     # (padded,) per unit
        chunk = sum(g.numel() * g.element_size() for g in self.shard_grads)      # (padded/N,) per unit
        return {"param_bytes": chunk if self.stage == 3 else padded,
                "grad_bytes": padded if self.stage == 1 else chunk,
                "optim_bytes": optim_bytes(self.optimizer), "peak_param_bytes": padded,
                "peak_grad_bytes": chunk if self.hooked else padded}

    def full_state(self):
        """(model state, AdamW state by name): the single-device checkpoint, on every rank."""
        self.gather()
        model = {n: t.detach().cpu().clone() for u, flat in zip(self.units, self.flat_params)
                 for n, t in zip(u.names, u.split(flat))}
        return model, gather_optim_state(self.units, self.pieces, self.optimizer, self.group, self.comm_name)

    def load_optim_state(self, states: dict) -> None:
        """Resume: AdamW's saved full moments (by name), each piece takes its slice."""
        load_optim_pieces(self.units, self.pieces, self.optimizer, states)


class ZeroDataParallel(ForwardBackward):
    """ZeRO 1 or 2 over a whole model (train_zero.py): forward and backward run the model as it is (its
    parameters now read `optimizer`'s flat buffers: a ZeroOptimizer over model_units(model), passed in);
    every other verb is the optimizer's, above."""

    def __init__(self, model, optimizer: ZeroOptimizer, tokens_per_step: int, bf16: bool = False):
        super().__init__(optimizer, tokens_per_step, bf16)
        self.model = model

    def forward(self, x):
        return self.model(x)                                             # (B, S) -> (B, S, V)

    def sync_gradients(self) -> None:
        self.optimizer.sync_gradients()          # stage 1: all-reduce; stage 2: wait for the reduce-scatters

    def full_state(self):
        return self.optimizer.full_state()


def _allocate(t: torch.Tensor) -> torch.Tensor:
    """Give back a released tensor its storage (its contents undefined until written)."""
    t.untyped_storage().resize_(t.numel() * t.element_size())
    return t
