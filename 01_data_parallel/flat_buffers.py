"""Tensors that travel together: laid end to end in one flat buffer, moved by one collective.

One collective per tensor pays a collective's latency once per tensor (75 times for `tiny`); one
collective per flat buffer pays it once per buffer. Both halves of the chapter do it:

- bucketed DP (data_parallel.py) copies a bucket's gradients into one buffer and all-reduces it;
- ZeRO (zero_sharding.py, zero_stage3.py) lays a unit's tensors into one buffer padded to a multiple
  of N, so that rank i owns its i-th contiguous chunk, and all-gathers or reduce-scatters it whole.

`FlatLayout` is where each tensor sits in such a buffer (and, for ZeRO, which chunk is whose);
`groups_by_size` cuts a list of tensors into consecutive groups of about `mb` MB, one buffer each.
"""
import torch


class FlatLayout:
    """Tensors end to end in one (padded,) buffer, padded with zeros to a multiple of `world`;
    rank `rank` owns the elements [lo, hi) (chunk = padded / world of them). With world = 1 there is
    no padding and one chunk: the whole buffer. `names` (optional) name the tensors for `pieces`."""

    def __init__(self, tensors, world: int = 1, rank: int = 0, names=None):
        self.names = list(names) if names is not None else [None] * len(tensors)
        self.shapes = [t.shape for t in tensors]
        self.numels = [t.numel() for t in tensors]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)
        self.chunk = -(-self.numel // world)              # ceil(numel / N): elements each rank owns
        self.padded = self.chunk * world                  # ≤ numel + N - 1: the padding is < N elements
        self.lo, self.hi = rank * self.chunk, (rank + 1) * self.chunk

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a (padded,) buffer shaped like the tensors (no copy)."""
        return [flat[off:off + n].view(shape) for off, n, shape in zip(self.offsets, self.numels, self.shapes)]

    def flatten(self, tensors) -> torch.Tensor:
        """The tensors end to end in a new (padded,) buffer; the padding is zero."""
        flat = torch.zeros(self.padded, dtype=tensors[0].dtype, device=tensors[0].device)
        for view, t in zip(self.split(flat), tensors):
            view.copy_(t)
        return flat

    def pieces(self):
        """(name, start, end in my chunk, start, end in the tensor) for each tensor my chunk touches."""
        for name, off, n in zip(self.names, self.offsets, self.numels):
            a, b = max(off, self.lo), min(off + n, self.hi)
            if a < b:
                yield name, a - self.lo, b - self.lo, a - off, b - off


def groups_by_size(named, mb: float) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive (name, tensor) pairs in groups of about `mb` MB: a group closes as soon as it holds
    `mb` MB or more, so every group but the last holds at least `mb` MB (and the last may hold less)."""
    groups, current, size = [], [], 0
    for name, t in named:
        current.append((name, t))
        size += t.numel() * t.element_size()
        if size >= mb * 2**20:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups
