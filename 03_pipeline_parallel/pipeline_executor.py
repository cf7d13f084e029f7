"""One executor for every schedule: run this rank's list of actions, talking to its neighbours.

The schedule (pipeline_schedules.py) decides the order; this file does the work:
    F(mb, s): receive the stage input (tokens on stage 0), run the stage, send the output on
    B(mb, s): receive d loss / d output, backpropagate, send d loss / d input back
    W(mb, s): (zero-bubble) the parameter gradients that B left out

Point-to-point messages. Every message has a known shape (the activation shape (mb, S, D), or
(mb, S/tp, D) with sequence parallelism: the caller says), so the receiver allocates the buffer and
posts `irecv` before it needs the data. Two rules keep gloo (and any backend) from deadlocking:
  1. Sends never block: `isend`, and we wait for them only at the end of the step.
  2. Messages between two ranks are matched in order (same tag), so the receiver must post its
     irecvs in the SENDER's order. The schedule is a pure function, so every rank can compute every
     other rank's action list and therefore the order of each incoming channel (`incoming_order`).
     When an action needs a message, all earlier messages of that channel are posted first; and the
     next action's message is posted one action ahead so the transfer overlaps the compute.
The unit tests simulate the schedules under exactly these rules (no deadlock, dependencies hold).

Zero-bubble split (zero_bubble.py). The first time a schedule with W actions runs, every nn.Linear
of this rank's stages becomes a SplitLinear (same Parameter). B is then one backward pass that
computes the stage input's gradient, which the previous rank is waiting for, and the gradients of
the few parameters outside linear layers, while each linear layer leaves (x, dy) behind; W computes
those layers' dW = dyᵀ x. Stage 0 has nobody waiting for an input gradient: its B does nothing and
its W is the whole backward.
"""
import torch
import torch.nn as nn

from common import comm

from . import pipeline_stages, zero_bubble

Key = tuple   # ("act" | "grad", micro-batch, destination stage)


def produced_messages(actions, n_stages: int, p: int):
    """(key, destination rank) of each message a rank's action list sends, in order."""
    out = []
    for a in actions:
        if a.kind == "F" and a.stage < n_stages - 1:
            out.append((("act", a.mb, a.stage + 1), (a.stage + 1) % p))
        elif a.kind == "B" and a.stage > 0:
            out.append((("grad", a.mb, a.stage - 1), (a.stage - 1) % p))
    return out


def needed_message(a, n_stages: int, p: int):
    """(key, source rank) of the message action `a` waits for, or None."""
    if a.kind == "F" and a.stage > 0:
        return ("act", a.mb, a.stage), (a.stage - 1) % p
    if a.kind == "B" and a.stage < n_stages - 1:
        return ("grad", a.mb, a.stage), (a.stage + 1) % p
    return None


def incoming_order(schedule, me: int, n_stages: int) -> dict[int, list[Key]]:
    """For each source rank, the keys it sends to `me`, in the order it sends them."""
    p = len(schedule)
    return {src: [k for k, dst in produced_messages(schedule[src], n_stages, p) if dst == me]
            for src in range(p) if src != me}


def stage_parameters(model: nn.Module, stage) -> list[nn.Parameter]:
    mods = ([model.tok_emb] if stage.first else []) + [model.layers[i] for i in stage.layers] + (
        [model.norm, model.lm_head] if stage.last else [])
    return [p for m in mods for p in m.parameters() if p.requires_grad]


class PipelineExecutor:
    """Runs schedules for one pipeline rank.

    model      the pruned stage model (prune_to_stages), holding this rank's stages
    specs      every StageSpec of the pipeline (all ranks, all virtual stages)
    pp_rank    this rank's position in the pipeline; pp_ranks: the GLOBAL ranks of the pipeline
               group in stage order (torch.distributed addresses peers by global rank)
    group      the pipeline process group (not necessarily the world: chapter 04 passes its own)
    act_shape  shape of one message, e.g. (mb, S, D); dtype of the activations
    loss_fn    loss_fn(logits, targets) -> SUMMED loss (vocab-parallel in chapter 04)
    loss_scale the loss is divided by this (the global token count), see common/model.loss_sum
    """

    def __init__(self, model, specs, pp_rank: int, pp_ranks: list[int], group, act_shape, loss_fn, loss_scale,
                 dtype=torch.float32, device="cpu", autocast_dtype=None, timeline=None):
        self.model, self.specs, self.me, self.ranks, self.group = model, specs, pp_rank, pp_ranks, group
        self.p, self.n = len(pp_ranks), len(specs)
        self.act_shape, self.dtype, self.device = tuple(act_shape), dtype, torch.device(device)
        self.loss_fn, self.loss_scale, self.autocast_dtype, self.timeline = loss_fn, loss_scale, autocast_dtype, timeline
        self.stage_params = {s.index: stage_parameters(model, s) for s in specs if s.index % self.p == pp_rank}
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.store, self.b_params = None, None    # set up by the first schedule with W actions

    def _split_weight_grads(self) -> None:
        """Zero bubble: linear layers postpone dW to W; B computes the other parameters' gradients."""
        self.store = zero_bubble.WeightGradStore()
        deferred = zero_bubble.split_linears(self.model, self.store)
        self.b_params = {s: [p for p in params if id(p) not in deferred] for s, params in self.stage_params.items()}

    # --- messages --------------------------------------------------------------------------------
    def _post_until(self, key: Key, src: int) -> None:
        """Post irecvs on channel `src` in the sender's order, up to and including `key`."""
        queue = self.order[src]
        while key not in self.posted:
            k = queue.pop(0)
            buf = torch.empty(self.act_shape, dtype=self.dtype, device=self.device)   # (mb, S, D)
            self.posted[k] = (buf, comm.recv(buf, src=self.ranks[src], group=self.group, name="pp"))

    def _post_ahead(self, a) -> None:
        need = needed_message(a, self.n, self.p)
        if need and need[1] != self.me:
            self._post_until(*need)

    def _receive(self, a):
        need = needed_message(a, self.n, self.p)
        if need is None:
            return None
        key, src = need
        if src == self.me:                              # neighbour stage on this same rank (p = 1)
            return self.local.pop(key)
        self._post_until(key, src)
        buf, work = self.posted.pop(key)
        t = self._now()
        work.wait()
        self._span("recv", t, mb=a.mb, stage=a.stage)
        return buf

    def _send(self, key: Key, dst: int, tensor) -> None:
        if dst == self.me:
            self.local[key] = tensor.detach()
            return
        t = self._now()
        self.sends.append((tensor, comm.send(tensor.detach(), dst=self.ranks[dst], group=self.group, name="pp")))
        self._span("send", t, mb=key[1], stage=key[2], what=key[0])   # posting the isend: its own span

    # --- timeline: F/B/W spans hold compute only; posting a send and waiting for a recv are their own ---
    def _now(self):
        return self.timeline.now() if self.timeline else 0.0

    def _span(self, kind, start, **args):
        if self.timeline:
            self.timeline.add(kind, start, self.timeline.now(), **args)

    # --- the three kinds of work ---------------------------------------------------------------------
    def _forward(self, a, inp, tokens, targets):
        stage = self.specs[a.stage]
        if stage.first:
            inp = tokens                                                   # (mb, S) token ids
        else:
            inp.requires_grad_(True)                                       # we want d loss / d input
        saved = []                       # every tensor autograd keeps for backward (counted below)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), \
                torch.autocast(self.device.type, self.autocast_dtype or torch.float32,
                               enabled=self.autocast_dtype is not None):
            out = pipeline_stages.stage_forward(self.model, stage, inp)            # (mb, S, D) or logits
            if stage.last:
                out = self.loss_fn(out, targets) / self.loss_scale         # this micro-batch's share
        nbytes = self._bytes(saved)
        self.state[(a.mb, a.stage)] = {"inp": inp, "out": out, "bytes": nbytes}
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        if stage.last:
            self.loss += out.detach().float()
            return None
        return ("act", a.mb, a.stage + 1), (a.stage + 1) % self.p, out          # sent by `run`

    def _backward(self, a, grad_out, split: bool):
        st, stage = self.state[(a.mb, a.stage)], self.specs[a.stage]
        st["grad_out"] = grad_out
        if not split:                                   # plain backward: input AND weight gradients
            torch.autograd.backward(st["out"], grad_out)
            self._release(a)
            grad_in = None if stage.first else st["inp"].grad
        elif stage.first:                               # nobody waits for d loss / d tokens: all in W
            return None
        else:                                           # B of zero bubble: dW of linear layers waits
            with self.store.deferring() as pending:
                torch.autograd.backward(st["out"], grad_out, inputs=[st["inp"]] + self.b_params[a.stage])
            grad_in = st["inp"].grad                    # (mb, S, D)
            # The graph is freed; what stays until W is each linear layer's (x, dy).
            st["pending"], kept = pending, self._bytes(t for _, x, dy in pending for t in (x, dy))
            self.live += kept - st["bytes"]
            st["bytes"] = kept
        if stage.first:
            return None
        return ("grad", a.mb, a.stage - 1), (a.stage - 1) % self.p, grad_in        # (mb, S, D), sent by `run`

    def _weights(self, a):
        st = self.state[(a.mb, a.stage)]
        if "pending" in st:                             # the dW = dyᵀ x that B left
            zero_bubble.apply_weight_grads(st["pending"])
        else:                                           # stage 0: B did nothing, W is the whole backward
            torch.autograd.backward(st["out"], st["grad_out"])
        self._release(a)

    def _bytes(self, tensors) -> int:
        """Bytes of distinct storages among `tensors`, parameters left out."""
        seen, total = set(self.param_ptrs), 0
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
        return total

    def _release(self, a):
        st = self.state.pop((a.mb, a.stage))
        self.live -= st["bytes"]

    # --- the step -------------------------------------------------------------------------------
    def run(self, schedule, tokens: list, targets: list, on_stage_grads_ready=None) -> dict:
        """Run this rank's actions for one step. tokens/targets: the m micro-batches (mb, S) each
        (used on the first / last stage only). Gradients accumulate into .grad.
        on_stage_grads_ready(stage): called as soon as a stage's gradients are final for this step
        (after its last B or W), while the rest of the schedule still runs (chapter 04 starts the
        data-parallel all-reduce of that stage there).
        Returns {"loss": summed scaled loss of the micro-batches this rank finished (last stage; 0
        elsewhere), "peak_activation_bytes": the most activation bytes alive at once}."""
        actions = schedule[self.me]
        split = any(a.kind == "W" for a in actions)
        if split and self.store is None:
            self._split_weight_grads()
        self.order = incoming_order(schedule, self.me, self.n)
        self.posted, self.local, self.state, self.sends = {}, {}, {}, []
        self.live, self.peak = 0, 0
        self.loss = torch.zeros((), device=self.device)
        last_grad_action = {a.stage: i for i, a in enumerate(actions) if a.kind in ("B", "W")}
        for i, a in enumerate(actions):
            if i + 1 < len(actions):
                self._post_ahead(actions[i + 1])        # start the next message's transfer now
            received = self._receive(a)                 # a "recv" span if it has to wait
            t = self._now()
            if a.kind == "F":
                outgoing = self._forward(a, received, tokens[a.mb], targets[a.mb])
            elif a.kind == "B":
                outgoing = self._backward(a, received, split)
            else:
                self._weights(a)
                outgoing = None                         # W sends nothing
            self._span(a.kind, t, mb=a.mb, stage=a.stage)  # compute only ...
            if outgoing is not None:
                self._send(*outgoing)                   # ... the isend is a "send" span of its own
            if on_stage_grads_ready and last_grad_action[a.stage] == i:
                on_stage_grads_ready(a.stage)
        t = self._now()
        for _, work in self.sends:                      # the buffers must outlive their isend
            work.wait()
        self._span("send", t, wait="all")               # blocked until every send of the step is done
        assert not self.state and not self.posted, "schedule left work unfinished"
        return {"loss": self.loss, "peak_activation_bytes": self.peak}


@torch.no_grad()
def forward_only_loss_sum(model, my_specs, pp_rank: int, pp_ranks: list[int], group, inputs: list,
                          targets: list, loss_fn, act_shape, device):
    """Forward only, through the whole pipeline (validation): the summed loss of the micro-batches
    on the last stage, 0 elsewhere. No backward, so no schedule is needed: every rank runs its
    stages in order, micro-batch after micro-batch (GPipe's forward half). Receives block, sends do
    not, and both ends of every channel see the messages in the same order, so this cannot deadlock."""
    p = len(pp_ranks)
    total = torch.zeros((), device=device)
    local, sends = {}, []
    for stage in my_specs:                                  # increasing stage index
        for mb, (x, y) in enumerate(zip(inputs, targets)):
            if stage.first:
                inp = x                                     # (mb, S) tokens
            elif (stage.index - 1) % p == pp_rank:
                inp = local.pop((mb, stage.index))          # the previous stage lives on this rank too
            else:
                inp = torch.empty(act_shape, device=device)  # (mb, S, D), or (mb, S/tp, D) with SP
                comm.recv(inp, src=pp_ranks[(stage.index - 1) % p], group=group, name="pp").wait()
            out = pipeline_stages.stage_forward(model, stage, inp)
            if stage.last:
                total += loss_fn(out, y)
            elif (stage.index + 1) % p == pp_rank:
                local[(mb, stage.index + 1)] = out
            else:
                sends.append((out, comm.send(out, dst=pp_ranks[(stage.index + 1) % p], group=group, name="pp")))
    for _, work in sends:
        work.wait()
    return total
