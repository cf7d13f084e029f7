"""V-shaped schedules: two stages per rank, placed in a V (ZB-V and DualPipeV).

The placement. The model is cut into 2p stages and rank r holds TWO of them:

    stage:  0   1  ...  p-1 | p   p+1 ... 2p-1
    rank:   0   1  ...  p-1 | p-1 p-2 ... 0          rank r holds stage r (going down)
                                                     and stage 2p-1-r (coming back up)

A micro-batch goes down the ranks through stages 0..p-1, turns on the last rank (stages p-1 and p
are both on rank p-1: that hand-over is a local copy, no message) and comes back up through
p..2p-1, so its loss is computed on rank 0, the rank that embedded it. Two consequences:
  - the last forward and the first backward of a micro-batch meet on one rank: rank p-1 can start
    a backward as soon as its own forward is done, and rank 0 starts backwards one stage after its
    last forward, where 1F1B's rank 0 waits for the whole round trip;
  - every rank holds one stage near the input and one near the output, so every rank keeps about
    the same activations alive (1F1B's rank 0 holds p micro-batches, its rank p-1 holds one).
The interleaved schedule's placement (rank r holds r, r+p, ...) would send every chunk's last stage
to rank p-1 and its next one back to rank 0: the V is what makes the turn local.

Vocabulary (pipeline_actions.py): F, B (input gradient only: zero bubble's split), W (weight gradient),
BW (a whole backward: input and weights in one pass), Pair (DualPipeV's forward beside a whole backward).
"""
from .pipeline_actions import B, BW, W, Action, Pair, mark_whole_forwards


def v_placement(p: int) -> tuple[int, ...]:
    """rank_of[stage] for the 2p stages of a V: stage s < p on rank s, stage s ≥ p on rank 2p-1-s."""
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))


def v_stages(p: int, r: int) -> tuple[int, int]:
    """The two stages rank r holds: (down, up) = (r, 2p-1-r)."""
    return r, 2 * p - 1 - r


class _Counters:
    """The next micro-batch of each (kind, stage) on one rank: actions are issued in micro-batch order."""

    def __init__(self):
        self.next = {}

    def take(self, kind: str, stage: int) -> Action:
        mb = self.next.get((kind, stage), 0)
        self.next[(kind, stage)] = mb + 1
        return Action(kind, mb, stage)

    def whole(self, stage: int) -> Action:
        """The next B of `stage` and its W, as one whole backward (BW)."""
        b = self.take(B, stage)
        self.next[(W, stage)] = b.mb + 1
        return Action(BW, b.mb, stage)

    def b_then_a_w(self, stage: int) -> list[Action]:
        """The next B of `stage`, then the oldest W it owes: one whole pass (BW) when that W is the B's own."""
        if self.next.get((W, stage), 0) == self.next.get((B, stage), 0):
            return [self.whole(stage)]
        return [self.take(B, stage), self.take(W, stage)]


def zb_v(p: int, m: int) -> list[list[Action]]:
    """ZB-V (zero bubble, V placement): rank r runs stages r (down) and 2p-1-r (up).

    Written for at least 2p-1 micro-batches, the number that fills the V; with fewer, the actions
    of the micro-batches that do not exist are left out (the order of the rest is kept).
    With F = B = W the bubble is zero once m ≥ 2p-1, except the ramp-up of the first forwards
    (theory_bubble in pipeline_schedules.py).
    """
    n = max(2 * p - 1, m)                                # micro-batches the pattern is written for
    out = []
    for r in range(p):
        down, up = v_stages(p, r)
        c, acts = _Counters(), []
        # >>> exercise 03.zbv
        # === warmup ===  fill the V: forwards down, then forwards up interleaved with down
        acts += [c.take("F", down) for _ in range(2 * (p - r) - 1)]     # the deeper the rank, the fewer
        for _ in range(r):
            acts += [c.take("F", up), c.take("F", down)]
        # the first backwards reach the up stage: F and a whole backward on it, p - r times
        for _ in range(p - r):
            acts += [c.take("F", up), c.whole(up)]
        # === steady state ===  one F and a whole backward (BW) on the down stage, then on the up stage
        while c.next.get(("F", up), 0) < c.next.get(("F", down), 0) or c.next.get(("F", down), 0) < n:
            if c.next.get(("F", down), 0) < n:
                acts.append(c.take("F", down))
            acts += [c.whole(down)]
            acts += [c.take("F", up), c.whole(up)]
        # === cooldown ===  backwards first (someone waits for them), weight gradients fill the gaps
        for _ in range(r):
            acts += [c.take("B", down), c.take("B", up)]
        for _ in range(p - r):
            acts += c.b_then_a_w(down)
        # === flush ===  the W's still pending: up stage first, then down
        acts += [c.take("W", up) for _ in range(c.next[("B", up)] - c.next[("W", up)])]
        acts += [c.take("W", down) for _ in range(c.next[("B", down)] - c.next[("W", down)])]
        # <<< exercise 03.zbv
        out.append(mark_whole_forwards([a for a in acts if a.mb < m]))   # fewer than 2p-1 micro-batches: drop the rest
    return out


def dualpipe_v(p: int, m: int) -> list[list[Action]]:
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V): rank r runs stages r and 2p-1-r.

    Its heart is the steady state's PAIR: the forward of one micro-batch on one stage and the whole
    backward of an older micro-batch on the other stage, issued together (one Pair), so that a runtime
    can overlap one's communication (the experts' all-to-all) with the other's compute. Around it,
    zero bubble's split (B now, W later) fills the ramp-up and the drain. Needs m ≥ 2p.
    """
    out = []
    for r in range(p):
        down, up = v_stages(p, r)
        c, acts, waiting_w = _Counters(), [], []

        def whole_backward(stage):                       # B and W at once: one backward pass
            return [c.whole(stage)]

        def split_b(stage):                              # B now, its W queued for a gap
            b = c.take("B", stage)
            waiting_w.append(Action(W, b.mb, stage))
            return [b]

        def a_queued_w():                                # the oldest postponed W, if any
            return [waiting_w.pop(0)] if waiting_w else []

        def b_then_a_queued_w(stage):                    # none queued: the W would be this B's own, one pass
            return split_b(stage) + a_queued_w() if waiting_w else whole_backward(stage)

        def pair(f_stage, b_stage):                      # F of one micro-batch, whole B of another
            return [Pair(c.take("F", f_stage), c.whole(b_stage))]

        # === 1. warmup down ===  forwards on the down stage only
        acts += [c.take("F", down) for _ in range(2 * (p - r - 1))]
        # === 2. warmup both ===  forwards down and up, alternating
        for _ in range(r + 1):
            acts += [c.take("F", down), c.take("F", up)]
        # === 3. first backwards ===  B of the up stage, a queued W, one more forward up (zero bubble)
        for _ in range(p - r - 1):
            acts += b_then_a_queued_w(up) + [c.take("F", up)]
        # === 4. steady state ===  pairs: (F down, whole B up), (F up, whole B down). (PyTorch leaves the
        # very first pair of the last rank unpaired, an F then a BW: one at a time, the same actions.)
        for _ in range(m - 2 * p + r + 1):
            acts += pair(down, up) + pair(up, down)
        # === 5. drain up ===  whole B up, then a pair (F up, whole B down)
        for _ in range(p - r - 1):
            acts += whole_backward(up) + pair(up, down)
        # === 6. last backwards ===  B up, B down; halfway, switch to the split (W's fill the tail)
        split = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            acts += split_b(up) if split else whole_backward(up)
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            acts += split_b(down) if split else whole_backward(down)
        # === 7. cooldown ===  a queued W, then the next B down
        for _ in range(p - r - 1):
            acts += a_queued_w() + (split_b(down) if split else whole_backward(down))
        # === 8. flush ===  the W's still queued
        for _ in range(r + 1):
            acts += a_queued_w()
        out.append(mark_whole_forwards(acts))
    return out
