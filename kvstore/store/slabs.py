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

PAGE = 1 << 16                  # slab page size (smaller for arenas under 16 pages)
FINE_UP_TO = 512                # classes every 64 bytes up to here, then four per doubling
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
        self.unit = 1 << self.min_order
        self.class_size = self._class_sizes()           # slot bytes per small class
        self.small_classes = len(self.class_size)
        self.classes = self.small_classes + 40          # then one per buddy order of big extents
        table = bytearray(self.page // 2 // self.unit)  # (size - 1) // unit -> small class
        cls = 0
        for i in range(len(table)):
            while self.class_size[cls] < (i + 1) * self.unit:
                cls += 1
            table[i] = cls
        self._class_table = bytes(table)
        pages = self.capacity >> order
        self.page_class = array("b", [-1]) * pages      # class of a slab page, else -1
        self.page_live = array("I", [0]) * pages        # values in a slab page
        self._bump = array("I", [0]) * pages            # slots of a slab page ever handed out
        self._slack: dict[int, list[int]] = {}          # slab page -> freed slot numbers
        self.owners: dict[int, np.ndarray] = {}         # slab page -> owner hint per slot
        self.big_owner = np.full(max(pages, 1), FREE, dtype=np.int32)   # owner hint per page of big extents
        self._partial: list[dict[int, None]] = [{} for _ in self.class_size]   # class -> pages with room
        self.used = 0                   # bytes handed out, rounded up to the class
        self.requested = 0              # bytes asked for
        self.footprint = 0              # bytes of slab pages and big extents: what counts against a limit
        self.slab_pages = [0] * self.small_classes      # pages per class
        self.largest_chunk = 0          # the largest rounded size asked for so far

    def _class_sizes(self) -> list[int]:
        sizes, size = [], self.unit
        while size <= min(FINE_UP_TO, self.page // 2):
            sizes.append(size)
            size += self.unit
        base = sizes[-1]
        while base < self.page // 2:
            for quarter in (5, 6, 7, 8):
                size = base * quarter // 4 // self.unit * self.unit
                if size <= self.page // 2 and size > sizes[-1]:
                    sizes.append(size)
            base *= 2
        return sizes

    # ------------------------------------------------------------ sizes

    def class_of(self, size: int) -> int:
        """The size class of a value: a slab class, or small_classes + its chunk's order."""
        if size <= self.page // 2:
            return self._class_table[(size - 1) // self.unit] if size > 0 else 0
        return self.small_classes + self.order_for(size)

    def is_big(self, cls: int) -> bool:
        return cls >= self.small_classes

    def order_for(self, size: int) -> int:
        """The buddy order of the aligned chunk a value is carved from (its region's size)."""
        return self.buddy.order_for(size)

    def chunk_size(self, size: int) -> int:
        """Bytes a value of ``size`` bytes occupies: its slot, or its whole pages."""
        if size <= self.page // 2:
            return self.class_size[self._class_table[(size - 1) // self.unit] if size > 0 else 0]
        return -(-size // self.page) * self.page

    def fits(self, size: int) -> bool:
        return self.buddy.fits(size)

    @property
    def fences(self) -> list[tuple[int, int]]:
        """Regions being cleared: nothing new is placed in them."""
        return self.buddy.fences

    # ------------------------------------------------------------ alloc and free

    def alloc(self, size: int, limit: int | None = None, fenced_ok: bool = False, runs: bool = True) -> int | None:
        """Offset of ``size`` free bytes, or None; a new page or big extent only while the
        footprint stays within ``limit``. A big value with no aligned chunk free takes a run
        of adjacent free chunks when ``runs`` (a scan of the free chunks: not per eviction)."""
        if size <= self.page // 2:
            cls = self._class_table[(size - 1) // self.unit] if size > 0 else 0
            chunk = self.class_size[cls]
            offset = self._alloc_slot(cls, chunk, limit, fenced_ok)
            if offset is None:
                return None
        else:
            chunk = -(-size // self.page) * self.page
            if limit is not None and self.footprint + chunk > limit:
                return None
            whole = 1 << self.order_for(size)
            offset = self.buddy.alloc(whole, fenced_ok)
            if offset is not None:
                self._give_back(offset + chunk, offset + whole)     # the tail pages it does not need
            elif runs:
                offset = self._alloc_run(chunk, fenced_ok)
            if offset is None:
                return None
            self._hand_out_big(offset, chunk)
        self._count(size, chunk)
        return offset

    def take(self, lo: int, size: int, limit: int | None = None) -> int | None:
        """Hand out the free pages from ``lo`` for a big value of ``size`` bytes (a window
        the engine cleared for it: kvstore/store/room.py); None if they are not all free or
        the footprint would pass ``limit``."""
        chunk = self.chunk_size(size)
        if not self.window_free(lo, lo + chunk) or (limit is not None and self.footprint + chunk > limit):
            return None
        self._carve(lo, lo + chunk)
        self._hand_out_big(lo, chunk)
        self._count(size, chunk)
        return lo

    def _hand_out_big(self, offset: int, chunk: int) -> None:
        self.footprint += chunk
        first = offset >> self.page_order
        self.big_owner[first:first + (chunk >> self.page_order)] = UNOWNED

    def _count(self, size: int, chunk: int) -> None:
        if chunk > self.largest_chunk:
            self.largest_chunk = chunk
        self.used += chunk
        self.requested += size

    def _alloc_run(self, chunk: int, fenced_ok: bool) -> int | None:
        """The start of the shortest run of adjacent free chunks (of a page or more) that holds
        ``chunk`` bytes, carved out of the tree (the rest of the run stays free); None if none."""
        free, fences = self.buddy._free, [] if fenced_ok else self.buddy.fences
        pieces = sorted((offset, order) for order in range(self.page_order, len(free)) for offset in free[order])
        best, start, end = None, 0, -1
        for offset, order in pieces + [(-1, 0)]:
            if offset == end:
                end += 1 << order
                continue
            if end - start >= chunk and (best is None or end - start < best[1] - best[0]) \
                    and not any(start < hi and lo < start + chunk for lo, hi in fences):
                best = (start, end)
            start, end = offset, offset + (1 << order)
        if best is None:
            return None
        self._carve(best[0], best[0] + chunk)
        return best[0]

    def _carve(self, lo: int, hi: int) -> None:
        """Take the free pages [lo, hi) out of the buddy tree: each free chunk overlapping
        them leaves the tree, and its parts outside go back."""
        buddy, page = self.buddy, lo
        while page < hi:
            for order in range(self.page_order, self.max_order + 1):
                offset = page & ~((1 << order) - 1)
                if offset in buddy._free[order]:
                    break
            else:
                raise AssertionError(f"page {page} is not free")
            buddy._free[order].remove(offset)
            buddy.used += 1 << order
            end = offset + (1 << order)
            if offset < lo:
                self._give_back(offset, lo)
            if end > hi:
                self._give_back(hi, end)
            page = end

    def _give_back(self, lo: int, hi: int) -> None:
        """Free [lo, hi) to the buddy tree as aligned power-of-two chunks (they merge there)."""
        while lo < hi:
            order = min((lo & -lo).bit_length() - 1 if lo else self.max_order, (hi - lo).bit_length() - 1)
            self.buddy.free(lo, 1 << order)
            lo += 1 << order

    def _alloc_slot(self, cls: int, slot_size: int, limit: int | None, fenced_ok: bool) -> int | None:
        page = self._page_with_room(cls, fenced_ok)
        if page is None:
            if limit is not None and self.footprint + self.page > limit:
                return None
            start = self.buddy.alloc(self.page, fenced_ok)
            if start is None:
                return None
            page = start >> self.page_order
            self._open_page(page, cls)
        slack = self._slack.get(page)
        if slack:
            slot = slack.pop()
        else:
            slot = self._bump[page]
            self._bump[page] = slot + 1
        live = self.page_live[page] + 1
        self.page_live[page] = live
        if live == self.page // slot_size:
            del self._partial[cls][page]
        self.owners[page][slot] = UNOWNED
        return (page << self.page_order) + slot * slot_size

    def _page_with_room(self, cls: int, fenced_ok: bool) -> int | None:
        partial = self._partial[cls]
        fences = None if fenced_ok else self.buddy.fences
        for page in partial:
            if not fences or all(not lo <= page << self.page_order < hi for lo, hi in fences):
                return page
        return None

    def _open_page(self, page: int, cls: int) -> None:
        self.footprint += self.page
        self.page_class[page] = cls
        self.page_live[page] = 0
        self._bump[page] = 0
        self.owners[page] = np.full(self.page // self.class_size[cls], FREE, dtype=np.int32)
        self._partial[cls][page] = None
        self.slab_pages[cls] += 1

    def free(self, offset: int, size: int) -> None:
        """Give back the extent at ``offset`` (``size`` as passed to alloc)."""
        self.requested -= size
        if size > self.page // 2:
            chunk = -(-size // self.page) * self.page
            self.used -= chunk
            first = offset >> self.page_order
            self.big_owner[first:first + (chunk >> self.page_order)] = FREE
            self.footprint -= chunk
            self._give_back(offset, offset + chunk)
            return
        page = offset >> self.page_order
        cls = self.page_class[page]
        slot_size = self.class_size[cls]
        self.used -= slot_size
        slot = (offset - (page << self.page_order)) // slot_size
        self.owners[page][slot] = FREE
        live = self.page_live[page] - 1
        self.page_live[page] = live
        if not live:                    # the page goes back to the tree, for any class or a big value
            self._partial[cls].pop(page, None)
            self._slack.pop(page, None)
            del self.owners[page]
            self.page_class[page] = -1
            self.slab_pages[cls] -= 1
            self.footprint -= self.page
            self.buddy.free(page << self.page_order, self.page)
            return
        self._slack.setdefault(page, []).append(slot)
        self._partial[cls][page] = None

    # ------------------------------------------------------------ owners

    def set_owner(self, offset: int, size: int, entry: int) -> None:
        """``entry`` is the value at ``offset`` (a hint: the engine checks it before use)."""
        page = offset >> self.page_order
        if size <= self.page // 2:
            owners = self.owners.get(page)
            if owners is not None:
                owners[(offset - (page << self.page_order)) // self.class_size[self.page_class[page]]] = entry
        else:
            self.big_owner[page:page + -(-size // self.page)] = entry

    def window_free(self, lo: int, hi: int) -> bool:
        """Whether every page of the bytes [lo, hi) (page-aligned) is free."""
        first, end = lo >> self.page_order, hi >> self.page_order
        return bool((self.big_owner[first:end] == FREE).all()
                    and (np.frombuffer(self.page_class, dtype=np.int8)[first:end] < 0).all())

    def region_owners(self, lo: int, hi: int) -> np.ndarray:
        """The owner hints of every allocated piece overlapping the bytes [lo, hi), each
        once: entries, UNOWNED for pieces no committed value owns (never evictable)."""
        first, end = lo >> self.page_order, max(-(-hi >> self.page_order), (lo >> self.page_order) + 1)
        parts = []
        for page in range(first, end):
            owners = self.owners.get(page)
            if owners is not None:
                parts.append(owners[owners != FREE])
        big = self.big_owner[first:end]
        big = big[big != FREE]
        if len(big) > 1:        # an extent's pages are adjacent: keep the first of each run
            big = big[np.concatenate(([True], big[1:] != big[:-1]))]
        if len(big):
            parts.append(big)
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
        sizes = self.class_size
        return sum((self.page // sizes[cls] - self.page_live[page]) * sizes[cls]
                   for cls, pages in enumerate(self._partial) if below is None or sizes[cls] < below
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
        return small + self.slack_bytes(largest_class) + self.page_tails()

    def page_tails(self) -> int:
        """Bytes at the end of slab pages that no slot of their class fits in."""
        sizes = self.class_size
        return sum(count * (self.page % sizes[cls]) for cls, count in enumerate(self.slab_pages))

    def internal_fragmentation(self) -> float:
        return 1 - self.requested / self.used if self.used else 0.0

    def external_fragmentation(self) -> float:
        free = self.free_bytes
        return 1 - self.largest_free() / free if free else 0.0
