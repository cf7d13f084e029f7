"""What a GPU reserves for a step's tensors: PyTorch's CUDA caching allocator, as a model.

`torch.cuda.max_memory_reserved()` (what torchtitan and most trainers report) is not the tensors' peak: the
allocator takes memory from the device in large pieces and keeps it, handing out blocks of it. A freed block
stays reserved, cached for a later request that fits in it; a request that fits in no cached block takes
more from the device even while the cache holds enough bytes in pieces too small. Reserved = the tensors
+ what the cache holds around them. Its rules, as PyTorch's allocator applies them (c10/cuda's
CUDACachingAllocator; its documentation, "CUDA semantics: memory management" and PYTORCH_CUDA_ALLOC_CONF):

    sizes      every request rounded up to a multiple of 512 bytes
    pools      requests of at most 1 MiB from the small pool, larger ones from the large pool; each stream
               has its own of both (a block freed on one stream is not handed to another)
    best fit   a request takes the smallest cached free block of its pool that holds it; the rest of the
               block is split off as a free block if it is at least 512 bytes (small pool) or more than
               1 MiB (large pool), else handed out with it
    coalesce   a freed block merges with free neighbours of its segment
    segments   (the default) when no cached block fits, a new segment from the device: 2 MiB for a small
               request, 20 MiB for one under 10 MiB, else the request rounded up to 2 MiB. Segments never merge.
    expandable (expandable_segments:True, as torchtitan runs) one segment per pool that grows at its end
               in pages (2 MiB small, 20 MiB large); a request that fits no free block extends the
               segment, reusing a free block at its end. A hole below the end is reused only by what fits.

Reserved never shrinks here: the allocator returns memory to the device only on empty_cache() or when the
device is full, and a step that fits does neither. What the model leaves out: blocks a stream still uses
after another freed them (record_stream: FSDP2 avoids it), the oversize-block rules of max_split_size_mb
(off by default), and CUDA graphs' private pools.
"""
import bisect
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL = 1 << 20                 # the largest small request
SMALL_PAGE = 2 << 20            # a small segment; an expandable small segment's page
LARGE_PAGE = 20 << 20           # a segment for a request under MIN_LARGE_ALLOC; an expandable large page
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def rounded(nbytes: int) -> int:
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_bytes(size: int) -> int:
    """A new (non-expandable) segment for a request of `size` rounded bytes."""
    if size <= SMALL:
        return SMALL_PAGE
    return LARGE_PAGE if size < MIN_LARGE_ALLOC else -(-size // ROUND_LARGE) * ROUND_LARGE


def splits(small: bool, remaining: int) -> bool:
    return remaining >= MIN_BLOCK if small else remaining > SMALL


@dataclass(eq=False)
class Block:
    segment: int
    offset: int
    size: int
    free: bool = True
    before: "Block | None" = None        # its neighbours in its segment, by address
    after: "Block | None" = None

    def key(self):
        return self.size, self.segment, self.offset


@dataclass
class Pool:
    """One stream's small or large pool: its segments (each a chain of blocks by address, its last one
    kept) and its free blocks ordered by size, then address."""
    small: bool
    expandable: bool
    last: list = field(default_factory=list)           # each segment's last block
    free: list = field(default_factory=list)           # Block.key() of every free block, sorted
    blocks: dict = field(default_factory=dict)         # (segment, offset) -> its block
    reserved: int = 0

    def take(self, size: int) -> Block:
        i = bisect.bisect_left(self.free, (size, -1, -1))
        block = self.blocks[self.free.pop(i)[1:]] if i < len(self.free) else self._grow(size)
        block.free = False
        if splits(self.small, block.size - size):
            rest = Block(block.segment, block.offset + size, block.size - size, before=block, after=block.after)
            if block.after:
                block.after.before = rest
            else:
                self.last[block.segment] = rest
            block.after, block.size = rest, size
            self._add_free(rest)
        return block

    def _grow(self, size: int) -> Block:
        """More memory from the device for a request no free block holds."""
        if not self.expandable or not self.last:
            grow = segment_bytes(size) if not self.expandable else self._pages(size)
            block = Block(len(self.last), 0, grow)
            self.last.append(block)
        else:                                           # one segment: its end grows by pages
            end = self.last[0]
            have = end.size if end.free else 0
            grow = self._pages(size - have)
            if end.free:                                # the free block at the end grows into them
                self.free.remove(end.key())
                end.size += grow
                block = end
            else:
                block = Block(0, end.offset + end.size, grow, before=end)
                end.after = self.last[0] = block
        self.reserved += grow
        self.blocks[block.segment, block.offset] = block
        return block

    def _pages(self, size: int) -> int:
        page = SMALL_PAGE if self.small else LARGE_PAGE
        return -(-size // page) * page

    def _add_free(self, block: Block):
        block.free = True
        self.blocks[block.segment, block.offset] = block
        bisect.insort(self.free, block.key())

    def give_back(self, block: Block):
        """A freed block, merged with its free neighbours."""
        for other in (block.after, block.before):
            if other is not None and other.free:
                self.free.remove(other.key())
                first, second = (block, other) if other is block.after else (other, block)
                del self.blocks[second.segment, second.offset]
                first.size += second.size
                first.after = second.after
                if second.after:
                    second.after.before = first
                else:
                    self.last[first.segment] = first
                block = first
        self._add_free(block)


def reserved_peak(events, expandable: bool) -> int:
    """The most bytes the allocator holds from the device along `events` (allocation_trace.Event)."""
    return peak_moment(events, expandable)["reserved"]


def peak_moment(events, expandable: bool) -> dict:
    """The moment the allocator holds the most along `events`: {"reserved": its bytes, "request": the
    allocation that took them, "pools": {(stream, "small" | "large"): (reserved, of it free)}, "largest free":
    the largest free block then}."""
    pools, held, peak = {}, {}, {"reserved": 0}
    for e in events:
        if e.kind == "alloc":
            size = rounded(e.nbytes)
            pool = pools.setdefault((e.stream, "small" if size <= SMALL else "large"), Pool(size <= SMALL, expandable))
            held[e.key] = (pool, pool.take(size))
            if sum(p.reserved for p in pools.values()) > peak["reserved"]:
                peak = {"reserved": sum(p.reserved for p in pools.values()), "request": e.nbytes,
                        "pools": {k: (p.reserved, sum(f[0] for f in p.free)) for k, p in pools.items()},
                        "largest free": max((f[0] for p in pools.values() for f in p.free), default=0)}
        else:
            pool, block = held.pop(e.key)
            pool.give_back(block)
    return peak
