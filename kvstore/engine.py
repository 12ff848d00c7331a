"""The engine: the key index, the values' places in the arena, and eviction.

The engine knows nothing of RESP or sockets. A key maps to a small integer
slot; per-slot facts (arena offset, value size) live in flat numpy arrays and
the eviction policy keeps its own per-slot arrays (access stamp, chain
parent, children, pins). That layout keeps the metadata near 150 bytes a key,
where a Python object per entry would cost twice that.

A write is two steps so a value is never visible half-written: ``reserve``
hands out an extent (evicting under ``allkeys-lru`` or raising ``OutOfMemory``
under ``noeviction``) that the connection receives the bytes straight into,
and ``commit`` publishes it under its key. A reader that sends a value from
the arena holds a lease on the extent; a delete or overwrite during the send
hides the key at once but frees the bytes only when the lease ends.

Expiry is Redis's: deadlines in a side dict (few keys carry one), checked
lazily on access and actively by a periodic sampling cycle.
"""
from __future__ import annotations

import random
import sys
import time
from array import array
from dataclasses import dataclass

import numpy as np

from kvstore.allocator import BuddyAllocator
from kvstore.arena import Arena
from kvstore.eviction import NO_PARENT, SampledLRU
from kvstore.tier_moves import BLOCK_SHIFT, DRAM, GPU, ON_SSD, SSD, STAGED, TierMoves
from proto.wire import TIER_DRAM, TIER_GPU, TIER_SSD

TIER_NAMES = {DRAM: TIER_DRAM, SSD: TIER_SSD, GPU: TIER_GPU}
MAX_VALUE = 2**32 - 1  # sizes are kept in 32 bits


class OutOfMemory(Exception):
    """No room for a value: the store is full and may not evict, or the value is too big."""


class NeedsDemotion(OutOfMemory):
    """DRAM is full of values that exist nowhere else; demoting them to SSD will make room.

    The caller waits for ``TierManager.make_room(size)`` and tries again, instead
    of dropping values that were never written to SSD.
    """

    def __init__(self, size: int):
        super().__init__(f"waiting for the SSD tier to take {size} bytes")
        self.size = size


@dataclass(slots=True)
class Extent:
    """A piece of the arena: reserved for an incoming value, or holding one."""

    offset: int
    size: int
    view: memoryview
    committed: bool = False


@dataclass
class EngineStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    expired: int = 0
    oom_rejections: int = 0


def now_ms() -> int:
    return int(time.time() * 1000)


class Engine(TierMoves):
    """The index of one node's DRAM tier."""

    def __init__(self, dram_size: int, policy: str = "allkeys-lru", prefault: bool = True):
        self.arena = Arena(dram_size, prefault=prefault)
        self.allocator = BuddyAllocator(dram_size, min_block=1 << BLOCK_SHIFT)
        self.eviction = SampledLRU(capacity=1024)
        self.policy = policy
        self.limit = dram_size          # CONFIG SET maxmemory may lower it
        self.index: dict[bytes, int] = {}
        self.expires: dict[bytes, int] = {}
        self.stats = EngineStats()
        self._keys: list[bytes | None] = []
        # DRAM offset >> BLOCK_SHIFT (of the staged copy for SSD/GPU values); 4 bytes
        # a key instead of 8, since extents are aligned to the allocator's 64-byte blocks.
        self._block = array("I")
        self._size = array("I")
        self._tier = array("b")
        self._flags = array("b")
        self.tier_bytes = {DRAM: 0, SSD: 0, GPU: 0}
        self.tiers = None              # kvstore.tiering.TierManager when SSD/GPU tiers exist
        self.drop_listeners: list = []  # fn(slot, key) when a value leaves the index (cached leases)
        self._free_slots: list[int] = []
        self._leases: dict[int, int] = {}       # offset -> readers in flight
        self._doomed: dict[int, int] = {}       # leased offset -> size, free when released
        self._soft_pins: dict[int, tuple[bytes, int]] = {}   # slot -> (key, deadline ms)
        self._heap_staged: dict[int, bytearray] = {}         # slot -> copy read for one command
        self.value_bytes = 0

    # ----------------------------------------------------------- writes

    def reserve(self, size: int, clean_only: bool = False) -> Extent:
        """An extent for a value of ``size`` bytes, evicting if the policy allows."""
        alloc = self.allocator
        if size > MAX_VALUE:
            raise OutOfMemory(f"value of {size} bytes is larger than the largest value ({MAX_VALUE} bytes)")
        while True:
            if alloc.used + size <= self.limit:
                offset = alloc.alloc(size)
                if offset is not None:
                    return Extent(offset, size, self.arena.view[offset:offset + size])
            if not alloc.fits(size) or size > self.limit:
                self.stats.oom_rejections += 1
                raise OutOfMemory(f"value of {size} bytes is larger than the DRAM tier")
            if self.policy == "noeviction":
                self.stats.oom_rejections += 1
                raise OutOfMemory("no room in the DRAM tier")
            if self._evict_one(clean_only=True):
                continue
            if self.tiers is not None and self.tiers.can_demote():
                raise NeedsDemotion(size)
            if clean_only or not self._evict_one():
                self.stats.oom_rejections += 1
                raise OutOfMemory("no room in the DRAM tier")

    def release(self, extent: Extent) -> None:
        """Give back a reservation that was never committed."""
        extent.view.release()
        self.allocator.free(extent.offset, extent.size)

    def commit(self, key: bytes, extent: Extent, parent: bytes | None = None,
               keep_ttl: bool = False) -> None:
        """Publish ``extent`` as the value of ``key``, replacing any old value."""
        extent.committed = True
        extent.view.release()
        old = self.index.pop(key, None)
        slot = self._new_slot(key)
        self._block[slot] = extent.offset >> BLOCK_SHIFT
        self._size[slot] = extent.size
        self._tier[slot] = DRAM
        self._flags[slot] = 0
        self.value_bytes += extent.size
        self.tier_bytes[DRAM] += extent.size
        self.index[key] = slot
        parent_slot = self.index.get(parent, NO_PARENT) if parent is not None else NO_PARENT
        self.eviction.insert(slot, parent_slot)
        if old is not None:
            # Links are by key: the new value keeps the old one's cached children.
            self.eviction.adopt_children(old, slot)
            self.index[key] = old
            self._drop(old, keep_ttl=keep_ttl)
            self.index[key] = slot
        if self.tiers is not None:
            self.tiers.on_commit(key, slot)

    def put(self, key: bytes, data, parent: bytes | None = None, keep_ttl: bool = False) -> None:
        """Copy ``data`` (any buffer) into the arena under ``key``."""
        src = memoryview(data).cast("B")
        size = src.nbytes
        slot = self.index.get(key)
        if slot is not None and self._same_parent(slot, parent) \
                and self._overwrite_in_place(slot, src, size, keep_ttl):
            return
        extent = self.reserve(size)
        extent.view[:] = src
        self.commit(key, extent, parent, keep_ttl)

    def _same_parent(self, slot: int, parent: bytes | None) -> bool:
        return parent is None or self.eviction.parent_of(slot) == self.index.get(parent, NO_PARENT)

    def _overwrite_in_place(self, slot: int, src: memoryview, size: int, keep_ttl: bool) -> bool:
        """Reuse the old block when the new value needs a block of the same size.

        The copy happens in one step on the loop thread, so no reader sees a
        mix; a leased block (being sent) is never rewritten.
        """
        offset = self._dram_offset(slot)
        old = self._size[slot]
        alloc = self.allocator
        if offset in self._leases or alloc.order_for(size) != alloc.order_for(old) \
                or self._tier[slot] != DRAM or self._flags[slot]:
            return False
        self.arena.view[offset:offset + size] = src
        self._size[slot] = size
        alloc.requested += size - old
        self.value_bytes += size - old
        self.tier_bytes[DRAM] += size - old
        if not keep_ttl and self.expires:
            self.expires.pop(self._keys[slot], None)
        self.eviction.touch(slot)
        return True

    def delete(self, key: bytes) -> bool:
        slot = self.lookup(key)
        if slot is None:
            return False
        self._drop(slot)
        return True

    def drop(self, slot: int) -> None:
        """Remove a value from every tier (SSD over capacity, corrupt copy)."""
        self._drop(slot)

    def flush(self) -> None:
        for slot in list(self.index.values()):
            self._drop(slot)

    # ----------------------------------------------------------- reads

    def lookup(self, key: bytes) -> int | None:
        """The slot of a live key (expired keys are removed on the way)."""
        slot = self.index.get(key)
        if slot is not None and self.expires and key in self.expires:
            if self.expires[key] <= now_ms():
                self._drop(slot)
                self.stats.expired += 1
                return None
        return slot

    def get_slot(self, key: bytes) -> int | None:
        """Lookup for a read: counts the hit or miss and refreshes recency."""
        slot = self.lookup(key)
        if slot is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.eviction.touch(slot)
        if self.tiers is not None and self.tiers.gpu is not None and self._tier[slot] == DRAM:
            self.tiers.note_dram_hit(slot)
        return slot

    def _dram_offset(self, slot: int) -> int:
        return self._block[slot] << BLOCK_SHIFT

    def key_of(self, slot: int) -> bytes:
        return self._keys[slot]

    def size_of(self, slot: int) -> int:
        return self._size[slot]

    def view(self, slot: int) -> memoryview:
        if self._heap_staged and slot in self._heap_staged:
            return memoryview(self._heap_staged[slot])
        offset = self._dram_offset(slot)
        return self.arena.view[offset:offset + self._size[slot]]

    def value(self, slot: int) -> bytes:
        return self.view(slot).tobytes()

    def match_prefix(self, keys: list[bytes]) -> int:
        """How many leading keys are present: the longest cached prefix."""
        n = 0
        for key in keys:
            slot = self.lookup(key)
            if slot is None:
                break
            self.eviction.touch(slot)
            n += 1
        return n

    # ----------------------------------------------------------- leases

    def lease(self, slot: int) -> int | None:
        """Keep the value of ``slot`` in place while it is sent; returns a token.

        A value staged on the heap needs no lease (the view keeps it alive): None.
        """
        if self._heap_staged and slot in self._heap_staged:
            return None
        offset = self._dram_offset(slot)
        self._leases[offset] = self._leases.get(offset, 0) + 1
        self.eviction.pin(slot)
        return offset

    def unlease(self, offset: int | None, slot: int, key: bytes) -> None:
        if offset is None:
            return
        left = self._leases[offset] - 1
        if left:
            self._leases[offset] = left
        else:
            del self._leases[offset]
            if offset in self._doomed:
                self.allocator.free(offset, self._doomed.pop(offset))
        if self.index.get(key) == slot and self._dram_offset(slot) == offset:
            self.eviction.unpin(slot)

    # ----------------------------------------------------------- pins

    def pin(self, key: bytes, ttl_ms: int) -> bool:
        """Soft-pin ``key`` for ``ttl_ms``: evicted last; the pin expires by itself."""
        slot = self.lookup(key)
        if slot is None:
            return False
        self.eviction.soft_pin(slot)
        self._soft_pins[slot] = (key, now_ms() + ttl_ms)
        return True

    def unpin(self, key: bytes) -> bool:
        slot = self.lookup(key)
        if slot is None or slot not in self._soft_pins:
            return False
        del self._soft_pins[slot]
        self.eviction.soft_pin(slot, False)
        return True

    def expire_pins(self) -> None:
        now = now_ms()
        for slot, (key, deadline) in list(self._soft_pins.items()):
            if deadline <= now or self.index.get(key) != slot:
                del self._soft_pins[slot]
                if self.index.get(key) == slot:
                    self.eviction.soft_pin(slot, False)

    # ----------------------------------------------------------- expiry

    def set_expire(self, key: bytes, deadline_ms: int) -> None:
        self.expires[key] = deadline_ms

    def persist(self, key: bytes) -> bool:
        return self.expires.pop(key, None) is not None

    def expire_cycle(self, samples: int = 20) -> int:
        """Drop expired keys among a random sample (Redis's active expiry)."""
        if self._soft_pins:
            self.expire_pins()
        if not self.expires:
            return 0
        now = now_ms()
        keys = random.sample(list(self.expires), min(samples, len(self.expires)))
        dropped = 0
        for key in keys:
            if self.expires[key] <= now:
                self._drop(self.index[key])
                self.stats.expired += 1
                dropped += 1
        return dropped

    # ----------------------------------------------------------- iteration

    def scan(self, cursor: int, count: int) -> tuple[int, list[bytes]]:
        """Keys from slot ``cursor`` on; a key present throughout is seen once."""
        keys, n = [], len(self._keys)
        while cursor < n and len(keys) < count:
            key = self._keys[cursor]
            cursor += 1
            if key is not None and self.lookup(key) is not None:
                keys.append(key)
        return (0 if cursor >= n else cursor), keys

    # ----------------------------------------------------------- accounting

    def tier_of(self, slot: int) -> str:
        return TIER_NAMES[self._tier[slot]]

    def memory_usage(self, key: bytes, slot: int) -> int:
        """Bytes a key costs: its arena block plus its share of the index."""
        return self.allocator.block_size(self._size[slot]) + sys.getsizeof(key) + int(self.metadata_bytes_per_key())

    def tier_counts(self) -> dict[int, int]:
        """How many values live in each tier (for INFO; O(keys) in numpy)."""
        n = len(self._keys)
        tiers = np.frombuffer(self._tier, dtype=np.int8)[:n]
        live = np.frombuffer(self.eviction.live_column(), dtype=np.int8)[:n] != 0
        counts = np.bincount(tiers[live], minlength=3)
        return {DRAM: int(counts[DRAM]), SSD: int(counts[SSD]), GPU: int(counts[GPU])}

    def kv_stats(self) -> dict[str, int]:
        s = self.stats
        return {"hits": s.hits, "misses": s.misses, "keys": len(self.index), "evictions": s.evictions,
                "bytes_gpu": self.tier_bytes[GPU], "bytes_dram": self.tier_bytes[DRAM],
                "bytes_ssd": self.tier_bytes[SSD]}

    def metadata_bytes_per_key(self) -> float:
        """Index overhead per key: dict entry, key object, slot int, arrays."""
        n = len(self.index)
        if not n:
            return 0.0
        sample = list(self.index)[:64]
        key_bytes = sum(sys.getsizeof(k) for k in sample) / len(sample)
        per_slot = (self._block.itemsize + self._size.itemsize + self._tier.itemsize + self._flags.itemsize
                    + self.eviction.nbytes_per_slot() + 8)
        return sys.getsizeof(self.index) / n + key_bytes + sys.getsizeof(2**40) + per_slot

    def close(self) -> None:
        self.arena.close()

    # ----------------------------------------------------------- internals

    def _new_slot(self, key: bytes) -> int:
        if self._free_slots:
            slot = self._free_slots.pop()
            self._keys[slot] = key
            return slot
        slot = len(self._keys)
        self._keys.append(key)
        self._block.append(0)
        self._size.append(0)
        self._tier.append(DRAM)
        self._flags.append(0)
        return slot

    def _drop(self, slot: int, keep_ttl: bool = False) -> None:
        key = self._keys[slot]
        for listener in self.drop_listeners:
            listener(slot, key)
        del self.index[key]
        if not keep_ttl:
            self.expires.pop(key, None)
        tier, flags, size = self._tier[slot], self._flags[slot], self._size[slot]
        if flags & STAGED and slot in self._heap_staged:
            del self._heap_staged[slot]
        elif tier == DRAM or flags & STAGED:
            self.free_dram(self._dram_offset(slot), size)
        if tier == GPU:
            self.tiers.free_gpu(slot, size)
        if self.tiers is not None and (tier == SSD or flags & ON_SSD):
            self.tiers.forget_on_ssd(key)
        self.value_bytes -= size
        self.tier_bytes[tier] -= size
        self.eviction.remove(slot)
        self._keys[slot] = None
        self._free_slots.append(slot)

    def free_dram(self, offset: int, size: int) -> None:
        """Free a DRAM extent now, or when its last reader lets go."""
        if offset in self._leases:
            self._doomed[offset] = size
        else:
            self.allocator.free(offset, size)

    def _evict_one(self, clean_only: bool = False) -> bool:
        """Make room in DRAM: drop a clean copy first, else evict the coldest value.

        With an SSD tier a clean DRAM copy (its value is already on SSD) goes
        at no loss; ``clean_only`` forbids dropping anything else (a read that
        makes room must not lose a value that exists only in DRAM).
        """
        if self.tiers is None:
            slot = self.eviction.victim()
        else:
            slot = self.eviction.victim(among=[(self._tier, DRAM), (self._flags, ON_SSD)])
            if slot is None and not clean_only:
                slot = self.eviction.victim(among=[(self._tier, DRAM)])
        if slot is None:
            return False
        if self._flags[slot] & ON_SSD:
            self.demoted_to_ssd(slot)
            return True
        self._drop(slot)
        self.stats.evictions += 1
        if self.tiers is not None:
            self.tiers.stats[DRAM].evictions += 1
        return True
