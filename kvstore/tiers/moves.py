"""How a value changes tier in the index, once its bytes have been copied.

kvstore/tiers/manager.py decides what moves and copies the bytes on worker threads;
when a copy is done it calls one of these, on the loop thread, to flip the
entry's tier and flags (`EntryTable`) and to free or take over DRAM extents.
That is all they need: the entry table and ``free_dram`` (``ExtentHolds.free``,
kvstore/store/holds.py), which frees an extent now or, when a reader still holds
it, when the reader lets go.
"""
from __future__ import annotations

from collections.abc import Callable

from kvstore.store.arena import Extent
from kvstore.store.entries import DRAM, GPU, ON_SSD, SSD, STAGED, EntryTable


class TierMoves:
    """Tier transitions of index entries (the engine builds one: ``engine.moves``)."""

    def __init__(self, entries: EntryTable, free_dram: Callable[[int, int], None]):
        self.entries = entries
        self.free_dram = free_dram
        self.leave_listeners: list[Callable[[int], None]] = []   # fn(entry) before its DRAM home is let go
        self.on_ssd_listeners: list[Callable[[int, int], None]] = []   # fn(entry, tag): a copy is on SSD
        self.settled_listeners: list[Callable[[int], None]] = []  # fn(entry): its home is now DRAM or SSD
        self.heap_bytes = 0          # bytes of the copies staged outside the arena now

    def mark_on_ssd(self, entry: int, tag: int = 0) -> None:
        """A verified copy of the value is now on SSD; ``tag`` is what the shared index may
        publish it under once it lives there alone (0: it may not, proto/fastpath.py)."""
        self.entries.set_flags(entry, self.entries.flags[entry] | ON_SSD)
        self.noted_on_ssd(entry, tag)

    def noted_on_ssd(self, entry: int, tag: int) -> None:
        """Tell the listeners a copy is on SSD under ``tag`` (an entry made on SSD, at a restart,
        already carries the flag)."""
        for listener in self.on_ssd_listeners:
            listener(entry, tag)

    def demoted_to_ssd(self, entry: int) -> None:
        """The value is safely on SSD: let its DRAM copy go."""
        entries = self.entries
        self._leave_dram(entry)
        self.free_dram(entries.dram_offset(entry), entries.size[entry])
        entries.set_tier(entry, SSD, ON_SSD)
        self.settled(entry)

    def moved_to_gpu(self, entry: int) -> None:
        """A hot DRAM value now lives in the GPU arena (its offset is the tier manager's)."""
        entries = self.entries
        self._leave_dram(entry)
        self.free_dram(entries.dram_offset(entry), entries.size[entry])
        entries.set_tier(entry, GPU, entries.flags[entry])

    def _leave_dram(self, entry: int) -> None:
        for listener in self.leave_listeners:
            listener(entry)

    def home_in_dram(self, entry: int, extent: Extent) -> None:
        """Make a copy fetched into ``extent`` the value's home: promotion of a hot SSD
        value, or demotion of a cold GPU one (the caller frees the GPU extent).

        An SSD copy stays as a clean backup; a copy staged for a command is let go
        (freed when its reader is done).
        """
        entries = self.entries
        extent.committed = True
        self.unstage(entry)
        old_tier = entries.tier[entry]
        entries.set_dram_offset(entry, extent.offset)
        entries.set_tier(entry, DRAM, ON_SSD if old_tier == SSD else entries.flags[entry] & ON_SSD)
        self.settled(entry)

    def settled(self, entry: int) -> None:
        """The value's home is now DRAM, or SSD alone (a demotion, a promotion, a restart)."""
        for listener in self.settled_listeners:
            listener(entry)

    def stage(self, entry: int, extent: Extent) -> None:
        """Give an SSD/GPU value a temporary DRAM copy (freed by ``unstage``)."""
        extent.committed = True
        self.entries.set_dram_offset(entry, extent.offset)
        self.entries.set_flags(entry, self.entries.flags[entry] | STAGED)

    def stage_on_heap(self, entry: int, data: bytes | bytearray) -> None:
        """Stage a copy outside the arena: one read from SSD for a socket reply (RocksDB's
        own bytes), or any read while DRAM is full of values that exist nowhere else."""
        self.entries.heap_copies[entry] = data
        self.heap_bytes += len(data)
        self.entries.set_flags(entry, self.entries.flags[entry] | STAGED)

    def unstage(self, entry: int) -> None:
        """Let a staged copy go (a no-op for a value that has none)."""
        entries = self.entries
        flags = entries.flags[entry]
        if not flags & STAGED:
            return
        entries.set_flags(entry, flags & ~STAGED)
        copy = entries.heap_copies.pop(entry, None)
        if copy is None:
            self.free_dram(entries.dram_offset(entry), entries.size[entry])
        else:
            self.heap_bytes -= len(copy)
