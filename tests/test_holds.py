"""Unit tests of the holds on DRAM extents (kvstore.store.holds).

What is checked: a held extent's free waits for its last reader; each hold
counts in its slot's eviction entry until released; once the slot leaves
the index, releasing an old hold no longer touches the entry of whatever value
the slot id goes to next.
"""
from __future__ import annotations

from kvstore.store.allocator import BuddyAllocator
from kvstore.store.eviction import SampledLRU
from kvstore.store.holds import ExtentHolds

UNIT = 4096


def holds_over(capacity: int = 16 * UNIT) -> tuple[ExtentHolds, BuddyAllocator, SampledLRU]:
    allocator, policy = BuddyAllocator(capacity, UNIT), SampledLRU()
    return ExtentHolds(allocator, policy), allocator, policy


def test_a_held_extent_is_freed_at_its_last_release():
    holds, allocator, policy = holds_over()
    offset = allocator.alloc(UNIT)
    policy.insert(0)
    holds.hold(offset, 0)
    holds.hold(offset, 0)
    holds.free(offset, UNIT)
    assert allocator.used == UNIT and policy.is_held(0)
    holds.release(offset)
    assert allocator.used == UNIT and policy.is_held(0)
    holds.release(offset)
    assert allocator.used == 0 and not policy.is_held(0) and not holds.is_held(offset)


def test_an_unheld_extent_is_freed_at_once():
    holds, allocator, _ = holds_over()
    holds.free(allocator.alloc(UNIT), UNIT)
    assert allocator.used == 0


def test_a_hold_outliving_its_slot_leaves_the_next_value_alone():
    holds, allocator, policy = holds_over()
    old = allocator.alloc(UNIT)
    policy.insert(0)
    holds.hold(old, 0)
    holds.forget_entry(0)
    policy.remove(0)
    policy.insert(0)                          # the slot id goes to another value
    new = allocator.alloc(UNIT)
    holds.hold(new, 0)
    holds.release(old)
    assert policy.is_held(0)
    holds.release(new)
    assert not policy.is_held(0)
