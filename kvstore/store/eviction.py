"""Approximate LRU eviction that takes only chain leaves, at O(1) cost per victim.

Why sampling: an exact LRU needs a linked-list node per key (an OrderedDict
costs ~100 bytes a key in Python), which alone would blow the metadata budget.
Like Redis's evict.c we keep one access stamp per entry in a flat array,
sample candidates when memory is needed, take the oldest, and keep a small
pool of the oldest candidates seen so that most victims cost no sampling.

Why leaves only: a block whose children are cached is worth more than a leaf
(a child without its parent is useless to a prefix match), so an entry is a
candidate only while none of its children is cached. A cold prompt thus loses
its blocks from the tail back, and what stays of it is always a prefix. When
a leaf goes its parent may become one, and since the parent is older than
anything in the pool it goes into the pool at once: the chain keeps draining
from its tail, each block at the same cost, whatever the chain's length.

Places. Each entry lives in one place (the engine's tiers: GPU, DRAM, SSD; the
conductor's simulator has one). Leaves are counted per place: an entry is a
leaf of its place when no child is in the same place, so the last block of a
chain still in DRAM is DRAM's leaf while the chain's tail is on SSD. Each
entry counts its children in its own place; moving an entry updates its
parent's count and recounts its own children (O(children), not O(chain)).

Candidate lists. The leaves of each place sit in dense arrays with a position
column (add and swap-remove in O(1)), one array per kind:
- dirty: the only copy; clean: a copy exists in a lower place (dropping this
  one loses nothing; the engine tries these first);
- soft-pinned (KV.PIN): taken only when no other leaf of the place is left;
- held (a read or a tier copy in flight): never taken. When every leaf of a
  place is held, an eviction that must make progress takes the oldest unheld
  entry found just above sampled held leaves (a bounded walk up); a demotion
  that can wait takes nothing.

Links come from clients and are never trusted to form a tree: ``insert``
never links an entry to itself, and ``adopt_children`` hands children only to
a replacement that hangs from the same parent (or from none), so the links
always form a forest, and the one walk there is (up from held leaves) is
bounded anyway.

Spared groups. An entry may belong to a group (``groups``, a one-byte column
the caller owns: the engine's tenant of each value). While ``spared`` is set
(a byte per group, 1 for spared), no choice takes an entry of a spared group:
pooled ones are skipped, and a refill samples again, up to SPARED_ROUNDS
times, when every sampled one is spared (so a group holding a sliver of a
list may be missed: the cost stays bounded). The engine sets it while a
tenant's write makes room (kvstore/store/quotas.py).

Entries are small integer entry ids handed out by the caller (the engine's
index, or the conductor's simulated node cache), so the policy knows nothing
of keys or values.
"""
from __future__ import annotations

import bisect
from array import array

import numpy as np

NO_PARENT = -1
CLOCK_LIMIT = 2**32 - 1

# The candidate lists of a place, by kind.
DIRTY, CLEAN, SOFT, HELD = range(4)
KINDS = 4
# Bits of the marks column.
CLEAN_MARK, SOFT_MARK, HELD_MARK = 1, 2, 4
# Kind of a leaf from its marks (held beats soft-pinned beats clean).
KIND_OF_MARKS = tuple(HELD if m & HELD_MARK else SOFT if m & SOFT_MARK else CLEAN if m & CLEAN_MARK else DIRTY
                      for m in range(8))

POOL = 8            # oldest candidates of each list kept between calls
WALK_LIMIT = 64     # steps up from one held leaf when every leaf is held
SPARED_ROUNDS = 8   # samplings of one refill when every sampled candidate is spared


class SampledLRU:
    """Leaf-only approximate LRU over entry ids ``0..capacity-1`` in ``places`` places.

    Per-entry facts live in ``array.array`` columns: a scalar update costs
    ~30 ns there (a numpy scalar update ~100 ns, and updates happen on every
    access), while sampling still gets vectorised numpy views of them.
    ``_leaf_pos`` holds, for a leaf of its place, its index in its candidate
    list, and for any other entry minus the number of its children in its own
    place (an entry is in a list exactly when that number is 0).
    """

    _COLUMNS = (("_place", "b", -1), ("_marks", "B", 0), ("_stamp", "I", 0), ("_parent", "i", NO_PARENT),
                ("_first_child", "i", NO_PARENT), ("_next_sibling", "i", NO_PARENT),
                ("_prev_sibling", "i", NO_PARENT), ("_leaf_pos", "i", -1))

    def __init__(self, capacity: int = 1024, samples: int = 64, seed: int = 0, places: int = 1,
                 classes: int = 1):
        self.samples = samples
        self.places = places
        self.classes = classes          # size classes: each kind's list is split by class
        self.class_of = None            # fn(entry) -> its size class, below ``classes`` (with classes > 1)
        self._rng = np.random.default_rng(seed)
        self._clock = 0
        for name, code, fill in self._COLUMNS:
            setattr(self, name, array(code, [fill]) * capacity)
        self._lists = [array("i") for _ in range(places * KINDS * classes)]
        self._pools: list[list[tuple[int, int]]] = [[] for _ in range(places * KINDS * classes)]
        self._holds: dict[int, int] = {}      # entry -> holds in flight (few at a time)
        self.groups: array | None = None      # entry -> its group, array("B") (module doc)
        self.spared: bytes | None = None      # group -> 1 when its entries must not be chosen
        self.count = 0

    @property
    def capacity(self) -> int:
        return len(self._place)

    def grow(self, capacity: int) -> None:
        """Make room for entry ids below ``capacity`` (columns grow by at least an eighth)."""
        old = len(self._place)
        if capacity <= old:
            return
        extra = max(capacity, old + old // 8) - old
        for name, code, fill in self._COLUMNS:
            getattr(self, name).extend(array(code, [fill]) * extra)

    def nbytes_per_entry(self) -> int:
        """Bytes of policy metadata per entry (for INFO's per-key overhead): the
        columns and its place in a candidate list."""
        return sum(getattr(self, name).itemsize for name, _, _ in self._COLUMNS) + self._lists[0].itemsize

    # ------------------------------------------------------------ entries

    def insert(self, entry: int, parent: int = NO_PARENT, place: int = 0) -> None:
        """Start tracking ``entry`` in ``place``; ``parent`` is the entry of its chain parent."""
        if entry >= len(self._place):
            self.grow(entry + 1)
        if self._place[entry] >= 0:
            raise ValueError(f"entry {entry} is already tracked")
        self._place[entry] = place
        self._marks[entry] = 0
        self._parent[entry] = self._first_child[entry] = NO_PARENT
        self._next_sibling[entry] = self._prev_sibling[entry] = NO_PARENT
        self.touch(entry)
        self._file(entry)
        if parent != entry and 0 <= parent < len(self._place) and self._place[parent] >= 0:
            self._link(entry, parent)
        self.count += 1

    def touch(self, entry: int) -> None:
        """Record an access: the entry becomes the most recently used."""
        clock = self._clock = self._clock + 1
        if clock == CLOCK_LIMIT:
            self._halve_stamps()
            clock = self._clock
        self._stamp[entry] = clock

    @property
    def clock(self) -> int:
        """The stamp of the latest access: recencies are measured against it."""
        return self._clock

    def advance(self, ticks: int) -> int:
        """Move the clock ``ticks`` ahead, leaving that many stamps below it for `backdate`; the
        clock after."""
        if self._clock + ticks >= CLOCK_LIMIT:
            self._halve_stamps()
        self._clock += ticks
        return self._clock

    def backdate(self, entry: int, stamp: int) -> None:
        """Give ``entry`` the recency of stamp ``stamp`` (older than the clock): a value stored
        for another node's reads, as recent as it was there, not as its arrival."""
        self._stamp[entry] = min(stamp, self._clock)

    def _halve_stamps(self) -> None:
        """Stamps are 32-bit: before they wrap, halve them all (order is kept)."""
        stamps = np.frombuffer(self._stamp, dtype=np.uint32)
        stamps >>= 1
        del stamps
        self._clock >>= 1
        for pool in self._pools:
            pool.clear()

    def remove(self, entry: int) -> None:
        """Stop tracking ``entry``; its children stay, without a parent (O(children))."""
        if entry >= len(self._place) or self._place[entry] < 0:
            return
        if self._parent[entry] != NO_PARENT:
            self._unlink(entry)
        child = self._first_child[entry]
        while child != NO_PARENT:
            after = self._next_sibling[child]
            self._parent[child] = self._next_sibling[child] = self._prev_sibling[child] = NO_PARENT
            child = after
        self._first_child[entry] = NO_PARENT
        if self._leaf_pos[entry] >= 0:
            self._unfile(entry)
        self._leaf_pos[entry] = -1
        self._place[entry] = -1
        self._marks[entry] = 0
        if self._holds:
            self._holds.pop(entry, None)
        self.count -= 1

    def adopt_children(self, old: int, new: int) -> None:
        """``new`` replaces ``old`` (a key's value re-put): it takes over old's children
        when it hangs from the same parent as old, or from none.

        A value re-put under another parent starts a new lineage and old's children
        are orphaned when old goes: taking them could close a cycle, since the new
        parent may be one of them.
        """
        if old == new or self._parent[new] not in (NO_PARENT, self._parent[old]):
            return
        child = self._first_child[old]
        while child != NO_PARENT:
            after = self._next_sibling[child]
            self._unlink(child)
            self._link(child, new)
            child = after

    def move(self, entry: int, place: int) -> None:
        """The entry now lives in ``place`` (a value changed tier)."""
        old = self._place[entry]
        if old == place or old < 0:
            return
        parent = self._parent[entry]
        if parent != NO_PARENT and self._place[parent] == old:
            self._lose_same_child(parent)
        if self._leaf_pos[entry] >= 0:
            self._unfile(entry)
        self._place[entry] = place
        same, child = 0, self._first_child[entry]
        while child != NO_PARENT:
            same += self._place[child] == place
            child = self._next_sibling[child]
        if same:
            self._leaf_pos[entry] = -same
        else:
            self._file(entry)
        if parent != NO_PARENT and self._place[parent] == place:
            self._gain_same_child(parent)

    # ------------------------------------------------------------ marks

    def hold(self, entry: int) -> None:
        """A read or a copy of the value is in flight: never choose it until released."""
        if self._place[entry] < 0:
            return
        held = self._holds.get(entry, 0)
        self._holds[entry] = held + 1
        if not held:
            self._set_mark(entry, HELD_MARK, True)

    def release_hold(self, entry: int) -> None:
        held = self._holds.get(entry)
        if not held:
            return
        if held > 1:
            self._holds[entry] = held - 1
        else:
            del self._holds[entry]
            self._set_mark(entry, HELD_MARK, False)

    def is_held(self, entry: int) -> bool:
        return entry in self._holds

    def soft_pin(self, entry: int, on: bool = True) -> None:
        """A soft pin (KV.PIN): the entry goes only when no other leaf of its place is left."""
        if self._place[entry] >= 0:
            self._set_mark(entry, SOFT_MARK, on)

    def mark_clean(self, entry: int, clean: bool = True) -> None:
        """Whether a copy exists in a lower place, so dropping this one loses nothing."""
        if self._place[entry] >= 0:
            self._set_mark(entry, CLEAN_MARK, clean)

    def parent_of(self, entry: int) -> int:
        return self._parent[entry]

    def children_of(self, entry: int) -> list[int]:
        """The entries linked to ``entry`` as their parent, in any place (O(children))."""
        children, child = [], self._first_child[entry]
        while child != NO_PARENT:
            children.append(child)
            child = self._next_sibling[child]
        return children

    def is_spared(self, entry: int) -> bool:
        """Whether ``entry``'s group is spared by the choice under way."""
        return self.spared is not None and bool(self.spared[self.groups[entry]])

    def is_leaf(self, entry: int) -> bool:
        """Whether no child of the entry is cached, in any place."""
        return self._first_child[entry] == NO_PARENT

    # ------------------------------------------------------------ choosing

    def victim(self, place: int = 0, clean_only: bool = False, allow_parent: bool = True,
               cls: int | None = None) -> int | None:
        """The leaf of ``place`` to let go next, or None.

        The oldest dirty or clean leaf; then the oldest soft-pinned one; then,
        when every leaf is held and ``allow_parent`` says progress matters more
        than the chain, the oldest unheld entry just above a held leaf. With
        ``clean_only``, the oldest clean leaf and nothing else. With ``cls``,
        only leaves of that size class, and never one above a held leaf.
        """
        if cls is not None:
            if clean_only:
                return self._oldest_of(self._class_lids(place, (CLEAN,), cls))
            found = self._oldest_of(self._class_lids(place, (DIRTY, CLEAN), cls))
            return found if found is not None else self._oldest_of(self._class_lids(place, (SOFT,), cls))
        if clean_only:
            return self._oldest_of(self._kind_lids(place, CLEAN))
        found = self._oldest_of(self._kind_lids(place, DIRTY) + self._kind_lids(place, CLEAN))
        if found is not None:
            return found
        found = self._oldest_of(self._kind_lids(place, SOFT))
        if found is not None:
            return found
        if not allow_parent:
            return None
        for lid in self._kind_lids(place, HELD):
            found = self._above_held(lid)
            if found is not None:
                return found
        return None

    def oldest(self, place: int = 0, exclude_cls: int | None = None) -> tuple[int, int] | None:
        """(stamp, entry) of the oldest dirty or clean leaf of ``place`` outside class
        ``exclude_cls``, without taking it; None when there is none."""
        lids = [lid for lid in self._kind_lids(place, DIRTY) + self._kind_lids(place, CLEAN)
                if exclude_cls is None or lid % self.classes != exclude_cls]
        return self._oldest_head(lids)

    def peek(self, place: int, cls: int) -> tuple[int, int] | None:
        """(stamp, entry) of the oldest dirty or clean leaf of ``place`` in size class ``cls``,
        without taking it; None when there is none."""
        return self._oldest_head(self._class_lids(place, (DIRTY, CLEAN), cls))

    def _oldest_head(self, lids: list[int]) -> tuple[int, int] | None:
        heads = [head for head in map(self._pool_head, lids) if head is not None]
        return min(heads) if heads else None

    def class_leaves(self, place: int, cls: int) -> int:
        """How many unheld dirty or clean leaves of ``place`` are of size class ``cls``."""
        return sum(len(self._lists[lid]) for lid in self._class_lids(place, (DIRTY, CLEAN), cls))

    def _kind_lids(self, place: int, kind: int) -> list[int]:
        """The non-empty lists of ``kind`` in ``place``, one per size class."""
        start = (place * KINDS + kind) * self.classes
        lists = self._lists
        return [lid for lid in range(start, start + self.classes) if lists[lid]]

    def _class_lids(self, place: int, kinds: tuple[int, ...], cls: int) -> list[int]:
        lists = self._lists
        return [lid for lid in ((place * KINDS + kind) * self.classes + cls for kind in kinds) if lists[lid]]

    def _oldest_of(self, lids: list[int]) -> int | None:
        """Take the oldest pooled candidate among the non-empty lists ``lids``."""
        best = None
        for lid in lids:
            head = self._pool_head(lid)
            if head is not None and (best is None or head < best[0]):
                best = (head, lid)
        return None if best is None else self._pools[best[1]].pop(0)[1]

    def _pool_head(self, lid: int) -> tuple[int, int] | None:
        """The oldest (stamp, entry) of the non-empty list ``lid`` that is still in it,
        untouched since it was pooled and not spared; the pool is refilled when none is left.
        None when every candidate found is spared."""
        pool, stamps, places, spared = self._pools[lid], self._stamp, self._place, self.spared
        while pool:
            stamp, entry = head = pool[0]
            if stamps[entry] == stamp and self._leaf_pos[entry] >= 0 \
                    and places[entry] >= 0 and self._list_id(entry) == lid \
                    and (spared is None or not spared[self.groups[entry]]):
                return head
            del pool[0]
        self._refill(lid)
        return pool[0] if pool else None

    def _refill(self, lid: int) -> None:
        """Pool the oldest of ``samples`` random unspared members of list ``lid`` (all of them
        when fewer)."""
        spared = self.spared
        if len(self._lists[lid]) <= POOL:       # a chain's tail alone: no numpy round trip
            stamps, groups = self._stamp, self.groups
            self._pools[lid][:] = sorted((stamps[entry], entry) for entry in self._lists[lid]
                                         if spared is None or not spared[groups[entry]])
            return
        members = self._sample(lid)
        if not len(members):
            return
        stamps = np.frombuffer(self._stamp, dtype=np.uint32)[members]
        oldest = np.argsort(stamps, kind="stable")[:POOL]
        self._pools[lid][:] = sorted(set(zip(stamps[oldest].tolist(), members[oldest].tolist())))

    def _sample(self, lid: int) -> np.ndarray:
        """Up to ``samples`` random members of list ``lid`` (all when fewer), none spared:
        empty when SPARED_ROUNDS samplings found only spared ones."""
        everyone = np.frombuffer(self._lists[lid], dtype=np.int32)
        rounds = 1 if self.spared is None or len(everyone) <= self.samples else SPARED_ROUNDS
        for _ in range(rounds):
            members = everyone if len(everyone) <= self.samples else \
                everyone[self._rng.integers(0, len(everyone), self.samples)]
            if self.spared is not None:
                groups = np.frombuffer(self.groups, dtype=np.uint8)[members]
                members = members[~np.frombuffer(self.spared, dtype=np.bool_)[groups]]
            if len(members):
                break
        return members

    def _above_held(self, lid: int) -> int | None:
        """The oldest unheld entry found just above held leaves of list ``lid``
        (soft-pinned ones last): all of them when few, else a sample."""
        held = self._lists[lid]
        if not held:
            return None
        count = len(held)
        picks = range(count) if count <= self.samples else self._rng.integers(0, count, self.samples).tolist()
        place = lid // (KINDS * self.classes)
        best = None
        for i in picks:
            node = held[i]
            for _ in range(WALK_LIMIT):
                node = self._parent[node]
                if node == NO_PARENT or self._place[node] != place:
                    break
                if node not in self._holds and not self.is_spared(node):
                    rank = (self._marks[node] & SOFT_MARK, self._stamp[node], node)
                    best = rank if best is None or rank < best else best
                    break
        return None if best is None else best[2]

    # ------------------------------------------------------------ links and lists

    def _link(self, child: int, parent: int) -> None:
        self._parent[child] = parent
        head = self._first_child[parent]
        self._next_sibling[child] = head
        self._prev_sibling[child] = NO_PARENT
        if head != NO_PARENT:
            self._prev_sibling[head] = child
        self._first_child[parent] = child
        if self._place[parent] == self._place[child]:
            self._gain_same_child(parent)

    def _unlink(self, child: int) -> None:
        parent = self._parent[child]
        before, after = self._prev_sibling[child], self._next_sibling[child]
        if before != NO_PARENT:
            self._next_sibling[before] = after
        else:
            self._first_child[parent] = after
        if after != NO_PARENT:
            self._prev_sibling[after] = before
        self._parent[child] = self._prev_sibling[child] = self._next_sibling[child] = NO_PARENT
        if self._place[parent] == self._place[child]:
            self._lose_same_child(parent)

    def _gain_same_child(self, entry: int) -> None:
        at = self._leaf_pos[entry]
        if at >= 0:
            self._unfile(entry)
            self._leaf_pos[entry] = -1
        else:
            self._leaf_pos[entry] = at - 1

    def _lose_same_child(self, entry: int) -> None:
        at = self._leaf_pos[entry] + 1
        if at == 0:
            self._file(entry)
        else:
            self._leaf_pos[entry] = at

    def _set_mark(self, entry: int, bit: int, on: bool) -> None:
        marks = self._marks[entry]
        changed = marks | bit if on else marks & ~bit
        if changed == marks:
            return
        leaf = self._leaf_pos[entry] >= 0
        if leaf:
            self._unfile(entry)
        self._marks[entry] = changed
        if leaf:
            self._file(entry)

    def _list_id(self, entry: int) -> int:
        lid = self._place[entry] * KINDS + KIND_OF_MARKS[self._marks[entry]]
        return lid * self.classes + self.class_of(entry) if self.classes > 1 else lid

    def _file(self, entry: int) -> None:
        """Add a leaf of its place to its candidate list (and to the pool when older)."""
        lid = self._list_id(entry)
        members = self._lists[lid]
        self._leaf_pos[entry] = len(members)
        members.append(entry)
        pool = self._pools[lid]
        stamp = self._stamp[entry]
        if pool and stamp < pool[-1][0]:
            bisect.insort(pool, (stamp, entry))
            if len(pool) > POOL:
                pool.pop()

    def _unfile(self, entry: int) -> None:
        """Take ``entry`` out of its candidate list (swap-remove); the caller sets ``_leaf_pos``."""
        members = self._lists[self._list_id(entry)]
        at = self._leaf_pos[entry]
        last = members.pop()
        if last != entry:
            members[at] = last
            self._leaf_pos[last] = at
