"""Unit tests of the buddy allocator (kvstore.store.allocator).

The allocator only does offset arithmetic, so it is driven directly: random
alloc/free sequences (hypothesis) checked against a model of the live
extents after every step (the largest free extent against one computed by
brute force from the live extents alone), then the arena emptied and
allocated again in the largest pieces it can hold. Arenas of power-of-two and other sizes.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.store.allocator import QUICK_LIMIT, QUICK_MAX_ORDER, BuddyAllocator

KiB, MiB = 1 << 10, 1 << 20


def power_of_two_pieces(capacity: int) -> list[int]:
    """The binary decomposition of ``capacity``, largest first."""
    return [1 << bit for bit in range(capacity.bit_length() - 1, -1, -1) if capacity >> bit & 1]


def largest_aligned_piece(start: int, end: int) -> int:
    """The largest 2**k-byte extent aligned to 2**k that fits in [start, end)."""
    largest = 0
    while start < end:
        piece = 1 << ((end - start).bit_length() - 1)
        if start:
            piece = min(piece, start & -start)
        largest = max(largest, piece)
        start += piece
    return largest


class Model:
    """The live extents an allocator has handed out, and the invariants they obey."""

    def __init__(self, alloc: BuddyAllocator):
        self.alloc = alloc
        self.live: dict[int, int] = {}      # offset -> requested size

    def allocate(self, size: int) -> int | None:
        offset = self.alloc.alloc(size)
        if offset is None:
            # A failed alloc has merged the quick lists back, so the figure is exact.
            assert self.alloc.largest_free() < self.alloc.chunk_size(size)
        else:
            assert offset not in self.live
            self.live[offset] = size
        return offset

    def free(self, offset: int) -> None:
        self.alloc.free(offset, self.live.pop(offset))

    def check(self) -> None:
        alloc, end = self.alloc, 0
        for offset in sorted(self.live):
            chunk = alloc.chunk_size(self.live[offset])
            assert offset >= end, "two live extents overlap"
            assert offset % chunk == 0, "a chunk is not aligned to its size"
            end = offset + chunk
        assert end <= alloc.capacity
        assert alloc.used == sum(alloc.chunk_size(s) for s in self.live.values())
        assert alloc.requested == sum(self.live.values())
        assert alloc.free_bytes == alloc.capacity - alloc.used
        assert 0.0 <= alloc.internal_fragmentation() < 1.0
        assert 0.0 <= alloc.external_fragmentation() < 1.0
        assert alloc.largest_free() == self.largest_free_by_brute_force()

    def largest_free_by_brute_force(self) -> int:
        """The largest aligned power-of-two extent that overlaps no live extent.

        Computed from the live extents alone, without the allocator's free
        lists: every gap between live extents (cut at the top-chunk bounds)
        is split into its maximal aligned pieces, largest first where it can.
        """
        alloc = self.alloc
        bounds = [0]
        for piece in power_of_two_pieces(alloc.capacity):
            bounds.append(bounds[-1] + piece)
        taken = sorted((offset, offset + alloc.chunk_size(size)) for offset, size in self.live.items())
        taken += [(bound, bound) for bound in bounds]
        largest, start = 0, 0
        for begin, end in sorted(taken):
            largest = max(largest, largest_aligned_piece(start, begin))
            start = max(start, end)
        return largest

    def free_all(self) -> None:
        for offset in list(self.live):
            self.free(offset)
        assert self.alloc.used == self.alloc.requested == 0


CAPACITIES = [1 * MiB, 4 * MiB + 64 * 3, 3 * MiB + 5 * KiB, 1_000_003, 64 * 37]
sizes = st.one_of(st.integers(1, 200), st.integers(1, 70 * KiB), st.sampled_from([64 * KiB, 256 * KiB]))
operations = st.lists(st.tuples(st.booleans(), sizes, st.integers(0, 2**16)), max_size=300)


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(CAPACITIES), operations)
def test_random_alloc_free_keeps_invariants(capacity, ops):
    model = Model(BuddyAllocator(capacity))
    for is_alloc, size, pick in ops:
        if is_alloc or not model.live:
            model.allocate(size)
        else:
            model.free(sorted(model.live)[pick % len(model.live)])
        model.check()
    assert_largest_free_is_allocatable(model)
    model.free_all()
    assert_whole_arena_allocatable(model.alloc)


def assert_largest_free_is_allocatable(model: Model) -> None:
    """INFO's largest free extent is what one allocation can really get, and no more."""
    largest = model.alloc.largest_free()
    if largest:
        assert model.allocate(largest) is not None
    if largest < model.alloc.capacity:
        assert model.alloc.alloc(max(largest, 32) * 2) is None


def assert_whole_arena_allocatable(alloc: BuddyAllocator) -> None:
    """An empty arena gives back its top chunks, largest first, and then nothing."""
    offsets = [alloc.alloc(piece) for piece in power_of_two_pieces(alloc.capacity)]
    assert None not in offsets and len(set(offsets)) == len(offsets)
    assert alloc.used == alloc.capacity
    assert alloc.alloc(1) is None


def test_power_of_two_arena_is_one_piece_after_freeing_everything():
    alloc = BuddyAllocator(1 * MiB)
    rng = random.Random(7)
    model = Model(alloc)
    while model.allocate(rng.choice([100, 4 * KiB, 64 * KiB, 1000])) is not None:
        pass
    model.check()
    order = list(model.live)
    rng.shuffle(order)
    for offset in order:
        model.free(offset)
    assert alloc.alloc(1 * MiB) == 0
    assert alloc.used == 1 * MiB


def test_quick_lists_overflow_into_the_tree():
    alloc = BuddyAllocator(1 * MiB)
    offsets = [alloc.alloc(64) for _ in range(QUICK_LIMIT + 100)]
    for offset in offsets:
        alloc.free(offset, 64)
    assert alloc.alloc(1 * MiB) == 0


def test_non_power_of_two_arena_is_carved_into_aligned_top_chunks():
    capacity = 3 * MiB + 5 * KiB + 100          # not a multiple of min_chunk either
    alloc = BuddyAllocator(capacity)
    assert alloc.capacity == capacity - capacity % 64
    assert_whole_arena_allocatable(alloc)
    assert alloc.alloc(2 * MiB) is None


def test_every_min_chunk_of_an_odd_arena_is_handed_out_once():
    alloc = BuddyAllocator(64 * 37)
    offsets = [alloc.alloc(1) for _ in range(37)]
    assert sorted(offsets) == [64 * i for i in range(37)]
    assert alloc.alloc(1) is None


def test_sizes_round_up_to_powers_of_two():
    alloc = BuddyAllocator(1 * MiB)
    assert [alloc.chunk_size(n) for n in (1, 64, 65, 100, 4096, 4097, 64 * KiB)] \
        == [64, 64, 128, 128, 4096, 8192, 64 * KiB]
    assert alloc.fits(1 * MiB) and not alloc.fits(1 * MiB + 1)
    assert BuddyAllocator(1 * MiB, min_chunk=4096).chunk_size(1) == 4096


def test_min_chunk_must_be_a_power_of_two():
    with pytest.raises(ValueError):
        BuddyAllocator(1 * MiB, min_chunk=96)


def test_value_larger_than_a_non_power_of_two_arena_does_not_fit():
    alloc = BuddyAllocator(3 * MiB)
    assert alloc.fits(2 * MiB) and not alloc.fits(2 * MiB + 1)


# ----------------------------------------------------------------- fragmentation

def test_internal_fragmentation_is_the_rounding_loss():
    alloc = BuddyAllocator(1 * MiB)
    assert alloc.internal_fragmentation() == 0.0
    alloc.alloc(100)
    assert alloc.internal_fragmentation() == pytest.approx(1 - 100 / 128)
    alloc.alloc(4096)
    assert alloc.internal_fragmentation() == pytest.approx(1 - 4196 / (128 + 4096))


def test_external_fragmentation_of_a_checkerboard():
    alloc = BuddyAllocator(1 * KiB)
    offsets = [alloc.alloc(64) for _ in range(16)]
    assert alloc.external_fragmentation() == 0.0          # full: no free space at all
    for offset in offsets[::2]:
        alloc.free(offset, 64)
    assert alloc.largest_free() == 64
    assert alloc.external_fragmentation() == pytest.approx(1 - 64 / 512)
    assert alloc.alloc(128) is None


def test_fresh_arena_is_not_fragmented():
    alloc = BuddyAllocator(1 * MiB)
    assert alloc.largest_free() == 1 * MiB
    assert alloc.external_fragmentation() == 0.0


def test_freed_small_chunks_do_not_count_as_fragmentation():
    """Every chunk freed: one allocation can take the whole arena, so the figure must say so."""
    alloc = BuddyAllocator(1 * KiB)
    offsets = [alloc.alloc(64) for _ in range(16)]
    for offset in offsets:
        alloc.free(offset, 64)
    assert alloc.largest_free() == 1 * KiB
    assert alloc.external_fragmentation() == 0.0


def test_quick_lists_cover_chunks_up_to_their_order():
    alloc = BuddyAllocator(4 * MiB)
    big = 1 << (QUICK_MAX_ORDER + 1)
    offset = alloc.alloc(big)
    alloc.free(offset, big)                      # too big for a quick list: merged at once
    assert alloc.largest_free() == 4 * MiB


def test_quick_listed_neighbours_merge_each_at_their_own_order():
    """Three freed 64-byte chunks hold a 128-byte extent, not 256: each quick-listed chunk merges from its own order."""
    alloc = BuddyAllocator(1 * KiB)
    offsets = sorted(alloc.alloc(64) for _ in range(16))
    for offset in offsets[:3]:
        alloc.free(offset, 64)
    assert alloc.largest_free() == 128
    assert alloc.external_fragmentation() == pytest.approx(1 - 128 / 192)
