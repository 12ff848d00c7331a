"""Reads in flight on DRAM extents, and the frees that wait for them.

A value is sent from the arena (or copied to another tier) on the socket's or
a worker thread's time, after the command that asked for it has returned.
Meanwhile a delete, an overwrite or a move may let the value go: its extent
must not be handed out again, nor rewritten, until the last reader is done.

A reader holds an entry's value (`hold`) and gets back a token, the extent's
offset in the arena, that it hands to `release` when done; a value staged on
the heap needs no hold (the reader's view keeps it alive) and gets None. A
hold names the extent by that offset, counts the extent's readers, and
remembers which entry it counts against in eviction, so that the release of a
hold taken before the value moved home from a staged copy, or before its entry
id went to another value, counts against the right entry (or against none).
"""
from __future__ import annotations

from kvstore.store.allocator import BuddyAllocator
from kvstore.store.entries import EntryTable
from kvstore.store.eviction import SampledLRU


class ExtentHolds:
    """Readers per held DRAM extent; frees of held extents deferred to the last release."""

    def __init__(self, allocator: BuddyAllocator, policy: SampledLRU, entries: EntryTable):
        self.allocator = allocator
        self.policy = policy
        self.entries = entries
        self.readers: dict[int, int] = {}       # held offset -> reads in flight (read directly on the SET path)
        self._entry: dict[int, int] = {}         # held offset -> the entry it counts as held in eviction
        self._doomed: dict[int, int] = {}       # held offset -> size, freed at the last release

    def hold(self, entry: int) -> int | None:
        """Keep the value of ``entry`` in place while it is read (sent, or copied to
        another tier): the policy keeps it and its extent is neither freed nor
        rewritten. Returns the token for `release`: the value's offset in the
        arena, or None for a value staged on the heap."""
        entries = self.entries
        if entries.heap_copies and entry in entries.heap_copies:
            return None
        offset = entries.dram_offset(entry)
        self.readers[offset] = self.readers.get(offset, 0) + 1
        self._entry[offset] = entry
        self.policy.hold(entry)
        return offset

    def release(self, offset: int | None) -> None:
        """One read of the value held at ``offset`` (`hold`'s token) is done."""
        if offset is None:
            return
        entry = self._entry.get(offset)
        if entry is not None:
            self.policy.release_hold(entry)
        left = self.readers[offset] - 1
        if left:
            self.readers[offset] = left
            return
        del self.readers[offset]
        self._entry.pop(offset, None)
        if offset in self._doomed:
            self.allocator.free(offset, self._doomed.pop(offset))

    def is_held(self, offset: int) -> bool:
        return offset in self.readers

    def free(self, offset: int, size: int) -> None:
        """Free an extent now, or when its last reader lets go."""
        if offset in self.readers:
            self._doomed[offset] = size
        else:
            self.allocator.free(offset, size)

    def forget_entry(self, entry: int) -> None:
        """``entry`` is leaving the index: reads still in flight on its extents no
        longer count in the policy (the entry id may go to another value)."""
        if self._entry and self.policy.is_held(entry):
            self._entry = {offset: held for offset, held in self._entry.items() if held != entry}
