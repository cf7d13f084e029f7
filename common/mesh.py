"""The device mesh by hand: the rank grid as one tensor, and a process group per line of it.

With dp × pp × tp = world ranks, the grid is `torch.arange(world).view(dp, pp, tp)`. TP is the last
(fastest-varying) dimension, so the ranks of one TP group are consecutive numbers: on a node of 8 GPUs
they sit inside the node, where the links are fastest, because TP communicates in every layer.

A rank's coordinates are where its number sits in the grid. Its group along a dimension is the line
of the grid through it along that dimension, e.g. its TP group is grid[d, p, :].

A *joined* dimension reads several dimensions as one (DeviceMesh calls it flattening). Chapter
05's 4D run splits the data-parallel dimension in two, `arange(world).view(dp/ep, ep, pp, tp)`:
"ep" (the ranks that share their experts) and "edp" (the ranks holding the same experts), while
`joined={"dp": ("edp", "ep")}` keeps "dp", the whole data-parallel group, with the same ranks and
coordinates (d = edp·ep + ep) as the grid `view(dp, pp, tp)`. The parts need not be neighbours:
chapter 06 sums gradients over `dp_cp = ("edp", "ep", "cp")` of the grid (edp, ep, pp, cp, tp), the
ranks that differ only in those coordinates, numbered in grid order.
"""
import itertools

import torch
import torch.distributed as dist

from common.errors import require


class Mesh:
    """Process groups for named dimensions, ordered outermost first (default: dp, pp, tp)."""

    def __init__(self, rank: int, world_size: int, joined: dict | None = None, **sizes: int):
        dims = tuple(sizes)
        shape = tuple(sizes.values())
        require(all(s >= 1 for s in shape), f"every degree must be ≥ 1, got {sizes}")
        product = 1
        for s in shape:
            product *= s
        require(product == world_size,
                f"the degrees {' × '.join(f'{d}={s}' for d, s in sizes.items())} = {product} must multiply to "
                f"the world size {world_size}; change the degrees or launch with --nproc_per_node={product}")
        self.dims, self.shape, self.rank = dims, shape, rank
        self.grid = torch.arange(world_size).view(*shape)                      # (dp, pp, tp)
        here = (self.grid == rank).nonzero()[0].tolist()
        self.coords = dict(zip(dims, here))                                    # e.g. {"dp": 1, "pp": 0, "tp": 1}
        self.joined = dict(joined or {})                                       # e.g. {"dp": ("edp", "ep")}
        for name, parts in self.joined.items():
            at = [dims.index(d) for d in parts]
            require(at == sorted(at), f"joined dimension {name}: {parts} must be in the grid's order {dims}")
        self.groups, self.group_ranks = {}, {}
        for dim in dims + tuple(self.joined):
            # Every rank must call new_group for every group, in the same order, even for groups it
            # is not part of: that is the rule of torch.distributed.new_group.
            for line in self.lines(dim):
                group = dist.new_group(line) if world_size > 1 else dist.group.WORLD
                if rank in line:
                    self.groups[dim], self.group_ranks[dim] = group, line
        for name in self.joined:                                               # d = edp·ep + ep
            self.coords[name] = self.group_ranks[name].index(rank)

    def lines(self, dim: int | str) -> list[list[int]]:
        """All lines of the grid along a dimension (its index or name, joined names too), as lists of ranks."""
        names = self.joined.get(dim, (dim,)) if isinstance(dim, str) else (self.dims[dim],)
        at = [self.dims.index(d) for d in names]
        moved = self.grid.movedim(at, list(range(-len(at), 0))).flatten(-len(at))   # (others..., size)
        return [row.tolist() for row in moved.reshape(-1, moved.shape[-1])]

    def size(self, dim: str) -> int:
        size = 1
        for d in self.joined.get(dim, (dim,)):
            size *= self.shape[self.dims.index(d)]
        return size

    def coord(self, dim: str) -> int:
        return self.coords[dim]

    def group(self, dim: str):
        return self.groups[dim]

    def describe(self) -> str:
        """The grid as text: one row per (outer coordinates), one cell per rank."""
        rows = []
        outer = self.dims[:-1]
        for idx in itertools.product(*(range(s) for s in self.shape[:-1])):
            label = " ".join(f"{d}={c}" for d, c in zip(outer, idx))
            cells = "  ".join(f"rank {r:>2}" for r in self.grid[idx].tolist())
            rows.append(f"{label:<14} | {self.dims[-1]} 0..{self.shape[-1] - 1}: {cells}")
        return "\n".join(rows)

    def rank_rows(self) -> list[dict]:
        """For every rank: its coordinates and the ranks of each of its groups (for printing)."""
        rows = []
        for r in range(self.grid.numel()):
            where = (self.grid == r).nonzero()[0].tolist()
            row = {"rank": r, **{d: c for d, c in zip(self.dims, where)}}
            for d in self.dims + tuple(self.joined):
                row[f"{d} group"] = next(line for line in self.lines(d) if r in line)
            for d in self.joined:
                row[d] = row[f"{d} group"].index(r)
            rows.append(row)
        return rows

