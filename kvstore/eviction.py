"""Approximate LRU eviction that prefers chain leaves.

Why sampling: an exact LRU needs a linked list node per key (an OrderedDict
costs ~100 bytes a key in Python), which alone would blow the metadata budget.
Like Redis's evict.c we keep one access stamp per entry in a flat array and,
when memory is needed, sample a handful of random entries and take the
oldest. Unlike Redis we then look at the chain structure: a block whose
children are cached is worth more than a leaf (a child without its parent is
useless to a prefix match), so when the oldest sampled entry has children we
follow its chain down (one remembered child per entry) and evict the leaf.
A cold prompt thus loses its blocks from the tail back, and what stays cached
of it is always a prefix.

Entries are small integer slot ids handed out by the caller (the engine's
index, or the conductor's simulated node cache), so the policy knows nothing
of keys or values. Pinned entries (a read lease in flight) are never chosen;
soft-pinned ones (KV.PIN) only when nothing else is left.
"""
from __future__ import annotations

from array import array

import numpy as np

NO_PARENT = -1
CLOCK_LIMIT = 2**32 - 1


class SampledLRU:
    """Leaf-preferring approximate LRU over slot ids ``0..capacity-1``.

    Per-slot facts live in ``array.array`` columns: a scalar update costs
    ~30 ns there (a numpy scalar update ~100 ns, and updates happen on every
    access), while ``victim`` still gets vectorised numpy views of them.
    """

    _COLUMNS = (("_live", "b", 0), ("_stamp", "I", 0), ("_parent", "i", NO_PARENT),
                ("_children", "i", 0), ("_pins", "i", 0), ("_soft", "b", 0), ("_child", "i", NO_PARENT))

    def __init__(self, capacity: int = 1024, samples: int = 64, seed: int = 0):
        self.samples = samples
        self._rng = np.random.default_rng(seed)
        self._clock = 0
        for name, code, fill in self._COLUMNS:
            setattr(self, name, array(code, [fill]) * capacity)
        self._high = 0      # one past the highest slot ever inserted
        self.count = 0

    @property
    def capacity(self) -> int:
        return len(self._live)

    def grow(self, capacity: int) -> None:
        """Make room for slot ids below ``capacity`` (columns at least double)."""
        old = len(self._live)
        if capacity <= old:
            return
        extra = max(capacity, old * 2) - old
        for name, code, fill in self._COLUMNS:
            getattr(self, name).extend(array(code, [fill]) * extra)

    def nbytes_per_slot(self) -> int:
        """Bytes of policy metadata per slot (for INFO's per-key overhead)."""
        return sum(getattr(self, name).itemsize for name, _, _ in self._COLUMNS)

    def insert(self, slot: int, parent: int = NO_PARENT) -> None:
        """Start tracking ``slot``; ``parent`` is the slot of its chain parent."""
        if slot >= len(self._live):
            self.grow(slot + 1)
        self._clock += 1
        if self._clock == CLOCK_LIMIT:
            self._halve_stamps()
        self._live[slot] = 1
        self._stamp[slot] = self._clock
        self._children[slot] = 0
        self._pins[slot] = 0
        self._soft[slot] = 0
        self._child[slot] = NO_PARENT
        if parent != NO_PARENT and self._live[parent]:
            self._parent[slot] = parent
            self._children[parent] += 1
            self._child[parent] = slot
        else:
            self._parent[slot] = NO_PARENT
        if slot >= self._high:
            self._high = slot + 1
        self.count += 1

    def touch(self, slot: int) -> None:
        """Record an access: the entry becomes the most recently used."""
        self._clock += 1
        if self._clock == CLOCK_LIMIT:
            self._halve_stamps()
        self._stamp[slot] = self._clock

    def _halve_stamps(self) -> None:
        """Stamps are 32-bit: before they wrap, halve them all (order is kept)."""
        stamps = np.frombuffer(self._stamp, dtype=np.uint32)
        stamps >>= 1
        del stamps
        self._clock >>= 1

    def remove(self, slot: int) -> None:
        """Stop tracking ``slot`` and unlink it from its parent and children."""
        parent = self._parent[slot]
        if parent != NO_PARENT:
            self._children[parent] -= 1
            if self._child[parent] == slot:
                self._child[parent] = NO_PARENT
        if self._children[slot]:
            # Rare: a parent leaves before its children (DEL, expiry, or no
            # leaf was found). Orphan the children so a reused slot id is
            # never mistaken for their parent.
            parents = np.frombuffer(self._parent, dtype=np.int32)[: self._high]
            for child in np.flatnonzero(parents == slot).tolist():
                self._parent[child] = NO_PARENT
            del parents
        self._live[slot] = 0
        self._parent[slot] = NO_PARENT
        self._children[slot] = 0
        self._pins[slot] = 0
        self._soft[slot] = 0
        self._child[slot] = NO_PARENT
        self.count -= 1

    def adopt_children(self, old: int, new: int) -> None:
        """Move ``old``'s children to ``new`` (a key's value replaced by a new slot)."""
        if not self._children[old]:
            return
        parents = np.frombuffer(self._parent, dtype=np.int32)[: self._high]
        kids = np.flatnonzero(parents == old).tolist()
        del parents
        for child in kids:
            self._parent[child] = new
        self._children[new] += len(kids)
        self._children[old] = 0
        self._child[new] = kids[-1]
        self._child[old] = NO_PARENT

    def pin(self, slot: int) -> None:
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        if self._pins[slot] > 0:
            self._pins[slot] -= 1

    def soft_pin(self, slot: int, on: bool = True) -> None:
        """A soft pin (KV.PIN): the entry goes only when no unpinned one is left."""
        self._soft[slot] = 1 if on else 0

    def is_soft_pinned(self, slot: int) -> bool:
        return bool(self._soft[slot])

    def is_pinned(self, slot: int) -> bool:
        return bool(self._pins[slot])

    def live_column(self) -> array:
        return self._live

    def parent_of(self, slot: int) -> int:
        return self._parent[slot]

    def is_leaf(self, slot: int) -> bool:
        return not self._children[slot]

    def victim(self, among: list[tuple[array, int]] = (), allow_parent: bool = True) -> int | None:
        """The slot to evict next, or None when every live entry is pinned.

        Each ``(column, value)`` in ``among`` limits the choice to slots whose
        entry in the caller's per-slot ``column`` equals ``value`` (e.g.
        "values in DRAM"). When the oldest sampled entry still has cached
        children, its chain is followed down and the leaf goes instead, so a
        parent never leaves before its children.
        """
        if self.count == 0:
            return None
        cols = self._views()
        masks = [(np.frombuffer(col, dtype=np.dtype(col.typecode))[: self._high], value)
                 for col, value in among]
        for _ in range(4):
            picked = self._pick(cols, self._rng.integers(0, self._high, self.samples), masks, allow_parent)
            if picked is not None:
                return picked
        # The sampled slots were all free, pinned or elsewhere: look at everything once.
        return self._pick(cols, np.arange(self._high), masks, allow_parent)

    def _leaf_below(self, slot: int, cols: tuple[np.ndarray, ...], masks: list) -> int | None:
        """The end of ``slot``'s chain within the masked set (e.g. the last block still
        in DRAM), or None when that block may not go (leased, or soft-pinned below
        an unpinned ``slot``)."""
        node = slot
        while self._children[node]:
            child = self._child[node]
            if child == NO_PARENT or self._parent[child] != node:
                child = int(np.flatnonzero(cols[2] == node)[0])   # rare: a branch lost its pointer
                self._child[node] = child
            if any(column[child] != value for column, value in masks):
                break                       # the rest of the chain is elsewhere (a lower tier)
            node = child
        if self._pins[node] or self._soft[node] and not self._soft[slot]:
            return None
        return node

    def _views(self) -> tuple[np.ndarray, ...]:
        high = self._high
        return tuple(np.frombuffer(getattr(self, name), dtype=np.dtype(code))[:high]
                     for name, code, _ in self._COLUMNS)

    def _pick(self, cols: tuple[np.ndarray, ...], cand: np.ndarray, masks: list,
              allow_parent: bool) -> int | None:
        """Oldest first among ``cand``: the leaf below it, else the next oldest."""
        live, stamp, _, children, pins, soft, _ = cols
        keep = (live[cand] != 0) & (pins[cand] == 0)
        for column, value in masks:
            keep &= column[cand] == value
        cand = np.unique(cand[keep])
        if cand.size == 0:
            return None
        # Soft-pinned entries go last: order by (pinned, stamp).
        order = cand[np.lexsort((stamp[cand], soft[cand]))]
        if not allow_parent:
            # A move that can wait looks only at the older part of the sample: the
            # newest entries are likely a chain still being written, whose head
            # must not go down before its tail exists.
            order = order[: max(1, len(order) // 4)]
        for slot in order.tolist():
            leaf = self._leaf_below(slot, cols, masks)
            if leaf is not None:
                return leaf
        # Every chain here ends in a leased block: take the oldest parent only when
        # progress matters more than the chain (eviction, not a demotion that can wait).
        return int(order[0]) if allow_parent else None
