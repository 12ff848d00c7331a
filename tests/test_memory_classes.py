"""Memory by size: slab classes, eviction that frees what a write needs, a bound per loop turn.

Small values live in slab pages of their size class (kvstore/store/slabs.py);
making room for a write frees one slot, one page or one region of the write's
size, the coldest that can become free (kvstore/store/room.py). The clock is
fake: each reading advances it by a fixed step, so "time" is the number of
readings and nothing here depends on the host's speed.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from kvstore.store.engine import Engine, NeedsRoom, OutOfMemory

KiB, MiB = 1 << 10, 1 << 20


class FakeClock:
    def __init__(self, step: float = 1e-5):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


@pytest.fixture
def make_engine():
    engines = []

    def make(size: int = 16 * MiB) -> Engine:
        engine = Engine(size, prefault=False)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def put_until_room(engine: Engine, key: bytes, value: bytes, parent: bytes | None = None) -> int:
    """Put as a connection would: on NeedsRoom, a new turn and again. Returns the turns taken."""
    turns = 0
    while True:
        try:
            engine.put(key, value, parent)
            return turns
        except NeedsRoom:
            turns += 1
            engine.room.new_turn()


def pages_of(engine: Engine, size: int) -> int:
    """Slab pages of the class of values of ``size`` bytes."""
    alloc = engine.allocator
    return alloc.slab_pages[alloc.class_of(size)]


def test_small_values_pack_into_pages_of_their_class(make_engine):
    engine = make_engine(16 * MiB)                   # 64 KiB pages
    for i in range(10_000):
        engine.put(b"s%d" % i, b"x" * 100)           # 128-byte class: 512 a page
    alloc = engine.allocator
    assert alloc.page == 64 * KiB and pages_of(engine, 100) == 20 and alloc.footprint == 20 * 64 * KiB
    assert alloc.chunk_size(100) == 128 and alloc.chunk_size(1000) == 1024 and alloc.chunk_size(1100) == 1280
    assert alloc.largest_free() >= 8 * MiB           # the rest stays in big pieces


def test_a_burst_of_big_values_frees_whole_pages_and_no_more(make_engine):
    engine = make_engine(16 * MiB)
    for i in range(40_000):                          # 79 pages of small values, the oldest data
        engine.put(b"s%d" % i, b"x" * 100)
    big = b"y" * MiB
    for i in range(14):                              # 14 MiB more than the 11 MiB free
        engine.put(b"b%d" % i, big)
    small_left = sum(key.startswith(b"s") for key in engine.index)
    assert all(engine.lookup(b"b%d" % i) is not None for i in range(14))
    # the oldest small values went a region at a time: 3 MiB's worth, not all of them
    assert small_left == 40_000 - 3 * 8192 and engine.stats.evict_regions == 3
    assert engine.stats.evicted_for_big == 40_000 - small_left
    assert engine.allocator.used <= 16 * MiB


def test_classes_trade_pages_as_the_mix_changes(make_engine):
    """All memory to one class, then another class takes it over, then back: no class starves."""
    engine = make_engine(16 * MiB)
    for i in range(16 * 8192):                       # the whole arena in 128-byte values
        engine.put(b"a%d" % i, b"a" * 100)
    assert pages_of(engine, 100) == 256
    for i in range(16 * 1024):                       # 1 KiB values, written later: they take pages
        engine.put(b"b%d" % i, b"b" * 1000)
    assert pages_of(engine, 1000) >= 224 and pages_of(engine, 100) <= 32
    assert engine.stats.evict_regions >= 224         # pages were cleared for the new class
    for i in range(16 * 8192):                       # and back
        engine.put(b"c%d" % i, b"c" * 100)
    assert pages_of(engine, 100) >= 224
    alloc = engine.allocator
    assert alloc.footprint == 16 * MiB and alloc.used >= 0.85 * alloc.capacity


def test_a_new_class_gets_a_page_when_memory_is_full(make_engine):
    engine = make_engine(16 * MiB)
    for i in range(16):
        engine.put(b"big%d" % i, b"z" * MiB)
    engine.put(b"tiny", b"t")
    assert engine.lookup(b"tiny") is not None and pages_of(engine, 1) == 1
    assert len(engine.index) == 16                   # one big value made way for the page


def test_no_turn_evicts_past_the_bound(make_engine):
    """A write that needs 8,192 evictions: each turn evicts for at most the slice, the write
    waits for later turns and lands."""
    engine = make_engine(16 * MiB)
    for i in range(16 * 8192):
        engine.put(b"s%d" % i, b"x" * 100)
    clock = FakeClock(step=1e-5)
    engine.room.clock, engine.room.budget = clock, 1e-3
    turns = put_until_room(engine, b"big", b"y" * MiB)
    assert engine.lookup(b"big") is not None
    assert turns > 10 and engine.stats.evict_deferrals == turns
    # one slice is the budget plus at most one step's readings (a step reads the clock a few times)
    assert engine.room.max_slice <= 1e-3 + 5 * clock.step
    assert engine.stats.evictions == 8192


def test_a_long_chain_drains_from_its_tail_within_the_bound(make_engine):
    engine = make_engine(16 * MiB)
    chain = [b"c%06d" % i for i in range(60_000)]                 # 29.3 pages of 128-byte blocks
    for i, key in enumerate(chain):
        engine.put(key, b"x" * 100, parent=chain[i - 1] if i else None)
    clock = FakeClock(step=1e-5)
    engine.room.clock, engine.room.budget = clock, 1e-3
    big = b"y" * MiB
    for i in range(12):
        put_until_room(engine, b"b%d" % i, big)
    present = [engine.lookup(key) is not None for key in chain]
    kept = sum(present)
    assert present == [True] * kept + [False] * (len(chain) - kept), "what stays is a prefix"
    assert 0 < kept < len(chain) and engine.room.max_slice <= 1e-3 + 5 * clock.step
    assert engine.stats.evicted_beyond_region == 0


def test_mixed_sizes_keep_every_chain_a_prefix(make_engine):
    engine = make_engine(8 * MiB)
    rng = random.Random(7)
    sizes = [64, 100, 700, 3000, 20_000, 100 * KiB, 300 * KiB, 700 * KiB]
    chains = []
    for c in range(60):
        size = rng.choice(sizes)
        longest = max(1, 3 * MiB // size)             # a chain fits in well under the arena
        keys = [b"p%d-%d" % (c, i) for i in range(rng.randint(1, min(40, longest)))]
        for i, key in enumerate(keys):
            tail = i == len(keys) - 1
            put_until_room(engine, key, b"v" * (size // 3 if tail else size), keys[i - 1] if i else None)
        chains.append(keys)
        for keys in chains:
            present = [engine.lookup(key) is not None for key in keys]
            kept = sum(present)
            assert present == [True] * kept + [False] * (len(keys) - kept)
    assert engine.stats.evictions > 0 and engine.allocator.used <= 8 * MiB


def test_a_value_larger_than_dram_is_refused_without_evicting(make_engine):
    engine = make_engine(4 * MiB)
    for i in range(100):
        engine.put(b"k%d" % i, b"x" * 1000)
    with pytest.raises(OutOfMemory, match="larger than the DRAM tier"):
        engine.put(b"huge", b"h" * (5 * MiB))
    assert engine.stats.evictions == 0 and len(engine.index) == 100


def test_a_waiting_write_gets_the_extent_made_for_it(make_engine):
    engine = make_engine(16 * MiB)
    for i in range(16 * 8192):
        engine.put(b"s%d" % i, b"x" * 100)
    engine.room.clock, engine.room.budget = FakeClock(step=1e-5), 1e-3
    with pytest.raises(NeedsRoom):
        engine.put(b"big", b"y" * MiB)

    async def wait():
        await engine.room.wait(MiB)

    asyncio.run(wait())
    assert engine.room.parked[MiB]
    engine.put(b"big", b"y" * MiB)                   # takes the parked extent, evicts nothing more
    assert not engine.room.parked[MiB] and engine.stats.evictions == 8192
    asyncio.run(wait())                              # one no write comes back for goes at FLUSHALL
    assert engine.room.parked[MiB]
    engine.flush()
    assert not engine.room.parked and engine.allocator.used == 0


def test_fragmentation_is_reported(make_engine):
    engine = make_engine(16 * MiB)
    for i in range(8192 + 10):
        engine.put(b"s%d" % i, b"x" * 100)
    for i in range(0, 8192 + 10, 2):
        engine.delete(b"s%d" % i)
    alloc = engine.allocator
    # half of 16 full pages, and the 17th page's unused slots
    assert alloc.slack_bytes() == (16 * 256 + 512 - 5) * 128
    # the 17th page leaves 64, 128, 256 and 512 KiB pieces in the second MiB: smaller than a 1 MiB value
    assert alloc.fragmented_bytes(MiB) == alloc.slack_bytes() + 960 * KiB
    assert alloc.largest_free() == 8 * MiB


def test_a_big_value_takes_a_run_of_free_pages_across_chunk_edges():
    from kvstore.store.slabs import SlabAllocator
    alloc = SlabAllocator(16 * MiB, page=64 * KiB)
    first = alloc.alloc(3 * MiB)                     # a 4 MiB chunk: its last MiB goes back
    second = alloc.alloc(4 * MiB)
    alloc.alloc(8 * MiB - 64 * KiB)                  # all but one page of the upper half
    alloc.free(second, 4 * MiB)
    assert alloc.largest_free() == 4 * MiB and alloc.free_bytes == 5 * MiB + 64 * KiB
    # 4.5 MiB: no aligned 8 MiB chunk is free, but 3 MiB .. 8 MiB is one run of 5 MiB
    offset = alloc.alloc(4 * MiB + 512 * KiB)
    assert offset == 3 * MiB and alloc.footprint == 16 * MiB - 64 * KiB - 512 * KiB
    alloc.free(offset, 4 * MiB + 512 * KiB)
    alloc.free(first, 3 * MiB)
    assert alloc.largest_free() == 8 * MiB and alloc.buddy.is_free(0, 23)


def test_region_owners_names_each_value_once_in_page_order():
    from kvstore.store.slabs import SlabAllocator
    alloc = SlabAllocator(16 * MiB, page=64 * KiB)
    big = alloc.alloc(3 * MiB)                       # 48 pages
    small = alloc.alloc(100)                         # a slab page after it
    alloc.set_owner(big, 3 * MiB, 7)
    alloc.set_owner(small, 100, 3)
    assert alloc.region_owners(0, 4 * MiB).tolist() == [3, 7]          # slab slots first, then extents
    assert alloc.region_owners(MiB, 2 * MiB).tolist() == [7]           # a region inside the extent


def test_a_big_write_clears_a_window_of_its_own_pages_not_an_aligned_chunk(make_engine):
    engine = make_engine(16 * MiB)
    for i in range(16):
        engine.put(b"m%d" % i, b"m" * MiB)           # the arena full of 1 MiB values
    engine.put(b"big", b"b" * (3 * MiB))             # an aligned 4 MiB chunk would evict 4 of them
    assert engine.stats.evictions == 3 and engine.lookup(b"big") is not None
    assert engine.allocator.footprint == 16 * MiB


def test_a_window_partly_free_costs_less_than_a_full_one_as_cold(make_engine):
    from kvstore.store.room import BYTES_WEIGHT
    engine = make_engine(16 * MiB)
    for i in range(16):
        engine.put(b"m%d" % i, b"m" * MiB)
    key_at = {engine.entries.dram_offset(engine.index[b"m%d" % i]): b"m%d" % i for i in range(16)}
    engine.delete(key_at[13 * MiB])
    engine.get_entry(key_at[14 * MiB])               # the newest value of both windows below
    room, clock = engine.room, engine.eviction.clock
    full = room._price(14 * MiB, 2 * MiB, 0, clock)  # the value at 14 MiB and the one at 15
    half = room._price(13 * MiB, 2 * MiB, 0, clock)  # free space and the value at 14 MiB
    assert half < full and full - half >= BYTES_WEIGHT * 0.4


def test_the_oldest_values_go_even_beside_a_window_that_newer_writes_reuse(make_engine):
    """A window partly free is cheap; were the oldest leaf's bytes to count against a window
    holding it, the writes would keep clearing the window beside it and never reach it."""
    engine = make_engine(8 * MiB)                    # 64 KiB pages
    engine.put(b"old-a", b"a" * (64 * KiB))
    engine.put(b"old-b", b"b" * (64 * KiB), b"old-a")
    engine.put(b"old-c", b"c" * (128 * KiB), b"old-b")
    old = {b"old-a", b"old-b", b"old-c"}
    for n in range(64):                              # 16 MiB of newer values, 256 KiB each
        put_until_room(engine, b"new-%d" % n, b"n" * (256 * KiB))
        if not old & engine.index.keys():
            break
    assert not old & engine.index.keys(), "the oldest values outlived two passes over the arena"
