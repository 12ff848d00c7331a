"""A buddy allocator that carves a fixed arena into power-of-two extents.

Why buddy: KV blocks come in a few large, usually power-of-two sizes (one
block of one model is always the same size), so a buddy system wastes little
on them, allocates and frees in O(log n) with plain set operations, and
coalesces freed neighbours without a free-list walk. Small Redis values pay
for rounding up (a 100-byte value takes 128 bytes); INFO reports that loss as
internal fragmentation, and the largest free extent against all free bytes as
external fragmentation.

The arena need not be a power of two: it is cut, greedily from offset 0, into
aligned power-of-two top blocks. A top block's buddy would lie (partly) past
the end, so it is never free and the top block never merges beyond the arena.

The allocator only does arithmetic on offsets; it never touches memory, so the
same class serves the DRAM arena and the GPU tier's device arena.
"""
from __future__ import annotations


class BuddyAllocator:
    """Offsets into an arena of ``capacity`` bytes, in blocks of 2**k bytes."""

    def __init__(self, capacity: int, min_block: int = 64):
        if min_block & (min_block - 1):
            raise ValueError("min_block must be a power of two")
        self.min_order = min_block.bit_length() - 1
        self.capacity = capacity - capacity % min_block
        self.max_order = max(self.capacity.bit_length() - 1, self.min_order)
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._order_of: dict[int, int] = {}   # allocated offset -> order
        self.used = 0                          # bytes handed out, rounded up
        self.requested = 0                     # bytes asked for
        self._carve_top_blocks()

    def _carve_top_blocks(self) -> None:
        offset = 0
        while offset < self.capacity:
            order = (self.capacity - offset).bit_length() - 1
            if offset:
                order = min(order, (offset & -offset).bit_length() - 1)
            self._free[order].add(offset)
            offset += 1 << order

    def order_for(self, size: int) -> int:
        return max(self.min_order, (max(size, 1) - 1).bit_length())

    def block_size(self, offset: int) -> int:
        return 1 << self._order_of[offset]

    def fits(self, size: int) -> bool:
        """Whether a value of ``size`` bytes could ever be placed here."""
        return self.order_for(size) <= self.max_order and (1 << self.order_for(size)) <= self.capacity

    def alloc(self, size: int) -> int | None:
        """Offset of a free extent of at least ``size`` bytes, or None."""
        want = self.order_for(size)
        order = want
        while order <= self.max_order and not self._free[order]:
            order += 1
        if order > self.max_order:
            return None
        offset = self._free[order].pop()
        while order > want:                    # split, keeping the low half
            order -= 1
            self._free[order].add(offset + (1 << order))
        self._order_of[offset] = want
        self.used += 1 << want
        self.requested += size
        return offset

    def free(self, offset: int, size: int) -> None:
        """Return the extent at ``offset`` (``size`` as passed to alloc)."""
        order = self._order_of.pop(offset)
        self.used -= 1 << order
        self.requested -= size
        while order < self.max_order:
            buddy = offset ^ (1 << order)
            peers = self._free[order]
            if buddy not in peers:
                break
            peers.remove(buddy)
            offset = min(offset, buddy)
            order += 1
        self._free[order].add(offset)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        for order in range(self.max_order, -1, -1):
            if self._free[order]:
                return 1 << order
        return 0

    def internal_fragmentation(self) -> float:
        """Share of handed-out bytes lost to rounding up to a power of two."""
        return 1 - self.requested / self.used if self.used else 0.0

    def external_fragmentation(self) -> float:
        """1 - largest free extent / free bytes: 0 when free space is one piece."""
        free = self.free_bytes
        return 1 - self.largest_free() / free if free else 0.0
