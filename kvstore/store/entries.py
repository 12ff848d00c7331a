"""Per-entry state of the index: where each value lives, in flat columns.

A key maps to a small integer entry (`Engine.index`); everything else the node
knows about the value sits in columns indexed by that entry. Python objects per
entry would cost twice the memory: with 4-byte offsets and sizes and 1-byte
codes the index stays near 200 bytes a key, key included (see
tests/test_engine.py).

Tier codes (the ``tier`` column) and flags (the ``flags`` column) are defined
here and nowhere else:

- ``DRAM``: the value is in the node's shared-memory arena, at
  ``offset_units << OFFSET_SHIFT``;
- ``SSD``: the value is only in RocksDB;
- ``GPU``: the value is in the GPU tier's arena (its offset is the tier
  manager's, kvstore/tiers/manager.py);
- ``ON_SSD``: a verified copy is on SSD, so dropping the DRAM copy loses nothing;
- ``STAGED``: an SSD or GPU value has a temporary copy for one command, in the
  arena at ``offset_units`` or, when DRAM was full, on the heap
  (``heap_copies``).

One owner: every change of an entry's tier or flags goes through `EntryTable`,
which keeps the per-tier counts and bytes that INFO reports and tells the
eviction policy where each entry lives and whether it is clean (its candidate
lists depend on both), so the three can never disagree. The same paths keep
the value bytes per tenant per tier (``tenant_bytes``): the ``owner`` column
says which tenant wrote each value (kvstore/store/quotas.py).
"""
from __future__ import annotations

from array import array

from kvstore.store.eviction import NO_PARENT, SampledLRU

DRAM, SSD, GPU = 0, 1, 2
TIERS = (DRAM, SSD, GPU)
ON_SSD = 1
STAGED = 2
# DRAM offsets are kept in units of the allocator's smallest extent (64 bytes), so
# 4 bytes address a 256 GiB arena.
OFFSET_SHIFT = 6
OFFSET_UNIT = 1 << OFFSET_SHIFT
OWNERS = 256        # tenant ids the one-byte owner column holds (0: the shared pool)


class EntryTable:
    """The columns of every entry, the free entry ids, and counts and bytes per tier."""

    def __init__(self, policy: SampledLRU):
        self.policy = policy
        self.keys: list[bytes | None] = []
        self.offset_units = array("I")
        self.size = array("I")
        self.tier = array("b")
        self.flags = array("b")
        self.owner = array("B")
        self.heap_copies: dict[int, bytes | bytearray] = {}    # entry -> staged copy outside the arena
        self.on_dram = None                  # fn(entry) when a value takes its place in the arena
        self.count_in = [0] * len(TIERS)
        self.bytes_in = [0] * len(TIERS)
        self.tenant_bytes = [[0] * OWNERS for _ in TIERS]     # tier -> owner -> value bytes
        self._free: list[int] = []

    def nbytes_per_entry(self) -> int:
        """Bytes of the columns per entry, the key list's pointer included."""
        return (self.offset_units.itemsize + self.size.itemsize + self.tier.itemsize + self.flags.itemsize
                + self.owner.itemsize + 8)

    # ------------------------------------------------------------ entries

    def add(self, key: bytes, size: int, tier: int, flags: int = 0, offset: int = 0,
            parent: int = NO_PARENT, owner: int = 0) -> int:
        """An entry for a new value of ``key`` written by tenant ``owner`` (tracked by the
        policy under ``parent``)."""
        if self._free:
            entry = self._free.pop()
            self.keys[entry] = key
            self.offset_units[entry] = offset >> OFFSET_SHIFT
            self.size[entry] = size
            self.tier[entry] = tier
            self.flags[entry] = flags
            self.owner[entry] = owner
        else:
            entry = len(self.keys)
            self.keys.append(key)
            self.offset_units.append(offset >> OFFSET_SHIFT)
            self.size.append(size)
            self.tier.append(tier)
            self.flags.append(flags)
            self.owner.append(owner)
        self.count_in[tier] += 1
        self.bytes_in[tier] += size
        self.tenant_bytes[tier][owner] += size
        self.policy.insert(entry, parent, tier)
        if flags & ON_SSD:
            self.policy.mark_clean(entry)
        if tier == DRAM and self.on_dram is not None:
            self.on_dram(entry)
        return entry

    def remove(self, entry: int) -> None:
        """Forget ``entry``; its id is handed out again."""
        tier, size = self.tier[entry], self.size[entry]
        self.count_in[tier] -= 1
        self.bytes_in[tier] -= size
        self.tenant_bytes[tier][self.owner[entry]] -= size
        if self.heap_copies:
            self.heap_copies.pop(entry, None)
        self.policy.remove(entry)
        self.keys[entry] = None
        self._free.append(entry)

    # ------------------------------------------------------------ columns

    def dram_offset(self, entry: int) -> int:
        """Where the value (or its staged copy) starts in the DRAM arena."""
        return self.offset_units[entry] << OFFSET_SHIFT

    def set_dram_offset(self, entry: int, offset: int) -> None:
        self.offset_units[entry] = offset >> OFFSET_SHIFT

    def resize(self, entry: int, size: int) -> None:
        """The value was rewritten in place with ``size`` bytes."""
        tier, change = self.tier[entry], size - self.size[entry]
        self.bytes_in[tier] += change
        self.tenant_bytes[tier][self.owner[entry]] += change
        self.size[entry] = size

    def set_tier(self, entry: int, tier: int, flags: int) -> None:
        """The value now lives in ``tier`` with ``flags``."""
        old, size = self.tier[entry], self.size[entry]
        self.count_in[old] -= 1
        self.bytes_in[old] -= size
        self.count_in[tier] += 1
        self.bytes_in[tier] += size
        owner = self.owner[entry]
        self.tenant_bytes[old][owner] -= size
        self.tenant_bytes[tier][owner] += size
        self.tier[entry] = tier
        self.policy.move(entry, tier)
        self.set_flags(entry, flags)
        if tier == DRAM and self.on_dram is not None:
            self.on_dram(entry)

    def set_flags(self, entry: int, flags: int) -> None:
        self.flags[entry] = flags
        self.policy.mark_clean(entry, bool(flags & ON_SSD))
