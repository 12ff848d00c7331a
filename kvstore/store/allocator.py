"""A buddy allocator that carves a fixed arena into power-of-two extents.

Why buddy: KV blocks come in a few large, usually power-of-two sizes (one
block of one model is always the same size), so a buddy system wastes little
on them, allocates and frees in O(log n) with plain set operations, and
coalesces freed neighbours without a free-list walk. Small Redis values pay
for rounding up (a 100-byte value takes 128 bytes); INFO reports that loss as
internal fragmentation, and the largest free extent against all free bytes as
external fragmentation.

The arena need not be a power of two: it is cut, greedily from offset 0, into
aligned power-of-two top chunks. A top chunk's buddy would lie (partly) past
the end, so it is never free and the top chunk never merges beyond the arena.

The allocator only does arithmetic on offsets; it never touches memory, so the
same class serves the DRAM arena and the GPU tier's device arena.
"""
from __future__ import annotations


QUICK_MAX_ORDER = 16      # chunks up to 64 KiB are recycled through quick lists
QUICK_LIMIT = 4096        # most chunks one quick list holds


class BuddyAllocator:
    """Offsets into an arena of ``capacity`` bytes, in chunks of 2**k bytes.

    Freed small chunks first go to a per-order quick list (a plain Python
    list: pop and append cost tens of nanoseconds), as a slab allocator's
    free list would; they are merged back into the buddy tree only when an
    allocation could not be served otherwise. The caller passes the size on
    ``free`` (it keeps it anyway), so no per-allocation record is kept here.
    """

    def __init__(self, capacity: int, min_chunk: int = 64, quick: bool = True):
        if min_chunk & (min_chunk - 1):
            raise ValueError("min_chunk must be a power of two")
        self.min_order = min_chunk.bit_length() - 1
        self.capacity = capacity - capacity % min_chunk
        self.max_order = max(self.capacity.bit_length() - 1, self.min_order)
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._quick: list[list[int]] = [[] for _ in range(min(QUICK_MAX_ORDER, self.max_order) + 1)] \
            if quick else []
        self.fences: list[tuple[int, int]] = []       # [lo, hi): no chunk overlapping one is handed out
        self.used = 0                          # bytes handed out, rounded up
        self.requested = 0                     # bytes asked for
        self._carve_top_chunks()

    def _carve_top_chunks(self) -> None:
        offset = 0
        while offset < self.capacity:
            order = (self.capacity - offset).bit_length() - 1
            if offset:
                order = min(order, (offset & -offset).bit_length() - 1)
            self._free[order].add(offset)
            offset += 1 << order

    def order_for(self, size: int) -> int:
        order = (size - 1).bit_length() if size > 1 else 0
        return order if order > self.min_order else self.min_order

    def chunk_size(self, size: int) -> int:
        """Bytes a value of ``size`` bytes occupies."""
        return 1 << self.order_for(size)

    def fits(self, size: int) -> bool:
        """Whether a value of ``size`` bytes could ever be placed here."""
        order = self.order_for(size)
        return order <= self.max_order and (1 << order) <= self.capacity

    def alloc(self, size: int, fenced_ok: bool = False) -> int | None:
        """Offset of a free extent of at least ``size`` bytes, or None.

        Outside ``fence`` unless ``fenced_ok`` (the fence is a region being
        cleared for one write, which alone may take it).
        """
        want = self.order_for(size)
        if want < len(self._quick) and self._quick[want] and not self.fences:
            offset = self._quick[want].pop()
        else:
            offset = self._split_from_tree(want, fenced_ok)
            if offset is None and self._drain_quick():
                offset = self._split_from_tree(want, fenced_ok)
            if offset is None:
                return None
        self.used += 1 << want
        self.requested += size
        return offset

    def _split_from_tree(self, want: int, fenced_ok: bool = False) -> int | None:
        fences = None if fenced_ok else self.fences
        order = want
        while order <= self.max_order:
            if self._free[order]:
                if not fences:
                    offset = self._free[order].pop()
                    break
                offset = self._unfenced(order, fences)
                if offset is not None:
                    self._free[order].remove(offset)
                    break
            order += 1
        if order > self.max_order:
            return None
        while order > want:                    # split, keeping the low half
            order -= 1
            self._free[order].add(offset + (1 << order))
        return offset

    def _unfenced(self, order: int, fences: list[tuple[int, int]]) -> int | None:
        """A free chunk of ``order`` that overlaps no fence (few chunks lie inside one)."""
        size = 1 << order
        for offset in self._free[order]:
            if all(offset >= hi or offset + size <= lo for lo, hi in fences):
                return offset
        return None

    def is_free(self, offset: int, order: int) -> bool:
        """Whether the aligned extent (``offset``, ``order``) is one free chunk (or inside one)."""
        for bigger in range(order, self.max_order + 1):
            if (offset & ~((1 << bigger) - 1)) in self._free[bigger]:
                return True
        return False

    def free_by_order(self) -> list[int]:
        """Free chunks per order (quick-listed ones as they are, unmerged)."""
        counts = [len(chunks) for chunks in self._free]
        for order, chunks in enumerate(self._quick):
            counts[order] += len(chunks)
        return counts

    def free(self, offset: int, size: int) -> None:
        """Return the extent at ``offset`` (``size`` as passed to alloc)."""
        order = self.order_for(size)
        self.used -= 1 << order
        self.requested -= size
        if order < len(self._quick) and len(self._quick[order]) < QUICK_LIMIT:
            self._quick[order].append(offset)
        else:
            self._merge_into_tree(offset, order)

    def _merge_into_tree(self, offset: int, order: int) -> None:
        merge_into(self._free, offset, order, self.max_order)

    def _drain_quick(self) -> bool:
        """Merge every quick-listed chunk back into the tree; True if there were any."""
        drained = False
        for order, chunks in enumerate(self._quick):
            for offset in chunks:
                self._merge_into_tree(offset, order)
            drained = drained or bool(chunks)
            chunks.clear()
        return drained

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        """The largest extent one allocation could get without eviction.

        Quick-listed chunks count as merged, as they would be on demand (the
        merge is simulated on a copy: this runs for INFO, not per request).
        """
        free = [set(chunks) for chunks in self._free]
        for order, chunks in enumerate(self._quick):
            for offset in chunks:
                merge_into(free, offset, order, self.max_order)
        for order in range(self.max_order, -1, -1):
            if free[order]:
                return 1 << order
        return 0

    def internal_fragmentation(self) -> float:
        """Share of handed-out bytes lost to rounding up to a power of two."""
        return 1 - self.requested / self.used if self.used else 0.0

    def external_fragmentation(self) -> float:
        """1 - largest free extent / free bytes: 0 when free space is one piece."""
        free = self.free_bytes
        return 1 - self.largest_free() / free if free else 0.0


def merge_into(free: list[set[int]], offset: int, order: int, max_order: int) -> None:
    """Add the free chunk (``offset``, ``order``) to ``free``, coalescing it with free buddies.

    One function for the real tree and for the copy ``largest_free`` merges
    into, so both climb the orders the same way.
    """
    while order < max_order:
        buddy = offset ^ (1 << order)
        peers = free[order]
        if buddy not in peers:
            break
        peers.remove(buddy)
        offset = min(offset, buddy)
        order += 1
    free[order].add(offset)
