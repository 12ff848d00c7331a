"""Unit tests of the holds on DRAM extents (kvstore.store.holds).

What is checked: a held extent's free waits for its last reader; each hold
counts in its slot's eviction entry until released; once the slot leaves
the index, releasing an old hold no longer touches the entry of whatever value
the slot id goes to next; a value staged on the heap is read with no hold.
"""
from __future__ import annotations

from kvstore.store.allocator import BuddyAllocator
from kvstore.store.entries import DRAM, SSD, STAGED, TIERS, EntryTable
from kvstore.store.eviction import SampledLRU
from kvstore.store.holds import ExtentHolds

UNIT = 4096


def holds_over(capacity: int = 16 * UNIT) -> tuple[ExtentHolds, BuddyAllocator, SampledLRU, EntryTable]:
    allocator, policy = BuddyAllocator(capacity, UNIT), SampledLRU(places=len(TIERS))
    entries = EntryTable(policy)
    return ExtentHolds(allocator, policy, entries), allocator, policy, entries


def test_a_held_extent_is_freed_at_its_last_release():
    holds, allocator, policy, entries = holds_over()
    offset = allocator.alloc(UNIT)
    entry = entries.add(b"k", UNIT, DRAM, offset=offset)
    assert [holds.hold(entry), holds.hold(entry)] == [offset, offset]     # the token is the offset
    holds.free(offset, UNIT)
    assert allocator.used == UNIT and policy.is_held(entry)
    holds.release(offset)
    assert allocator.used == UNIT and policy.is_held(entry)
    holds.release(offset)
    assert allocator.used == 0 and not policy.is_held(entry) and not holds.is_held(offset)


def test_an_unheld_extent_is_freed_at_once():
    holds, allocator, _, _ = holds_over()
    holds.free(allocator.alloc(UNIT), UNIT)
    assert allocator.used == 0


def test_a_hold_outliving_its_slot_leaves_the_next_value_alone():
    holds, allocator, policy, entries = holds_over()
    entry = entries.add(b"old", UNIT, DRAM, offset=allocator.alloc(UNIT))
    old = holds.hold(entry)
    holds.forget_entry(entry)
    entries.remove(entry)
    assert entries.add(b"new", UNIT, DRAM, offset=allocator.alloc(UNIT)) == entry   # the id goes to another value
    new = holds.hold(entry)
    holds.release(old)
    assert policy.is_held(entry)
    holds.release(new)
    assert not policy.is_held(entry)


def test_a_value_staged_on_the_heap_is_read_without_a_hold():
    holds, _, policy, entries = holds_over()
    entry = entries.add(b"k", UNIT, SSD, STAGED)
    entries.heap_copies[entry] = bytes(UNIT)
    token = holds.hold(entry)
    assert token is None and not policy.is_held(entry)
    holds.release(token)
