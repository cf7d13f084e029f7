"""Who holds which positions: the context-parallel split of one sequence over the cp ranks.

Every CP rank holds S/cp positions of every sequence in its batch rows. Which positions decides how much
attention work each rank does, because attention is causal: a query attends to the keys at or before it.

    contiguous  rank r holds [r·S/cp, (r+1)·S/cp). The last rank's queries see the whole sequence, the
                first rank's only their own chunk: rank r computes r+1 blocks, so the busiest rank does
                cp times the work of the idlest, and every step waits for the busiest.
    zigzag      cut the sequence into 2·cp chunks of c = S/(2cp); rank r holds chunks r and 2cp−1−r, one
                early and one late. Chunk i attends to i+1 chunks, so rank r computes (r+1) + (2cp−r) =
                2cp+1 chunk pairs, the same on every rank.

    S = 8, cp = 2          positions 0 1 2 3 4 5 6 7
    contiguous             rank      0 0 0 0 1 1 1 1
    zigzag (c = 2)         rank      0 0 1 1 1 1 0 0

A rank keeps its chunks in "local order" (chunk r first, then chunk 2cp−1−r): its local tensors are the
concatenation of its chunks, and `positions(rank)` says which global position each local row is, which is
what RoPE and the causal mask need.

The hybrid attention (alltoall_attention.py, all-to-all over groups of K ranks, ring across them) splits at
the group level (`inner` = K): the cp/K groups hold the chunks of a split over cp/K (`outer()`), and the K
ranks of group g cut each of g's chunks into K equal pieces, rank g·K + i taking piece i of each.
"""
from dataclasses import dataclass

import torch

from common.errors import require

SPLITS = ("zigzag", "contiguous")


def n_chunks(cp: int, split: str) -> int:
    """How many equal chunks the sequence is cut into: 2·cp for zigzag, cp for contiguous."""
    return 2 * cp if split == "zigzag" else cp


def check_split(seq_len: int, cp: int, split: str) -> None:
    require(split in SPLITS, f"--cp-split {split} is not one of {', '.join(SPLITS)}")
    require(cp >= 1, f"--cp {cp} must be at least 1")
    n = n_chunks(cp, split)
    if split == "zigzag":
        require(seq_len % n == 0, f"--seq-len {seq_len} does not split into 2·cp = {n} equal chunks for "
                f"--cp-split zigzag with --cp {cp}; use a --seq-len that is a multiple of {n} "
                f"(or --cp-split contiguous: a multiple of {cp})")
    else:
        require(seq_len % n == 0, f"--seq-len {seq_len} does not split into cp = {n} equal chunks for "
                f"--cp-split contiguous with --cp {cp}; use a --seq-len that is a multiple of {n}")


@dataclass(frozen=True)
class Pair:
    """One (query chunk, key chunk) pair that attention computes: the local rows of each in their rank's
    tensors, and whether the causal mask cuts through it (it does only where the chunks overlap)."""
    q_rows: slice                   # rows of the query rank's local (.., S/cp, hd) tensors
    k_rows: slice                   # rows of the key rank's local tensors
    mask: torch.Tensor | None       # (len_q, len_k) bool, True where the key comes after the query


@dataclass(frozen=True)
class SequenceSplit:
    """The whole CP group's split of one sequence of `seq_len` positions."""
    seq_len: int
    cp: int
    split: str
    inner: int = 1      # the hybrid's all-to-all degree K: the cp/K groups split, their K ranks cut further

    def __post_init__(self):
        check_split(self.seq_len, self.cp, self.split)
        require(self.cp % self.inner == 0, f"--cp-alltoall {self.inner} must divide --cp {self.cp}; use a "
                f"divisor of {self.cp}")

    def outer(self) -> "SequenceSplit":
        """The split over the cp/K groups of the hybrid (alltoall_attention.py): group g holds what rank g
        of this split would, and its ring runs over this split."""
        return SequenceSplit(self.seq_len, self.cp // self.inner, self.split)

    def chunks(self, rank: int) -> list[tuple[int, int]]:
        """The [start, stop) chunks cp rank `rank` holds, in local order. With `inner` K > 1, rank r holds
        piece r mod K of each chunk of its group r // K (a chunk cut into K equal pieces)."""
        if self.inner > 1:
            i, K = rank % self.inner, self.inner
            return [(a + i * (b - a) // K, a + (i + 1) * (b - a) // K) for a, b in self.outer().chunks(rank // K)]
        c = self.seq_len // n_chunks(self.cp, self.split)
        if self.split == "contiguous":
            return [(rank * c, (rank + 1) * c)]
        # >>> exercise 06.zigzag
        late = 2 * self.cp - 1 - rank
        return [(rank * c, (rank + 1) * c), (late * c, (late + 1) * c)]
        # <<< exercise 06.zigzag

    def positions(self, rank: int) -> torch.Tensor:
        """(S/cp,) long: the global position of each of this rank's local rows."""
        return torch.cat([torch.arange(a, b) for a, b in self.chunks(rank)])

    def take(self, t: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """This rank's positions of a full-sequence tensor `t` (sequence along `dim`), in local order."""
        return torch.cat([t.narrow(dim, a, b - a) for a, b in self.chunks(rank)], dim=dim)

    def pairs(self, q_rank: int, k_rank: int) -> list[Pair]:
        """The chunk pairs that q_rank's queries compute against k_rank's keys, by global position:
        a pair whose keys all come after its queries is skipped (the causal mask would zero all of it);
        a pair whose keys all come at or before its queries is computed whole; the rest (a chunk against
        itself, chunks being aligned) is computed whole and masked."""
        out = []
        for qa, qb, q_rows in _local_rows(self.chunks(q_rank)):
            for ka, kb, k_rows in _local_rows(self.chunks(k_rank)):
                if ka >= qb:                                # every key after every query: skip
                    continue
                mask = None
                if kb - 1 > qa:                             # some key after some query: mask
                    mask = torch.arange(ka, kb)[None, :] > torch.arange(qa, qb)[:, None]
                out.append(Pair(q_rows, k_rows, mask))
        return out

    def work(self, rank: int) -> int:
        """Score entries one attention (one head, one sequence row, forward) computes on this rank: every
        pair of its queries with any rank's keys that is not skipped, len_q·len_k each."""
        return sum((p.q_rows.stop - p.q_rows.start) * (p.k_rows.stop - p.k_rows.start)
                   for k_rank in range(self.cp) for p in self.pairs(rank, k_rank))


def _local_rows(chunks: list[tuple[int, int]]):
    """Each chunk's global [start, stop) with the slice of local rows it occupies."""
    row = 0
    for a, b in chunks:
        yield a, b, slice(row, row + b - a)
        row += b - a
