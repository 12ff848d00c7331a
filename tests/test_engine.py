"""Unit tests of the engine (kvstore.store.engine): index, arena extents, eviction, holds, expiry.

The engine is used directly, with a real (small, not pre-faulted) shared-memory
arena. What is checked:
- put/get, overwrites in place (same extent size) and elsewhere (another size);
- the two-step write: a reserved extent is invisible until commit, release
  gives it back;
- a full arena: `noeviction` raises OutOfMemory, `allkeys-lru` evicts and
  stays within the arena, and prefers chain leaves (the survivors of each
  chain form a prefix of it);
- holds: a value held by a read and deleted or overwritten keeps its bytes
  until the hold is released, and a hold counts only for the value it was
  taken on (not for a later value in the same slot, nor lost when the value
  moves home from a staged copy);
- chain links from clients: a key that names itself as parent, or a re-put
  that would close a parent cycle, is evicted like any other key;
- expiry, lazily on access and by the active cycle; SCAN sees every key that
  is present throughout exactly once;
- metadata per key, measured with tracemalloc over 100,000 keys of 32 hex
  characters (the figure is printed: `pytest -s -k metadata tests/test_engine.py`).
"""
from __future__ import annotations

import random
import tracemalloc

import numpy as np
import pytest

from kvstore.store.deadlines import now_ms
from kvstore.store.engine import Engine, OutOfMemory
from kvstore.store.eviction import NO_PARENT

KiB, MiB = 1 << 10, 1 << 20
VALUE_SIZE = 64 * KiB


@pytest.fixture
def make_engine():
    engines = []

    def make(dram_size: int = 1 * MiB, policy: str = "allkeys-lru") -> Engine:
        engine = Engine(dram_size, policy, prefault=False)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def pattern(seed: int, size: int = VALUE_SIZE) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def get(engine: Engine, key: bytes) -> bytes | None:
    slot = engine.get_entry(key)
    return None if slot is None else engine.value(slot)


def offset_of(engine: Engine, slot: int) -> int:
    """Where a value lives in the arena, from the address of its view."""
    view = np.frombuffer(engine.view(slot), dtype=np.uint8)
    return view.ctypes.data - engine.arena.array.ctypes.data


def arena_extents_are_disjoint(engine: Engine) -> bool:
    spans = sorted((offset_of(engine, slot), engine.allocator.chunk_size(engine.size_of(slot)))
                   for slot in engine.index.values())
    return all(a + size <= b for (a, size), (b, _) in zip(spans, spans[1:]))


# ----------------------------------------------------------------- put / get

def test_put_and_get(make_engine):
    engine = make_engine()
    engine.put(b"k", b"hello")
    engine.put(b"empty", b"")
    engine.put(b"array", np.arange(10, dtype=np.int32))
    assert get(engine, b"k") == b"hello"
    assert get(engine, b"empty") == b""
    assert get(engine, b"array") == np.arange(10, dtype=np.int32).tobytes()
    assert get(engine, b"missing") is None
    assert (engine.stats.hits, engine.stats.misses) == (3, 1)
    assert engine.value_bytes == 5 + 40
    assert engine.kv_stats() == {"hits": 3, "misses": 1, "keys": 3, "evictions": 0,
                                 "bytes_gpu": 0, "bytes_dram": 45, "bytes_ssd": 0}


def test_overwrite_in_the_same_extent_size_stays_in_place(make_engine):
    engine = make_engine()
    engine.put(b"k", b"a" * 100)
    slot = engine.lookup(b"k")
    where, used = offset_of(engine, slot), engine.allocator.used
    engine.put(b"k", b"b" * 120)                  # both take a 128-byte extent
    slot = engine.lookup(b"k")
    assert offset_of(engine, slot) == where and engine.allocator.used == used
    assert get(engine, b"k") == b"b" * 120
    assert engine.allocator.requested == 120 and engine.value_bytes == 120


def test_overwrite_with_another_size_moves_and_frees_the_old_extent(make_engine):
    engine = make_engine()
    engine.put(b"k", b"a" * 100)
    engine.put(b"k", b"b" * 1000)
    assert get(engine, b"k") == b"b" * 1000
    assert engine.allocator.used == 1024 and engine.allocator.requested == 1000
    engine.put(b"k", b"c" * 10)
    assert get(engine, b"k") == b"c" * 10 and engine.allocator.used == 64
    assert len(engine.index) == 1


def test_overwrite_drops_the_ttl_unless_kept(make_engine):
    engine = make_engine()
    for value in (b"x", b"x" * 5000):             # in place, then elsewhere
        engine.put(b"k", b"v")
        engine.expiry.set(b"k", now_ms() + 60_000)
        engine.put(b"k", value, keep_ttl=True)
        assert b"k" in engine.expiry.deadlines
        engine.put(b"k", value)
        assert b"k" not in engine.expiry.deadlines


def test_delete(make_engine):
    engine = make_engine()
    engine.put(b"k", b"v" * 1000)
    assert engine.delete(b"k") and not engine.delete(b"k")
    assert engine.lookup(b"k") is None and engine.allocator.used == 0 and engine.value_bytes == 0


def test_flush(make_engine):
    engine = make_engine()
    for i in range(50):
        engine.put(b"k%d" % i, pattern(i, 1000))
    engine.flush()
    assert not engine.index and engine.allocator.used == 0 and engine.value_bytes == 0


# ----------------------------------------------------------------- reserve / commit

def test_a_reserved_extent_is_invisible_until_commit(make_engine):
    engine = make_engine()
    engine.put(b"k", b"old")
    extent = engine.reserve(VALUE_SIZE)
    extent.view[:] = pattern(1)
    assert get(engine, b"k") == b"old"
    assert engine.lookup(b"new") is None and len(engine.index) == 1
    engine.commit(b"k", extent)
    assert get(engine, b"k") == pattern(1)
    assert engine.allocator.used == VALUE_SIZE, "the old value's extent is freed"


def test_release_gives_the_reservation_back(make_engine):
    engine = make_engine()
    extent = engine.reserve(VALUE_SIZE)
    assert engine.allocator.used == VALUE_SIZE
    engine.release(extent)
    assert engine.allocator.used == 0 and not engine.index


def test_reservations_count_against_the_arena(make_engine):
    engine = make_engine(1 * MiB, "noeviction")
    extents = [engine.reserve(VALUE_SIZE) for _ in range(16)]
    with pytest.raises(OutOfMemory):
        engine.reserve(1)
    engine.release(extents.pop())
    engine.put(b"k", b"v")


# ----------------------------------------------------------------- a full arena

def test_noeviction_raises_out_of_memory_when_full(make_engine):
    engine = make_engine(1 * MiB, "noeviction")
    for i in range(16):
        engine.put(b"k%d" % i, pattern(i))
    with pytest.raises(OutOfMemory):
        engine.put(b"one-more", b"x")
    assert engine.stats.oom_rejections == 1 and engine.stats.evictions == 0
    assert all(get(engine, b"k%d" % i) == pattern(i) for i in range(16))
    assert engine.lookup(b"one-more") is None


def test_a_value_larger_than_the_arena_evicts_nothing(make_engine):
    engine = make_engine(1 * MiB)
    engine.put(b"k", b"v")
    with pytest.raises(OutOfMemory):
        engine.reserve(1 * MiB + 1)
    assert get(engine, b"k") == b"v" and engine.stats.evictions == 0


def test_allkeys_lru_evicts_and_stays_within_the_arena(make_engine):
    engine = make_engine(1 * MiB)
    for i in range(100):
        engine.put(b"k%d" % i, pattern(i))
        assert engine.allocator.used <= 1 * MiB
    assert len(engine.index) == 16 and engine.stats.evictions == 84
    assert get(engine, b"k99") == pattern(99), "the newest value survives"
    assert arena_extents_are_disjoint(engine)
    for key, slot in engine.index.items():
        assert engine.value(slot) == pattern(int(key[1:])), "a surviving value was overwritten"


def test_allkeys_lru_keeps_recently_read_values(make_engine):
    engine = make_engine(1 * MiB)
    for i in range(16):
        engine.put(b"k%d" % i, pattern(i))
    assert get(engine, b"k0") == pattern(0)
    for _ in range(10):
        for i in range(100, 108):
            engine.put(b"k%d" % i, pattern(i))
            assert get(engine, b"k0") == pattern(0)      # read between every write
    assert engine.lookup(b"k0") is not None


def test_lowered_limit_is_respected(make_engine):
    """Below a lowered limit a big write frees bytes, oldest first: it clears no region
    (an already free one would not let it in, and once spun for hundreds of thousands of steps)."""
    engine = make_engine(1 * MiB)
    engine.limit = 256 * KiB
    for i in range(10):
        engine.put(b"k%d" % i, pattern(i))
    assert engine.allocator.used <= 256 * KiB and len(engine.index) == 4
    assert engine.stats.evict_regions == 0


def put_chain(engine: Engine, chain: int, length: int) -> list[bytes]:
    """A prompt's blocks as KV.PUT stores them: each names its predecessor as parent."""
    keys = [b"c%d-%d" % (chain, i) for i in range(length)]
    for i, key in enumerate(keys):
        engine.put(key, pattern(chain * 100 + i), parent=keys[i - 1] if i else None)
    return keys


def surviving_prefix(engine: Engine, keys: list[bytes]) -> tuple[int, int]:
    """(length of the cached prefix, number of keys cached anywhere in the chain)."""
    present = [engine.lookup(k) is not None for k in keys]
    prefix = present.index(False) if False in present else len(present)
    return prefix, sum(present)


def test_eviction_keeps_chains_as_prefixes(make_engine):
    """After every chain put, each older chain's cached blocks are a prefix of it."""
    engine = make_engine(2 * MiB)                # 32 blocks
    chains, holes = [], []
    for c in range(40):
        chains.append(put_chain(engine, c, 8))
        for old, keys in enumerate(chains):
            prefix, cached = surviving_prefix(engine, keys)
            if prefix != cached:
                holes.append((c, old, prefix, cached))
    assert holes == [], "(after chain, chain, cached prefix, cached blocks)"


def test_an_overwrite_in_place_records_a_new_parent(make_engine):
    """KV.PUT k v PARENT p over an existing k of the same extent size links k to p."""
    engine = make_engine()
    engine.put(b"p", b"x" * 100)
    engine.put(b"c", b"y" * 100)
    engine.put(b"c", b"z" * 100, parent=b"p")
    assert engine.eviction.parent_of(engine.lookup(b"c")) == engine.lookup(b"p")
    assert not engine.eviction.is_leaf(engine.lookup(b"p"))


def test_overwriting_a_parent_keeps_its_children_linked(make_engine):
    """A parent re-put with another size is still its children's parent."""
    engine = make_engine()
    engine.put(b"p", b"x" * 100)
    engine.put(b"c", b"y" * 100, parent=b"p")
    engine.put(b"p", b"w" * 1000)
    assert engine.eviction.parent_of(engine.lookup(b"c")) == engine.lookup(b"p")
    assert not engine.eviction.is_leaf(engine.lookup(b"p"))


def parents_form_a_forest(engine: Engine) -> bool:
    """Walking up from any key ends within as many steps as there are keys."""
    for slot in engine.index.values():
        node, steps = slot, 0
        while node != NO_PARENT:
            node, steps = engine.eviction.parent_of(node), steps + 1
            if steps > len(engine.index):
                return False
    return True


@pytest.mark.timeout(30)
def test_a_key_that_is_its_own_parent_is_evicted_like_any_other(make_engine):
    """KV.PUT a x PARENT a: the key must not become its own parent (eviction would loop)."""
    engine = make_engine(1 * MiB)
    engine.put(b"a", pattern(0), parent=b"a")
    assert engine.eviction.parent_of(engine.lookup(b"a")) == NO_PARENT
    engine.put(b"a", pattern(1, 2 * VALUE_SIZE), parent=b"a")      # a re-put of another size
    assert engine.eviction.parent_of(engine.lookup(b"a")) == NO_PARENT
    for i in range(40):
        engine.put(b"k%d" % i, pattern(i))
    assert engine.lookup(b"a") is None and engine.stats.evictions >= 24


@pytest.mark.timeout(30)
def test_a_parent_cycle_through_several_keys_cannot_form(make_engine):
    """a <- b <- c, then a re-put under c: a's children must not follow it (a -> c -> b -> a)."""
    engine = make_engine(1 * MiB)
    keys = put_chain(engine, 0, 3)
    engine.put(keys[0], pattern(9, 2 * VALUE_SIZE), parent=keys[2])
    assert parents_form_a_forest(engine)
    engine.put(keys[1], pattern(8, 2 * VALUE_SIZE), parent=keys[0])     # and a re-put under a descendant
    assert parents_form_a_forest(engine)
    for i in range(40):
        engine.put(b"k%d" % i, pattern(i))
    assert not any(engine.lookup(k) for k in keys)


def test_the_newest_chain_survives_whole(make_engine):
    engine = make_engine(2 * MiB)
    chains = [put_chain(engine, c, 8) for c in range(20)]
    assert engine.match_prefix(chains[-1]) == 8
    assert engine.allocator.used <= 2 * MiB


# ----------------------------------------------------------------- holds (reads in flight)

def test_a_held_value_outlives_its_delete(make_engine):
    engine = make_engine(1 * MiB, "noeviction")
    engine.put(b"k", pattern(7, 512 * KiB))
    slot = engine.get_entry(b"k")
    sending = engine.view(slot)
    token = engine.holds.hold(slot)
    assert engine.delete(b"k") and engine.lookup(b"k") is None
    engine.put(b"other", pattern(8, 512 * KiB))          # the other half of the arena
    with pytest.raises(OutOfMemory):
        engine.put(b"third", b"x")                       # the held half is still taken
    assert sending == pattern(7, 512 * KiB)
    engine.holds.release(token)
    engine.delete(b"other")
    engine.put(b"third", pattern(9, 1 * MiB))            # everything is free again
    assert engine.allocator.used == 1 * MiB


def test_a_held_value_is_not_overwritten_in_place(make_engine):
    engine = make_engine()
    engine.put(b"k", pattern(1))
    slot = engine.get_entry(b"k")
    sending = engine.view(slot)
    token = engine.holds.hold(slot)
    engine.put(b"k", pattern(2))                         # same size: would fit in place
    assert sending == pattern(1) and get(engine, b"k") == pattern(2)
    assert engine.allocator.used == 2 * VALUE_SIZE
    engine.holds.release(token)
    assert engine.allocator.used == VALUE_SIZE


def test_a_held_value_is_not_evicted(make_engine):
    engine = make_engine(1 * MiB)
    engine.put(b"held", pattern(0))
    slot = engine.get_entry(b"held")
    token = engine.holds.hold(slot)
    for i in range(1, 64):
        engine.put(b"k%d" % i, pattern(i))
    assert get(engine, b"held") == pattern(0)
    engine.holds.release(token)
    for i in range(64, 128):
        engine.put(b"k%d" % i, pattern(i))
    assert engine.lookup(b"held") is None


def test_two_holds_free_on_the_last(make_engine):
    engine = make_engine()
    engine.put(b"k", pattern(1))
    slot = engine.get_entry(b"k")
    first, second = engine.holds.hold(slot), engine.holds.hold(slot)
    engine.delete(b"k")
    engine.holds.release(first)
    assert engine.allocator.used == VALUE_SIZE
    engine.holds.release(second)
    assert engine.allocator.used == 0


def test_a_hold_on_a_deleted_value_leaves_the_next_value_in_its_slot_alone(make_engine):
    engine = make_engine()
    engine.put(b"k", pattern(1))
    slot = engine.lookup(b"k")
    old_read = engine.holds.hold(slot)
    engine.delete(b"k")
    engine.put(b"k", pattern(2))
    assert engine.lookup(b"k") == slot, "the slot id is handed out again"
    new_read = engine.holds.hold(slot)
    engine.holds.release(old_read)
    assert engine.eviction.is_held(slot)
    engine.holds.release(new_read)
    assert not engine.eviction.is_held(slot)


def test_a_hold_on_a_staged_copy_is_released_after_the_value_moves_home(make_engine):
    """A read sends an SSD value's staged copy; a second read makes the value hot and
    gives it a DRAM home; the first read's release must still count."""
    engine = make_engine()
    engine.put(b"k", pattern(1))
    slot = engine.lookup(b"k")
    engine.moves.mark_on_ssd(slot)
    engine.moves.demoted_to_ssd(slot)
    engine.moves.stage(slot, engine.reserve(VALUE_SIZE))
    read = engine.holds.hold(slot)
    engine.moves.home_in_dram(slot, engine.reserve(VALUE_SIZE))
    assert engine.allocator.used == 2 * VALUE_SIZE, "the staged copy is still being sent"
    engine.holds.release(read)
    assert not engine.eviction.is_held(slot)
    assert engine.allocator.used == VALUE_SIZE and engine.tier_of(slot) == "dram"


# ----------------------------------------------------------------- expiry

def test_lazy_expiry_on_access(make_engine):
    engine = make_engine()
    engine.put(b"gone", b"v" * 1000)
    engine.put(b"kept", b"v")
    engine.expiry.set(b"gone", now_ms() - 1)
    engine.expiry.set(b"kept", now_ms() + 60_000)
    assert get(engine, b"gone") is None and get(engine, b"kept") == b"v"
    assert engine.stats.expired == 1 and engine.allocator.used == 64
    assert engine.match_prefix([b"kept"]) == 1


def test_persist_removes_the_deadline(make_engine):
    engine = make_engine()
    engine.put(b"k", b"v")
    engine.expiry.set(b"k", now_ms() - 1)
    assert engine.expiry.persist(b"k") and not engine.expiry.persist(b"k")
    assert get(engine, b"k") == b"v"


def test_expire_cycle_drops_expired_keys_without_access(make_engine):
    engine = make_engine()
    past, future = now_ms() - 1, now_ms() + 60_000
    for i in range(200):
        engine.put(b"k%d" % i, b"v")
        engine.expiry.set(b"k%d" % i, past if i % 2 else future)
    dropped = 0
    while (n := engine.expiry.cycle()) > 0 or engine.stats.expired < 100:
        dropped += n
    assert dropped == 100 == engine.stats.expired
    assert sorted(engine.index) == sorted(b"k%d" % i for i in range(0, 200, 2))
    assert engine.expiry.cycle() == 0


# ----------------------------------------------------------------- scan

def test_scan_sees_every_key_present_throughout_once(make_engine):
    engine = make_engine(4 * MiB)
    rng = random.Random(4)
    stable = {b"s%d" % i for i in range(500)}
    churn = [b"c%d" % i for i in range(500)]
    for key in sorted(stable) + churn:
        engine.put(key, b"v")
    seen: list[bytes] = []
    cursor, fresh = 0, 0
    while True:
        cursor, keys = engine.scan(cursor, 10)
        seen += keys
        for _ in range(5):                      # keys come and go between calls
            engine.delete(rng.choice(churn))
            engine.put(b"new%d" % fresh, b"v")
            fresh += 1
        if cursor == 0:
            break
    counts = {key: seen.count(key) for key in stable}
    assert all(n == 1 for n in counts.values())


def test_scan_of_an_empty_engine(make_engine):
    assert make_engine().scan(0, 10) == (0, [])


# ----------------------------------------------------------------- metadata

def test_metadata_bytes_per_key_stay_near_200(make_engine):
    """Index overhead of 100,000 keys of 32 hex characters, measured with tracemalloc."""
    n = 100_000
    engine = make_engine(8 * MiB)               # a 1-byte value takes a 64-byte extent
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            engine.put(b"%032x" % (i * 2654435761), b"v")
        measured = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    reported = engine.metadata_bytes_per_key()
    print(f"\nmetadata bytes per key: measured {measured:.1f} (tracemalloc), "
          f"reported {reported:.1f} (Engine.metadata_bytes_per_key)")
    assert len(engine.index) == n
    assert measured < 202       # under 200 before the one-byte owner column (kvstore/store/quotas.py)
    assert abs(reported - measured) < 0.25 * measured, "the INFO figure should match the measurement"


def test_an_evicted_key_takes_its_companion_and_a_delete_does_not():
    """evict-companions (kvstore/store/companions.py): LMCache's `kv_bytes` and `metadata` keys of a
    chunk go together when eviction takes either, whichever is older; a DEL takes one key, as in Redis."""
    from kvstore.store.companions import Companions
    engine = Engine(4 * 1024 * 1024, prefault=False)
    engine.companions = Companions("kv_bytes metadata")
    engine.put(b"akv_bytes", b"a" * 1_000_000)
    engine.put(b"ametadata", b"m" * 60)
    engine.put(b"bmetadata", b"m" * 60)             # b's metadata older than its kv_bytes
    engine.put(b"bkv_bytes", b"b" * 1_000_000)
    for i in range(3):                              # room for more 1 MB values: the oldest chunks go
        engine.put(b"new%d" % i, b"n" * 1_000_000)
    assert b"akv_bytes" not in engine.index and b"ametadata" not in engine.index
    assert (b"bkv_bytes" in engine.index) == (b"bmetadata" in engine.index)
    assert engine.stats.evicted_companions >= 1
    engine.put(b"dkv_bytes", b"d" * 1000)
    engine.put(b"dmetadata", b"m" * 60)
    assert engine.delete(b"dkv_bytes") and b"dmetadata" in engine.index
    engine.close()
