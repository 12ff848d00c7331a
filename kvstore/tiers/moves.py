"""How a value changes tier in the index, once its bytes have been copied.

kvstore/tiers/manager.py decides what moves and copies the bytes on worker threads;
when a copy is done it calls one of these, on the loop thread, to flip the
slot's tier and flags (`EntryTable`) and to free or take over DRAM extents.
That is all they need: the slot table and ``free_dram`` (``ExtentHolds.free``,
kvstore/store/holds.py), which frees an extent now or, when a reader still holds
it, when the reader lets go.
"""
from __future__ import annotations

from collections.abc import Callable

from kvstore.store.arena import Extent
from kvstore.store.entries import DRAM, GPU, ON_SSD, SSD, STAGED, EntryTable


class TierMoves:
    """Tier transitions of index slots (the engine builds one: ``engine.moves``)."""

    def __init__(self, slots: EntryTable, free_dram: Callable[[int, int], None]):
        self.slots = slots
        self.free_dram = free_dram
        self.leave_listeners: list[Callable[[int], None]] = []   # fn(slot) before its DRAM home is let go
        self.on_ssd_listeners: list[Callable[[int, int], None]] = []   # fn(slot, tag): a copy is on SSD
        self.settled_listeners: list[Callable[[int], None]] = []  # fn(slot): its home is now DRAM or SSD
        self.heap_bytes = 0          # bytes of the copies staged outside the arena now

    def mark_on_ssd(self, slot: int, tag: int = 0) -> None:
        """A verified copy of the value is now on SSD; ``tag`` is what the shared index may
        publish it under once it lives there alone (0: it may not, proto/fastpath.py)."""
        self.slots.set_flags(slot, self.slots.flags[slot] | ON_SSD)
        self.noted_on_ssd(slot, tag)

    def noted_on_ssd(self, slot: int, tag: int) -> None:
        """Tell the listeners a copy is on SSD under ``tag`` (a slot made on SSD, at a restart,
        already carries the flag)."""
        for listener in self.on_ssd_listeners:
            listener(slot, tag)

    def demoted_to_ssd(self, slot: int) -> None:
        """The value is safely on SSD: let its DRAM copy go."""
        slots = self.slots
        self._leave_dram(slot)
        self.free_dram(slots.dram_offset(slot), slots.size[slot])
        slots.set_tier(slot, SSD, ON_SSD)
        self.settled(slot)

    def moved_to_gpu(self, slot: int) -> None:
        """A hot DRAM value now lives in the GPU arena (its offset is the tier manager's)."""
        slots = self.slots
        self._leave_dram(slot)
        self.free_dram(slots.dram_offset(slot), slots.size[slot])
        slots.set_tier(slot, GPU, slots.flags[slot])

    def _leave_dram(self, slot: int) -> None:
        for listener in self.leave_listeners:
            listener(slot)

    def home_in_dram(self, slot: int, extent: Extent) -> None:
        """Make a copy fetched into ``extent`` the value's home: promotion of a hot SSD
        value, or demotion of a cold GPU one (the caller frees the GPU extent).

        An SSD copy stays as a clean backup; a copy staged for a command is let go
        (freed when its reader is done).
        """
        slots = self.slots
        extent.committed = True
        self.unstage(slot)
        old_tier = slots.tier[slot]
        slots.set_dram_offset(slot, extent.offset)
        slots.set_tier(slot, DRAM, ON_SSD if old_tier == SSD else slots.flags[slot] & ON_SSD)
        self.settled(slot)

    def settled(self, slot: int) -> None:
        """The value's home is now DRAM, or SSD alone (a demotion, a promotion, a restart)."""
        for listener in self.settled_listeners:
            listener(slot)

    def stage(self, slot: int, extent: Extent) -> None:
        """Give an SSD/GPU value a temporary DRAM copy (freed by ``unstage``)."""
        extent.committed = True
        self.slots.set_dram_offset(slot, extent.offset)
        self.slots.set_flags(slot, self.slots.flags[slot] | STAGED)

    def stage_on_heap(self, slot: int, data: bytes | bytearray) -> None:
        """Stage a copy outside the arena: one read from SSD for a socket reply (RocksDB's
        own bytes), or any read while DRAM is full of values that exist nowhere else."""
        self.slots.heap_copies[slot] = data
        self.heap_bytes += len(data)
        self.slots.set_flags(slot, self.slots.flags[slot] | STAGED)

    def unstage(self, slot: int) -> None:
        """Let a staged copy go (a no-op for a value that has none)."""
        slots = self.slots
        flags = slots.flags[slot]
        if not flags & STAGED:
            return
        slots.set_flags(slot, flags & ~STAGED)
        copy = slots.heap_copies.pop(slot, None)
        if copy is None:
            self.free_dram(slots.dram_offset(slot), slots.size[slot])
        else:
            self.heap_bytes -= len(copy)
