"""One executor for every schedule: run this rank's list of actions, talking to its neighbours.

The schedule (pipeline_schedules.py) decides the order; this file does the work:
    F(mb, s): receive the stage input (tokens on stage 0), run the stage, send the output on
    B(mb, s): receive d loss / d output, backpropagate, send d loss / d input back
    W(mb, s): (zero-bubble) the parameter gradients that B left out
    BW(mb, s): B and W in one backward pass; a Pair (DualPipeV): its F, then its BW (pipeline_actions.py)

Point-to-point messages. Every message has a known shape (the activation shape (mb, S, D), or
(mb, S/tp, D) with sequence parallelism: the caller says), so the receiver allocates the buffer and
posts `irecv` before it needs the data. Two rules keep gloo (and any backend) from deadlocking:
  1. Sends never block: `isend`, and we wait for them only at the end of the step.
  2. Messages between two ranks are matched in order (same tag), so the receiver must post its
     irecvs in the SENDER's order. The schedule is a pure function, so every rank can compute every
     other rank's action list and therefore the order of each incoming channel (`incoming_order`).
     When an action needs a message, all earlier messages of that channel are posted first.
When to post. A message moves only once both ends are posted, so an irecv posted late makes the
sender's data wait. With gloo (CPU) every irecv of the step is posted when the step begins, in each
channel's order: a message then travels the moment it is sent, by gloo's own thread, while this
rank computes. Its price: every incoming buffer of the step exists from the start (one (mb, S, D)
per message; not activations autograd saves, so not in the measured activation peak). NCCL runs a
rank's sends and receives to one peer in order, on one stream: there an irecv posted long before its
message would hold up this rank's own sends to that peer, and deadlock. So with NCCL the next
action's message is posted one action ahead, no earlier. The unit tests simulate the schedules under
that stricter rule (no deadlock, dependencies hold); posting more irecvs earlier only removes waits.

Zero-bubble split (zero_bubble.py). The first time a schedule with W actions runs, every nn.Linear
of this rank's stages becomes a SplitLinear (same Parameter). B is then one backward pass that
computes the stage input's gradient, which the previous rank is waiting for, and the gradients of
the few parameters outside linear layers, while each linear layer leaves (x, dy) behind; W computes
those layers' dW = dyᵀ x. Stage 0 has nobody waiting for an input gradient: its B does nothing and
its W is the whole backward. A BW action (ZB-V's steady state, DualPipeV's pairs) is one whole backward
pass, and its F, marked `whole`, runs the linear layers as plain nn.Linear (`WeightGradStore.whole`), as
every F of stage 0 does: the same numbers as the split, without paying for two passes and for the split's
Python layer.

Measurement is not in this file: measured_executor.py wraps the same methods (receive, compute,
send, wait_sends) with timeline spans and counts the activation bytes alive, for the bubble and
memory the chapter reports.
"""
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from common import comm, recompute

from . import pipeline_schedules, pipeline_stages, zero_bubble
from .pipeline_actions import BACKWARDS, BW, GRADS_DONE, B, F, W, units

Key = tuple   # ("act" | "grad", micro-batch, destination stage)


def produced_messages(actions, n_stages: int, p: int, rank_of=None):
    """(key, destination rank) of each message a rank's action list sends, in order.
    rank_of[stage]: the rank that holds each stage (default: the loop, stage s on rank s % p; the V
    schedules pass theirs, pipeline_schedules.placement)."""
    rank_of = rank_of or [s % p for s in range(n_stages)]
    out = []
    for a in units(actions):
        if a.kind == F and a.stage < n_stages - 1:
            out.append((("act", a.mb, a.stage + 1), rank_of[a.stage + 1]))
        elif a.kind in BACKWARDS and a.stage > 0:
            out.append((("grad", a.mb, a.stage - 1), rank_of[a.stage - 1]))
    return out


def needed_message(a, n_stages: int, p: int, rank_of=None):
    """(key, source rank) of the message action `a` (not a Pair) waits for, or None. rank_of: as
    produced_messages'."""
    rank_of = rank_of or [s % p for s in range(n_stages)]
    if a.kind == F and a.stage > 0:
        return ("act", a.mb, a.stage), rank_of[a.stage - 1]
    if a.kind in BACKWARDS and a.stage < n_stages - 1:
        return ("grad", a.mb, a.stage), rank_of[a.stage + 1]
    return None


def message_count(actions, n_stages: int, p: int, rank_of=None) -> int:
    """Messages a rank's action list sends and receives in one step, each one micro-batch's activation
    (forward) or its gradient (backward), act_shape's bytes: their bytes are the step's comm_bytes_pp."""
    return len(produced_messages(actions, n_stages, p, rank_of)) + sum(
        needed_message(a, n_stages, p, rank_of) is not None for a in units(actions))


def incoming_order(schedule, me: int, n_stages: int) -> dict[int, list[Key]]:
    """For each source rank, the keys it sends to `me`, in the order it sends them."""
    rank_of = pipeline_schedules.placement(schedule)    # where each stage lives (a loop, or a V)
    # >>> exercise 03.receive_order
    p = len(schedule)
    return {src: [k for k, dst in produced_messages(schedule[src], n_stages, p, rank_of) if dst == me]
            for src in range(p) if src != me}
    # <<< exercise 03.receive_order


def last_grad_actions(actions) -> dict[int, int]:
    """stage -> the index of its last B, W or BW (a Pair's included) in a rank's action list: its gradients
    are final after it."""
    return {u.stage: i for i, a in enumerate(actions) for u in units([a]) if u.kind in GRADS_DONE}


def stage_parameters(model: nn.Module, spec) -> list[nn.Parameter]:
    """The trainable parameters of one stage (a StageSpec) of the pruned stage model."""
    mods = ([model.tok_emb] if spec.first else []) + [model.layers[i] for i in spec.layers] + (
        [model.norm, model.lm_head] if spec.last else [])
    return [p for m in mods for p in m.parameters() if p.requires_grad]


class Whole:
    """How a message travels between two ranks: whole, as the stage produced it. A later chapter passes
    another (`wire`): chapter 04's scatter_gather.ScatterGather sends each TP rank's 1/tp and gathers it."""

    def shape(self, act_shape: tuple) -> tuple:
        return act_shape                    # what the receiver posts a buffer of: (mb, S, D)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor                       # what goes on the wire

    def unpack(self, received: torch.Tensor, act_shape: tuple) -> torch.Tensor:
        return received                     # the stage input again: (mb, S, D)


@dataclass
class InFlight:
    """One micro-batch on one stage, from its F until its last backward action (B, or W)."""
    inp: torch.Tensor                         # the stage input: tokens (mb, S) on stage 0, else (mb, S, D)
    out: torch.Tensor                         # the output (mb, S, D); on the last stage its scaled loss
    grad_out: torch.Tensor | None = None      # d loss / d out, once B has received it
    pending: list | None = None               # zero bubble: each linear layer's (weight, x, dy) left for W


class PipelineExecutor:
    """Runs schedules for one pipeline rank.

    model      the pruned stage model (prune_to_stages), holding this rank's stages
    specs      every StageSpec of the pipeline (all ranks, all virtual stages); specs[s] describes stage s
    pp_rank    this rank's position in the pipeline; pp_ranks: the GLOBAL ranks of the pipeline
               group in stage order (torch.distributed addresses peers by global rank)
    group      the pipeline process group (not necessarily the world: chapter 04 passes its own)
    act_shape  shape of one message, e.g. (mb, S, D); dtype of the activations
    loss_fn    loss_fn(logits, targets) -> SUMMED loss (vocab-parallel in chapter 04)
    loss_scale the loss is divided by this (the global token count), see common/model.loss_sum
    wire       how a message travels (default Whole: as it is; chapter 04's ScatterGather: 1/tp each)

    A stage is named by its global index (an int, as in an Action); its StageSpec is `specs[stage]`.
    What this class does not do is measure: measured_executor.py times its actions and messages and
    counts the activation bytes alive, around the same methods.
    """

    def __init__(self, model, specs, pp_rank: int, pp_ranks: list[int], group, act_shape, loss_fn, loss_scale,
                 dtype=torch.float32, device="cpu", autocast_dtype=None, post_all_at_start=None, wire=None):
        self.model, self.specs, self.me, self.ranks, self.group = model, specs, pp_rank, pp_ranks, group
        self.p, self.n = len(pp_ranks), len(specs)
        self.act_shape, self.dtype, self.device = tuple(act_shape), dtype, torch.device(device)
        self.loss_fn, self.loss_scale, self.autocast_dtype = loss_fn, loss_scale, autocast_dtype
        self.wire = wire or Whole()
        self.rank_of = [s.rank for s in specs]    # where each stage lives: a loop (s % p) or a V
        self.stage_params = {s.index: stage_parameters(model, s) for s in specs if s.rank == pp_rank}
        self.store, self.b_params = None, None    # set up by the first schedule with W actions
        # see "When to post" above; post_all_at_start=False: NCCL's rule on gloo too (breakdown_pp.py)
        self.post_all_at_start = dist.get_backend(group) == "gloo" if post_all_at_start is None else post_all_at_start

    def _split_weight_grads(self) -> None:
        """Zero bubble: linear layers postpone dW to W; B computes the other parameters' gradients."""
        self.store = zero_bubble.WeightGradStore()
        deferred = zero_bubble.split_linears(self.model, self.store)
        self.b_params = {s: [p for p in params if id(p) not in deferred] for s, params in self.stage_params.items()}

    # --- the step -------------------------------------------------------------------------------
    def run(self, schedule, tokens: list, targets: list, on_stage_grads_ready=None) -> torch.Tensor:
        """Run this rank's actions for one step. tokens/targets: the m micro-batches (mb, S) each
        (used on the first / last stage only). Gradients accumulate into .grad.
        on_stage_grads_ready(stage): called as soon as a stage's gradients are final for this step
        (after its last B or W), while the rest of the schedule still runs (the trainer starts the
        data-parallel all-reduce of that stage there).
        Returns the summed scaled loss of the micro-batches this rank finished (last stage; 0 elsewhere)."""
        actions = schedule[self.me]
        self.split = any(a.kind == W for a in units(actions))     # zero bubble: B and W are two actions
        if self.split and self.store is None:
            self._split_weight_grads()
        self.order = incoming_order(schedule, self.me, self.n)
        self.posted, self.local, self.sends = {}, {}, []
        self.in_flight: dict[tuple[int, int], InFlight] = {}  # (micro-batch, stage) -> its tensors
        self.loss = torch.zeros((), device=self.device)
        if self.post_all_at_start:                      # gloo: every message of the step can travel now
            for src, queue in self.order.items():
                if queue:
                    self._post_until(queue[-1], src)
        self.run_actions(actions, tokens, targets, on_stage_grads_ready or (lambda stage: None))
        self.wait_sends()
        assert not self.in_flight and not self.posted, "schedule left work unfinished"
        return self.loss

    def run_actions(self, actions, tokens: list, targets: list, on_stage_grads_ready) -> None:
        """This rank's actions, one after the other: a Pair as its F, then its BW. (Chapter 05 runs a
        Pair's two at once.)"""
        actions = units(actions)
        last_grad_action = last_grad_actions(actions)
        for i, a in enumerate(actions):
            if not self.post_all_at_start and i + 1 < len(actions):
                self.post_ahead(actions[i + 1])         # NCCL: start the next message's transfer now
            received = self.receive(a)                  # the input this action waits for, if any
            outgoing = self.compute(a, received, tokens, targets)
            if outgoing is not None:
                self.send(*outgoing)
            if last_grad_action[a.stage] == i:
                on_stage_grads_ready(a.stage)

    # --- messages --------------------------------------------------------------------------------
    def _post_until(self, key: Key, src: int) -> None:
        """Post irecvs on channel `src` in the sender's order, up to and including `key`."""
        queue = self.order[src]
        while key not in self.posted:
            k = queue.pop(0)
            buf = torch.empty(self.wire.shape(self.act_shape), dtype=self.dtype, device=self.device)  # (mb, S, D)
            self.posted[k] = (buf, comm.recv(buf, src=self.ranks[src], group=self.group, name="pp"))

    def post_ahead(self, a) -> None:
        """Post the irecv of the message action `a` will wait for (and of those sent before it)."""
        need = needed_message(a, self.n, self.p, self.rank_of)
        if need and need[1] != self.me:
            self._post_until(*need)

    def receive(self, a):
        """The message action `a` waits for (None if it needs none), waited for."""
        need = needed_message(a, self.n, self.p, self.rank_of)
        if need is None:
            return None
        key, src = need
        if src == self.me:                              # neighbour stage on this same rank (p = 1, the V's turn)
            return self.local.pop(key)
        self._post_until(key, src)
        buf, work = self.posted.pop(key)
        work.wait()
        return self.wire.unpack(buf, self.act_shape)    # (mb, S, D)

    def send(self, key: Key, dst: int, tensor) -> None:
        """Post an isend; it is waited for at the end of the step (`wait_sends`), so it never blocks."""
        if dst == self.me:
            self.local[key] = tensor.detach()
            return
        out = self.wire.pack(tensor.detach())
        self.sends.append((out, comm.send(out, dst=self.ranks[dst], group=self.group, name="pp")))

    def wait_sends(self) -> None:
        for _, work in self.sends:                      # the buffers must outlive their isend
            work.wait()

    # --- the four kinds of work ----------------------------------------------------------------------
    def compute(self, a, received, tokens: list, targets: list):
        """Run action `a` (F, B, BW or W) on its input; returns the message to send on, (key, destination
        rank, tensor), or None."""
        if a.kind == F:
            return self._forward(a, received, tokens[a.mb], targets[a.mb])
        if a.kind == BW or (a.kind == B and not self.split):       # a plain backward is whole too
            return self._whole_backward(a, received)
        if a.kind == B:
            return self._backward(a, received)
        self._weights(a)
        return None                                     # W sends nothing

    def _forward(self, a, inp, tokens, targets):
        spec = self.specs[a.stage]
        if spec.first:
            inp = tokens                                                   # (mb, S) token ids
        else:
            inp.requires_grad_(True)                                       # we want d loss / d input
        # its backward is one pass (a BW; on stage 0, the W): plain nn.Linear. Without W's, nothing is split.
        whole = self.whole_forward() if self.split and (a.whole or spec.first) else nullcontext()
        with whole, torch.autocast(self.device.type, self.autocast_dtype or torch.float32,
                                   enabled=self.autocast_dtype is not None):
            out = pipeline_stages.stage_forward(self.model, spec, inp)     # (mb, S, D) or logits
            if spec.last:
                out = self.loss_fn(out, targets) / self.loss_scale         # this micro-batch's share
        self.in_flight[(a.mb, a.stage)] = InFlight(inp, out)
        if spec.last:
            self.loss += out.detach().float()
            return None
        return ("act", a.mb, a.stage + 1), self.rank_of[a.stage + 1], out

    @contextmanager
    def whole_forward(self):
        """The forward of a micro-batch whose B and W are one pass: plain nn.Linear, and so is a
        recomputation of its blocks in that backward (it must save what the forward saved)."""
        with self.store.whole(), recompute.around_recomputation(self.store.whole):
            yield

    def _whole_backward(self, a, grad_out):
        """A plain backward (BW, or B without W's): input AND weight gradients, in one pass."""
        spec, held = self.specs[a.stage], self.in_flight.pop((a.mb, a.stage))
        torch.autograd.backward(held.out, grad_out)
        if spec.first:
            return None
        return ("grad", a.mb, a.stage - 1), self.rank_of[a.stage - 1], held.inp.grad    # (mb, S, D)

    def _backward(self, a, grad_out):
        """Zero bubble's B: the input gradient now; the linear layers' dW waits for W."""
        spec, held = self.specs[a.stage], self.in_flight[(a.mb, a.stage)]
        held.grad_out = grad_out
        if spec.first:                                  # nobody waits for d loss / d tokens: all in W
            return None
        with self.store.deferring() as pending:
            torch.autograd.backward(held.out, grad_out, inputs=[held.inp] + self.b_params[a.stage])
        held.pending = pending    # the graph is freed; what stays until W is each linear layer's (x, dy)
        return ("grad", a.mb, a.stage - 1), self.rank_of[a.stage - 1], held.inp.grad    # (mb, S, D)

    def _weights(self, a):
        held = self.in_flight.pop((a.mb, a.stage))
        if held.pending is not None:                    # the dW = dyᵀ x that B left
            zero_bubble.apply_weight_grads(held.pending)
        else:                                           # stage 0: B did nothing, W is the whole backward
            torch.autograd.backward(held.out, held.grad_out)
