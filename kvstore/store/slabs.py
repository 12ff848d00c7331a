"""Size classes over the buddy allocator: small values packed in pages of their own class.

Why: with one buddy tree for every size, 100-byte values land all over the
arena, and a 1 MiB extent is free only when every small value inside some
1 MiB region is gone; making room for one big value then evicts nearly every
small one. Here the arena is carved by the buddy allocator into *pages*
(1 MiB, smaller in a small arena) and into big extents (a value of a page or
more: a power-of-two run of pages). A value smaller than a page lives in a
*slab page* of its size class (power-of-two classes from 64 bytes, the same
rounding as before, so an in-place rewrite still fits when the class is the
same), as in memcached. A page holds one class; a page whose last value goes
returns to the buddy tree at once, so pages flow between classes and to big
values as the mix changes, and the whole budget stays usable by any size.

Every byte of the arena is one of: a free buddy chunk, a slab page (its free
slots are the class's slack), or a big extent. The allocator keeps, per slot
of a slab page and per page of a big extent, the entry that owns it (a hint
the engine sets at commit and checks before use): the engine's eviction can
then list what lives in any region it considers freeing (kvstore/store/engine.py).

The fence: while the engine clears a region for one write, nothing else is
placed in it (no new page, no slot of a page inside it, no big extent).
"""
from __future__ import annotations

from array import array

import numpy as np

from kvstore.store.allocator import BuddyAllocator

PAGE = 1 << 20                  # slab page size (smaller for arenas under 16 pages)
FREE, UNOWNED = -1, -2          # owner hints: free slot; allocated, no committed owner yet


class SlabAllocator:
    """Offsets into an arena: slots of slab pages below ``page`` bytes, buddy extents above."""

    def __init__(self, capacity: int, min_chunk: int = 64, page: int = PAGE):
        order = page.bit_length() - 1
        while order > min_chunk.bit_length() and (1 << order) * 16 > capacity:
            order -= 1                  # at least 16 pages, so classes can trade pages
        self.page_order = order
        self.page = 1 << order
        capacity -= capacity % self.page
        self.buddy = BuddyAllocator(capacity, min_chunk, quick=False)
        self.capacity = self.buddy.capacity
        self.min_order = self.buddy.min_order
        self.max_order = self.buddy.max_order
        pages = self.capacity >> order
        self.page_class = array("b", [-1]) * pages      # class order of a slab page, else -1
        self.page_live = array("I", [0]) * pages        # values in a slab page
        self._bump = array("I", [0]) * pages            # slots of a slab page ever handed out
        self._slack: dict[int, list[int]] = {}          # slab page -> freed slot numbers
        self.owners: dict[int, np.ndarray] = {}         # slab page -> owner hint per slot
        self.big_owner = np.full(max(pages, 1), FREE, dtype=np.int32)   # owner hint per page of big extents
        self._partial: list[dict[int, None]] = [{} for _ in range(order)]   # class -> pages with room
        self.used = 0                   # bytes handed out, rounded up to the class
        self.requested = 0              # bytes asked for
        self.footprint = 0              # bytes of slab pages and big extents: what counts against a limit
        self.slab_pages = [0] * order   # pages per class
        self.largest_order = 0          # the largest size class asked for so far

    # ------------------------------------------------------------ sizes

    def order_for(self, size: int) -> int:
        return self.buddy.order_for(size)

    def chunk_size(self, size: int) -> int:
        return 1 << self.order_for(size)

    def fits(self, size: int) -> bool:
        return self.buddy.fits(size)

    def is_small(self, order: int) -> bool:
        return order < self.page_order

    @property
    def fences(self) -> list[tuple[int, int]]:
        """Regions being cleared: nothing new is placed in them."""
        return self.buddy.fences

    # ------------------------------------------------------------ alloc and free

    def alloc(self, size: int, limit: int | None = None, fenced_ok: bool = False) -> int | None:
        """Offset of ``size`` free bytes, or None; a new page or big extent only while the
        footprint stays within ``limit``."""
        order = self.order_for(size)
        if order > self.largest_order:
            self.largest_order = order
        if order < self.page_order:
            offset = self._alloc_slot(order, limit, fenced_ok)
            if offset is None:
                return None
        else:
            chunk = 1 << order
            if limit is not None and self.footprint + chunk > limit:
                return None
            offset = self.buddy.alloc(chunk, fenced_ok)
            if offset is None:
                return None
            self.footprint += chunk
            first = offset >> self.page_order
            self.big_owner[first:first + (chunk >> self.page_order)] = UNOWNED
        self.used += 1 << order
        self.requested += size
        return offset

    def _alloc_slot(self, order: int, limit: int | None, fenced_ok: bool) -> int | None:
        page = self._page_with_room(order, fenced_ok)
        if page is None:
            if limit is not None and self.footprint + self.page > limit:
                return None
            start = self.buddy.alloc(self.page, fenced_ok)
            if start is None:
                return None
            page = start >> self.page_order
            self._open_page(page, order)
        slack = self._slack.get(page)
        if slack:
            slot = slack.pop()
        else:
            slot = self._bump[page]
            self._bump[page] = slot + 1
        live = self.page_live[page] + 1
        self.page_live[page] = live
        if live == self.page >> order:
            del self._partial[order][page]
        self.owners[page][slot] = UNOWNED
        return (page << self.page_order) | (slot << order)

    def _page_with_room(self, order: int, fenced_ok: bool) -> int | None:
        partial = self._partial[order]
        fences = None if fenced_ok else self.buddy.fences
        for page in partial:
            if not fences or all(not lo <= page << self.page_order < hi for lo, hi in fences):
                return page
        return None

    def _open_page(self, page: int, order: int) -> None:
        self.footprint += self.page
        self.page_class[page] = order
        self.page_live[page] = 0
        self._bump[page] = 0
        self.owners[page] = np.full(self.page >> order, FREE, dtype=np.int32)
        self._partial[order][page] = None
        self.slab_pages[order] += 1

    def free(self, offset: int, size: int) -> None:
        """Give back the extent at ``offset`` (``size`` as passed to alloc)."""
        order = self.order_for(size)
        self.used -= 1 << order
        self.requested -= size
        if order >= self.page_order:
            chunk = 1 << order
            first = offset >> self.page_order
            self.big_owner[first:first + (chunk >> self.page_order)] = FREE
            self.footprint -= chunk
            self.buddy.free(offset, chunk)
            return
        page = offset >> self.page_order
        slot = (offset & (self.page - 1)) >> order
        self.owners[page][slot] = FREE
        live = self.page_live[page] - 1
        self.page_live[page] = live
        if not live:                    # the page goes back to the tree, for any class or a big value
            self._partial[order].pop(page, None)
            self._slack.pop(page, None)
            del self.owners[page]
            self.page_class[page] = -1
            self.slab_pages[order] -= 1
            self.footprint -= self.page
            self.buddy.free(page << self.page_order, self.page)
            return
        self._slack.setdefault(page, []).append(slot)
        self._partial[order][page] = None

    # ------------------------------------------------------------ owners

    def set_owner(self, offset: int, size: int, entry: int) -> None:
        """``entry`` is the value at ``offset`` (a hint: the engine checks it before use)."""
        order = self.order_for(size)
        page = offset >> self.page_order
        if order < self.page_order:
            owners = self.owners.get(page)
            if owners is not None:
                owners[(offset & (self.page - 1)) >> order] = entry
        else:
            self.big_owner[page:page + (1 << (order - self.page_order))] = entry

    def region_owners(self, offset: int, order: int) -> np.ndarray:
        """The owner hints of every allocated piece in the region (``offset``, ``order``),
        each once: entries, UNOWNED for pieces no committed value owns (never evictable)."""
        first = offset >> self.page_order
        count = max(1, 1 << (order - self.page_order)) if order >= self.page_order else 1
        parts = []
        for page in range(first, first + count):
            owners = self.owners.get(page)
            if owners is not None:
                parts.append(owners[owners != FREE])
        big = self.big_owner[first:first + count]
        big = big[big != FREE]
        if len(big):
            parts.append(np.unique(big))        # a big extent spans several pages
        if not parts:
            return big
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    # ------------------------------------------------------------ reporting

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def owner_bytes(self) -> int:
        """Bytes of the owner hints (4 per slot of a slab page, 4 per page)."""
        return sum(owners.nbytes for owners in self.owners.values()) + self.big_owner.nbytes

    def slack_bytes(self, below: int | None = None) -> int:
        """Free slots inside slab pages (of classes under ``below`` bytes): held by a
        class, usable only by its own sizes."""
        return sum(((self.page >> order) - self.page_live[page]) << order
                   for order, pages in enumerate(self._partial) if below is None or (1 << order) < below
                   for page in pages)

    def largest_free(self) -> int:
        """The largest extent one allocation could get without eviction."""
        counts = self.buddy.free_by_order()
        for order in range(len(counts) - 1, -1, -1):
            if counts[order]:
                return 1 << order
        return self.page if any(self._partial) else 0

    def fragmented_bytes(self, largest_class: int) -> int:
        """Free bytes in pieces smaller than ``largest_class`` bytes: slab slack and small
        buddy chunks (what a value of that class cannot use without eviction)."""
        counts = self.buddy.free_by_order()
        small = sum(n << order for order, n in enumerate(counts) if (1 << order) < largest_class)
        return small + self.slack_bytes(largest_class)

    def internal_fragmentation(self) -> float:
        return 1 - self.requested / self.used if self.used else 0.0

    def external_fragmentation(self) -> float:
        free = self.free_bytes
        return 1 - self.largest_free() / free if free else 0.0
