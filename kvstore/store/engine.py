"""The engine: the key index, the values' places in the arena, and eviction.

The engine knows nothing of RESP or sockets. A key maps to a small integer
entry; per-entry facts (tier, arena offset, value size) live in the flat
columns of kvstore/store/entries.py and the eviction policy keeps its own per-entry
columns (access stamp, chain links, candidate lists). That layout keeps the
metadata under 200 bytes a key, where a Python object per entry would cost
twice that.

A write is two steps so a value is never visible half-written: ``reserve``
hands out an extent (evicting under ``allkeys-lru`` or raising ``OutOfMemory``
under ``noeviction``) that the connection receives the bytes straight into,
and ``commit`` publishes it under its key. A reader that sends a value from
the arena holds it (``holds``); a delete or overwrite during the send hides
the key at once but frees the bytes only when the hold is released.

Lower tiers (kvstore/tiers/manager.py) are told what happens through listeners:
``commit_listeners`` (a value was published), ``drop_listeners`` (a value is
leaving the index), ``hit_listeners`` (a read hit) and ``evict_listeners``
(DRAM let a value go to make room). ``final_drop_listeners`` hear of a value
that goes for good (evicted from its last tier, expired, deleted), not of one
replaced by a newer value of its key: a cluster node drops the blocks that
follow it in its chains (kvstore/cluster/cascade.py). The engine never calls the tier manager;
the one question it asks a lower tier, whether waiting for demotions will
free DRAM, goes through the ``can_demote`` hook the tier manager sets.

Tenants (kvstore/store/quotas.py): every write names the tenant making it
(``owner``: the writing ACL user's tenant id, 0 for the shared pool), which
the entry table records with the value; making room for it, and choosing what
a lower tier takes (``coldest``), spare what the tenants' quotas protect.

The parts that are concepts of their own are objects the engine owns and
callers use directly (``engine.holds.hold(entry)``, ``engine.expiry.set(key,
deadline)``), each handed what it needs (the index, the eviction policy, a
lookup or drop function) rather than the engine: ``holds`` (reads in flight,
kvstore/store/holds.py), ``pins`` (KV.PIN soft pins, kvstore/store/pins.py)
and ``expiry`` (TTLs and Redis's active expiry cycle, kvstore/store/expiry.py).
The lazy half of expiry stays here, in ``lookup``, which every read goes
through. What is left here is writes, reads, and what ties the parts together.
"""
from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.store.arena import Arena, Extent
from kvstore.store.companions import Companions
from kvstore.store.deadlines import now_ms
from kvstore.store.entries import DRAM, GPU, OFFSET_SHIFT, OFFSET_UNIT, ON_SSD, SSD, STAGED, TIERS, EntryTable
from kvstore.store.eviction import NO_PARENT, SampledLRU
from kvstore.store.expiry import Expiry
from kvstore.store.holds import ExtentHolds
from kvstore.store.pins import SoftPins
from kvstore.store.quotas import SHARED, Quotas
from kvstore.store.room import NeedsDemotion, NeedsRoom, OutOfMemory, RoomMaker
from kvstore.store.slabs import SlabAllocator
from kvstore.tiers.moves import TierMoves
from proto.wire import TIER_DRAM, TIER_GPU, TIER_SSD

__all__ = ["DRAM", "GPU", "SSD", "ON_SSD", "STAGED", "Engine", "Extent", "NeedsDemotion", "NeedsRoom",
           "OutOfMemory"]

TIER_NAMES = {DRAM: TIER_DRAM, SSD: TIER_SSD, GPU: TIER_GPU}
MAX_VALUE = 2**32 - 1  # sizes are kept in 32 bits


@dataclass
class EngineStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    expired: int = 0
    oom_rejections: int = 0
    evicted_for_small: int = 0      # values evicted to place a value smaller than a page
    evicted_for_big: int = 0        # ... a value of a page or more
    evicted_beyond_region: int = 0  # chain blocks outside a region, evicted before their parent in it
    evicted_other: int = 0          # clean-only and fallback evictions, cluster copies
    evicted_companions: int = 0     # keys that went with an evicted one (kvstore/store/companions.py)
    evict_seconds: float = 0.0      # time spent evicting
    evict_deferrals: int = 0        # writes put off to a later loop turn by the per-turn bound
    evict_regions: int = 0          # regions chosen to clear for a write


class Engine:
    """The index of one node: every key, whichever tier its value is in, and the
    DRAM arena that values are written into."""

    def __init__(self, dram_size: int, policy: str = "allkeys-lru", prefault: bool = True):
        self.arena = Arena(dram_size, prefault=prefault)
        self.allocator = SlabAllocator(dram_size, OFFSET_UNIT)
        self.eviction = SampledLRU(capacity=1024, places=len(TIERS), classes=self.allocator.classes)
        self.entries = EntryTable(self.eviction)
        self.eviction.groups = self.entries.owner
        # Quotas fit in the arena; the SSD tier, when there is one, sets its own size.
        self.quotas = Quotas(self.entries.tenant_bytes, [self.allocator.capacity, 0, 0])
        class_of, sizes = self.allocator.class_of, self.entries.size
        self.eviction.class_of = lambda entry: class_of(sizes[entry])
        self.entries.on_dram = self._placed
        self.holds = ExtentHolds(self.allocator, self.eviction, self.entries)   # reads in flight
        # The offsets held (holds.is_held(offset) is ``offset in`` it): a SET's rewrite in place asks
        # without a call.
        self._held_offsets = self.holds.readers
        self.moves = TierMoves(self.entries, self.holds.free)
        self.policy = policy
        self.limit = dram_size          # CONFIG SET maxmemory may lower it
        self.index: dict[bytes, int] = {}
        self.expiry = Expiry(self.index, self._expire)     # TTLs (kvstore/store/expiry.py)
        self._deadlines = self.expiry.deadlines             # lookup's check reads them with no attribute hop
        self.stats = EngineStats()
        self.can_demote: Callable[[], bool] | None = None   # set by a tier below DRAM
        self.commit_listeners: list[Callable[[bytes, int], None]] = []      # fn(key, entry) after a commit
        self.drop_listeners: list[Callable[[int, bytes], None]] = []        # fn(entry, key) before a drop
        self.final_drop_listeners: list[Callable[[int, bytes], None]] = []  # ... when no new value replaces it
        self.hit_listeners: list[Callable[[int], None]] = []                # fn(entry) on a read hit
        self.evict_listeners: list[Callable[[bool], None]] = []             # fn(demoted) per value let go
        # Cluster copies of hot blocks (kvstore/cluster/replication.py): told of in-place rewrites, shed first.
        self.overwrite_listeners: list[Callable[[bytes], None]] = []        # fn(key) before an in-place rewrite
        self.shed_first: Callable[[], bool] | None = None                   # drops a copy; True if one went
        self.pins = SoftPins(self.index, self.eviction, self.lookup)    # KV.PIN (kvstore/store/pins.py)
        self.room = RoomMaker(self)      # eviction that frees what a write needs (kvstore/store/room.py)
        self.companions = Companions()   # keys evicted together (evict-companions; the server sets them)

    def refuses_writes(self) -> bool:
        """Redis's out-of-memory state for commands that use memory, under a maxmemory lowered
        below the arena: more in use than the limit with no eviction allowed, or a limit
        smaller than the smallest value takes (no write can succeed)."""
        alloc = self.allocator
        if self.limit >= alloc.capacity:
            return False
        return self.limit < (1 << alloc.min_order) or (self.policy == "noeviction" and alloc.used > self.limit)

    @property
    def tier_bytes(self) -> list[int]:
        """Value bytes per tier code."""
        return self.entries.bytes_in

    @property
    def value_bytes(self) -> int:
        return sum(self.entries.bytes_in)

    # ----------------------------------------------------------- writes

    def reserve(self, size: int, clean_only: bool = False, owner: int = SHARED) -> Extent:
        """An extent for a value of ``size`` bytes written by tenant ``owner`` (the extent
        carries it to `commit`), evicting if the policy and the quotas allow.

        ``clean_only``: make room only by letting go of DRAM copies that a lower
        tier also holds (a read staging a copy must not cost another value).
        Eviction stops at the per-turn bound (``room.budget``): the write is then
        refused with ``NeedsRoom`` and waits (``room.wait``) while the loop serves
        others, eviction going on in the next turns.
        """
        alloc = self.allocator
        if size > MAX_VALUE:
            raise OutOfMemory(f"value of {size} bytes is larger than the largest value ({MAX_VALUE} bytes)")
        offset = alloc.alloc(size, self.limit)
        if offset is None and self.room.parked:
            offset = self.room.take_parked(size)
        if offset is None:
            if not alloc.fits(size) or size > self.limit:
                self.stats.oom_rejections += 1
                raise OutOfMemory(f"value of {size} bytes is larger than the DRAM tier")
            if self.policy == "noeviction":
                self.stats.oom_rejections += 1
                raise OutOfMemory("no room in the DRAM tier")
            offset = self.room.make(size, clean_only, owner)
        return Extent(offset, size, self.arena.view[offset:offset + size], False, owner)

    def _placed(self, entry: int) -> None:
        """The value of ``entry`` now lives in the arena: it owns its extent there."""
        entries = self.entries
        self.allocator.set_owner(entries.dram_offset(entry), entries.size[entry], entry)

    def release(self, extent: Extent) -> None:
        """Give back a reservation that was never committed."""
        extent.view.release()
        self.allocator.free(extent.offset, extent.size)

    def commit(self, key: bytes, extent: Extent, parent: bytes | None = None,
               keep_ttl: bool = False) -> None:
        """Publish ``extent`` as the value of ``key``, replacing any old value."""
        extent.committed = True
        extent.view.release()
        parent_entry = self._parent_entry(key, parent)
        entry = self.entries.add(key, extent.size, DRAM, 0, extent.offset, parent_entry, extent.owner)
        old = self.index.get(key)
        if old is not None:
            # Links are by key: the new value keeps the old one's cached children.
            self.eviction.adopt_children(old, entry)
            self._drop(old, keep_ttl=keep_ttl, replaced=True)
        self.index[key] = entry
        for listener in self.commit_listeners:
            listener(key, entry)

    def _parent_entry(self, key: bytes, parent: bytes | None) -> int:
        """The entry of ``key``'s chain parent, resolved before ``key`` is indexed
        anew: a key is never its own parent."""
        if parent is None or parent == key:
            return NO_PARENT
        return self.index.get(parent, NO_PARENT)

    def put(self, key: bytes, data, parent: bytes | None = None, keep_ttl: bool = False,
            owner: int = SHARED) -> None:
        """Copy ``data`` (any buffer) into the arena under ``key``, written by tenant ``owner``
        (a rewrite in place keeps the value's entry, so only when its owner is the same)."""
        src = data if type(data) is bytes else memoryview(data).cast("B")
        entry = self.index.get(key)
        if entry is not None and (parent is None or self._same_parent(entry, key, parent)) \
                and self.entries.owner[entry] == owner and self._rewrite_in_place(entry, 0, src, len(src), keep_ttl):
            return
        extent = self._reserve_below(self._parent_entry(key, parent), len(src), owner)
        extent.view[:] = src
        self.commit(key, extent, parent, keep_ttl)

    def _reserve_below(self, above: int, size: int, owner: int) -> Extent:
        """Reserve for a block that extends ``above``: making room takes that block only when
        nothing else can go (a parent with a cached child is never taken)."""
        if above == NO_PARENT or self.eviction.is_held(above):
            return self.reserve(size, owner=owner)
        self.eviction.hold(above)
        self.room.protect = above
        try:
            return self.reserve(size, owner=owner)
        except NeedsDemotion:
            raise
        except OutOfMemory:
            pass
        finally:
            self.room.protect = None
            self.eviction.release_hold(above)
        return self.reserve(size, owner=owner)

    def _same_parent(self, entry: int, key: bytes, parent: bytes) -> bool:
        return self.eviction.parent_of(entry) == self._parent_entry(key, parent)

    def splice(self, key: bytes, at: int, data) -> int:
        """Write ``data`` at byte ``at`` of the live value of ``key`` (APPEND, SETRANGE),
        zero-filling any gap past its end; its TTL and chain parent stay. Returns the new length.

        In place when the value's chunk has room (the allocator rounds sizes up
        to a power of two), through the same listeners as an overwrite; else the
        old bytes are copied once into a new extent, committed as a new value.
        """
        entry = self.index[key]
        src = memoryview(data).cast("B")
        size = max(self.entries.size[entry], at + src.nbytes)
        if self._rewrite_in_place(entry, at, src, size, keep_ttl=True):
            return size
        hold = self.holds.hold(entry)    # the old value must survive making room for the new one
        try:
            extent = self.reserve(size, owner=self.entries.owner[entry])
            old = self.view(entry)
            extent.view[:old.nbytes] = old
            extent.view[old.nbytes:at] = bytes(max(0, at - old.nbytes))
            extent.view[at:at + src.nbytes] = src
        finally:
            self.holds.release(hold)
        parent = self.eviction.parent_of(entry)
        self.commit(key, extent, None if parent == NO_PARENT else self.entries.keys[parent], keep_ttl=True)
        return size

    def _rewrite_in_place(self, entry: int, at: int, src, size: int, keep_ttl: bool) -> bool:
        """Write ``src`` (bytes or a byte memoryview) at byte ``at`` of the old extent, the
        value becoming ``size`` bytes, when that size needs a chunk of the same order.

        The copy happens in one step on the loop thread, so no reader sees a
        mix; a held extent (being sent) is never rewritten. A value of the same
        size as the old one (a SET of a busy key) skips the size bookkeeping.
        """
        entries = self.entries
        old = entries.size[entry]
        if entries.tier[entry] != DRAM or entries.flags[entry]:
            return False
        alloc = self.allocator
        if size != old and alloc.chunk_size(size) != alloc.chunk_size(old):
            return False
        offset = entries.offset_units[entry] << OFFSET_SHIFT     # entries.dram_offset, without a call
        if offset in self._held_offsets:      # self.holds.is_held(offset)
            return False
        for listener in self.overwrite_listeners:
            listener(entries.keys[entry])
        view = self.arena.view
        if at > old:
            view[offset + old:offset + at] = bytes(at - old)
        view[offset + at:offset + at + len(src)] = src
        if size != old:
            entries.resize(entry, size)
            alloc.requested += size - old
        if not keep_ttl and self._deadlines:
            self._deadlines.pop(entries.keys[entry], None)
        self.eviction.touch(entry)
        return True

    def delete(self, key: bytes) -> bool:
        entry = self.lookup(key)
        if entry is None:
            return False
        self._drop(entry)
        return True

    def drop(self, entry: int) -> None:
        """Remove a value from every tier (SSD over capacity, corrupt copy), and its companions."""
        key = self.entries.keys[entry]
        self._drop(entry)
        self._drop_companions(key)

    def _drop_companions(self, key: bytes) -> None:
        """The keys ``evict-companions`` pairs with ``key``, which went for want of room
        (kvstore/store/companions.py)."""
        if not self.companions.pairs:
            return
        for companion in self.companions.of(key):
            entry = self.index.get(companion)
            if entry is not None:
                self._drop(entry)
                self.stats.evicted_companions += 1

    def flush(self) -> None:
        for entry in list(self.index.values()):
            self._drop(entry)
        self.room.release_parked()

    # ----------------------------------------------------------- reads

    def lookup(self, key: bytes) -> int | None:
        """The entry of a live key (expired keys are removed on the way)."""
        entry = self.index.get(key)
        if entry is not None and self._deadlines and key in self._deadlines:
            if self._deadlines[key] <= now_ms():
                self._expire(entry)
                return None
        return entry

    def get_entry(self, key: bytes) -> int | None:
        """Lookup for a read: counts the hit or miss and refreshes recency."""
        entry = self.index.get(key)
        if entry is not None and self._deadlines and key in self._deadlines:
            entry = self.lookup(key)        # a key with a TTL: lookup expires it if due
        if entry is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.eviction.touch(entry)
        for listener in self.hit_listeners:
            listener(entry)
        return entry

    def key_of(self, entry: int) -> bytes:
        return self.entries.keys[entry]

    def size_of(self, entry: int) -> int:
        return self.entries.size[entry]

    def tier_code(self, entry: int) -> int:
        return self.entries.tier[entry]

    def flags_of(self, entry: int) -> int:
        return self.entries.flags[entry]

    def view(self, entry: int) -> memoryview:
        entries = self.entries
        if entries.heap_copies and entry in entries.heap_copies:
            return memoryview(entries.heap_copies[entry])
        offset = entries.offset_units[entry] << OFFSET_SHIFT     # entries.dram_offset, without a call
        return self.arena.view[offset:offset + entries.size[entry]]

    def value(self, entry: int) -> bytes:
        return self.view(entry).tobytes()

    def match_prefix(self, keys: list[bytes]) -> int:
        """How many leading keys are present: the longest cached prefix.

        The matched keys are refreshed tail first, so the head ends up the most
        recently used: in a cluster, where a node holds scattered blocks of a
        chain and no parent links between them, plain LRU then drops a chain's
        tail before its head.
        """
        matched = []
        for key in keys:
            entry = self.lookup(key)
            if entry is None:
                break
            matched.append(entry)
        for entry in reversed(matched):
            self.eviction.touch(entry)
        return len(matched)

    # ----------------------------------------------------------- iteration

    def scan(self, cursor: int, count: int) -> tuple[int, list[bytes]]:
        """Keys from entry ``cursor`` on; a key present throughout is seen once."""
        all_keys = self.entries.keys
        keys, n = [], len(all_keys)
        while cursor < n and len(keys) < count:
            key = all_keys[cursor]
            cursor += 1
            if key is not None and self.lookup(key) is not None:
                keys.append(key)
        return (0 if cursor >= n else cursor), keys

    # ----------------------------------------------------------- tiers

    def add_from_ssd(self, key: bytes, size: int, parent: bytes | None, tag: int = 0, owner: int = SHARED) -> None:
        """Index a value found on SSD at start-up (a newer value in DRAM wins), written by
        tenant ``owner``; ``tag`` as `TierMoves.mark_on_ssd` takes it."""
        if key in self.index:
            return
        entry = self.index[key] = self.entries.add(key, size, SSD, ON_SSD, 0, self._parent_entry(key, parent), owner)
        self.moves.noted_on_ssd(entry, tag)
        self.moves.settled(entry)

    def coldest(self, tier: int) -> int | None:
        """The next value to move out of ``tier``: never a held one, never a parent
        whose child is still in the tier (a demotion can wait for a hold), and the
        tenants' quotas first (a tenant over its share of the tier goes first, one
        within it not at all)."""
        policy, entry = self.eviction, None
        try:
            for spared in self.quotas.passes(tier):
                policy.spared = spared
                entry = policy.victim(tier, allow_parent=False)
                if entry is not None:
                    break
        finally:
            policy.spared = None
        return entry

    def owner_of(self, entry: int) -> int:
        """The tenant that wrote the value of ``entry``."""
        return self.entries.owner[entry]

    def tier_of(self, entry: int) -> str:
        return TIER_NAMES[self.entries.tier[entry]]

    def tier_counts(self) -> dict[int, int]:
        """How many values live in each tier (for INFO)."""
        return dict(enumerate(self.entries.count_in))

    # ----------------------------------------------------------- accounting

    def memory_usage(self, key: bytes, entry: int) -> int:
        """Bytes a key costs: its arena extent plus its share of the index."""
        return self.allocator.chunk_size(self.entries.size[entry]) + sys.getsizeof(key) \
            + int(self.metadata_bytes_per_key())

    def kv_stats(self) -> dict[str, int]:
        s, tier_bytes = self.stats, self.entries.bytes_in
        return {"hits": s.hits, "misses": s.misses, "keys": len(self.index), "evictions": s.evictions,
                "bytes_gpu": tier_bytes[GPU], "bytes_dram": tier_bytes[DRAM], "bytes_ssd": tier_bytes[SSD]}

    def metadata_bytes_per_key(self) -> float:
        """Index overhead per key: dict item, key object, entry number, columns."""
        n = len(self.index)
        if not n:
            return 0.0
        sample = list(itertools.islice(self.index, 64))     # not list(index): INFO stays O(1) in keys
        key_bytes = sum(sys.getsizeof(k) for k in sample) / len(sample)
        per_entry = self.entries.nbytes_per_entry() + self.eviction.nbytes_per_entry()
        return sys.getsizeof(self.index) / n + key_bytes + sys.getsizeof(2**40) + per_entry \
            + self.allocator.owner_bytes() / n

    def close(self) -> None:
        self.arena.close()

    # ----------------------------------------------------------- internals

    def _drop(self, entry: int, keep_ttl: bool = False, replaced: bool = False) -> None:
        entries = self.entries
        key = entries.keys[entry]
        for listener in self.drop_listeners:
            listener(entry, key)
        if not replaced:
            for listener in self.final_drop_listeners:
                listener(entry, key)
        del self.index[key]
        if not keep_ttl:
            self._deadlines.pop(key, None)
        if entries.tier[entry] == DRAM:
            self.holds.free(entries.dram_offset(entry), entries.size[entry])
        else:
            self.moves.unstage(entry)
        self.holds.forget_entry(entry)
        entries.remove(entry)

    def _expire(self, entry: int) -> None:
        """Drop a value past its deadline (found by lookup or by the expiry cycle)."""
        self._drop(entry)
        self.stats.expired += 1

    def _evict_one(self, clean_only: bool = False) -> bool:
        """Make room in DRAM: let a clean copy go first, else evict the coldest value.

        A clean DRAM copy (its value is also on SSD) goes at no loss;
        ``clean_only`` forbids dropping anything else while a lower tier exists
        (a read that makes room must not lose a value that exists only in DRAM).
        """
        if self.shed_first is not None and self.shed_first():
            self.stats.evicted_other += 1
            return True
        entry = self.eviction.victim(DRAM, clean_only=True)
        if entry is not None:
            self.moves.demoted_to_ssd(entry)
            for listener in self.evict_listeners:
                listener(True)
            return True
        if clean_only and self.can_demote is not None:
            return False
        entry = self.eviction.victim(DRAM)
        if entry is None:
            return False
        self.evict(entry)
        self.stats.evicted_other += 1
        return True

    def evict(self, entry: int) -> None:
        """Let the DRAM value of ``entry`` go for good to make room, and its companions."""
        key = self.entries.keys[entry]
        self._drop(entry)
        self.stats.evictions += 1
        for listener in self.evict_listeners:
            listener(False)
        self._drop_companions(key)
