"""How a value changes tier in the engine's index (the engine's half of tiering).

kvstore/tiering.py decides what moves and does the copying on worker threads;
these methods, mixed into `Engine`, flip a slot's tier and flags and free or
take over its DRAM extent once the copy is done, on the loop thread. They
touch the engine's per-slot columns, which is why they live with it and not
in the TierManager.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.eviction import NO_PARENT

if TYPE_CHECKING:
    from kvstore.engine import Extent

# Where a slot's value lives (the ``_tier`` column).
DRAM, SSD, GPU = 0, 1, 2
# ``_flags`` bits.
ON_SSD = 1        # a verified copy is on SSD: dropping the DRAM copy loses nothing
STAGED = 2        # an SSD/GPU value with a temporary DRAM copy for one command
BLOCK_SHIFT = 6   # the allocator's smallest block is 64 bytes


class TierMoves:
    """Tier transitions of index slots; mixed into kvstore.engine.Engine."""

    def tier_code(self, slot: int) -> int:
        return self._tier[slot]

    def flags_of(self, slot: int) -> int:
        return self._flags[slot]

    def mark_on_ssd(self, slot: int) -> None:
        self._flags[slot] |= ON_SSD

    def demoted_to_ssd(self, slot: int) -> None:
        """The value is safely on SSD: let its DRAM copy go."""
        size = self._size[slot]
        self.free_dram(self._dram_offset(slot), size)
        self._tier[slot] = SSD
        self._flags[slot] = ON_SSD
        self.tier_bytes[DRAM] -= size
        self.tier_bytes[SSD] += size
        if self.tiers is not None:
            self.tiers.stats[DRAM].demotions += 1

    def stage(self, slot: int, extent: Extent) -> None:
        """Give an SSD/GPU value a temporary DRAM copy (freed by ``unstage``)."""
        extent.committed = True
        self._block[slot] = extent.offset >> BLOCK_SHIFT
        self._flags[slot] |= STAGED

    def stage_on_heap(self, slot: int, data: bytearray) -> None:
        """Stage a copy outside the arena: DRAM is full of values that exist nowhere else."""
        self._heap_staged[slot] = data
        self._flags[slot] |= STAGED

    def unstage(self, slot: int) -> None:
        if self._flags[slot] & STAGED:
            self._flags[slot] &= ~STAGED
            if self._heap_staged.pop(slot, None) is None:
                self.free_dram(self._dram_offset(slot), self._size[slot])

    def promote_to_dram(self, slot: int, extent: Extent) -> None:
        """Make a fetched copy the value's home (the SSD copy stays as a clean backup)."""
        extent.committed = True
        old_tier, size = self._tier[slot], self._size[slot]
        if old_tier == GPU:
            self.tiers.free_gpu(slot, size)
        self._block[slot] = extent.offset >> BLOCK_SHIFT
        self._flags[slot] = ON_SSD if old_tier == SSD else 0
        self._tier[slot] = DRAM
        self.tier_bytes[old_tier] -= size
        self.tier_bytes[DRAM] += size

    def moved_to_gpu(self, slot: int) -> None:
        """A hot DRAM value now lives in the GPU arena (its offset is the GPU tier's)."""
        size = self._size[slot]
        self.free_dram(self._dram_offset(slot), size)
        self._tier[slot] = GPU
        self.tier_bytes[DRAM] -= size
        self.tier_bytes[GPU] += size

    def add_from_ssd(self, key: bytes, size: int, parent: bytes | None) -> None:
        """Index a value found on SSD at start-up (a newer value in DRAM wins)."""
        if key in self.index:
            return
        slot = self._new_slot(key)
        self._size[slot] = size
        self._tier[slot] = SSD
        self._flags[slot] = ON_SSD
        self.value_bytes += size
        self.tier_bytes[SSD] += size
        self.index[key] = slot
        parent_slot = self.index.get(parent, NO_PARENT) if parent is not None else NO_PARENT
        self.eviction.insert(slot, parent_slot)

    def coldest(self, tier: int) -> int | None:
        """The next value to move out of ``tier``: never a leased one, and never a
        parent whose child is still in the tier (a demotion can wait for a lease)."""
        return self.eviction.victim(among=[(self._tier, tier)], allow_parent=False)
