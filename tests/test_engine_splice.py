"""Engine.splice (APPEND, SETRANGE): in place when the chunk has room, else one copy;
either way readers and the shared index see an overwrite, and TTL and chain parent stay."""
from __future__ import annotations

import pytest

from kvstore.store.engine import Engine

MiB = 1 << 20


@pytest.fixture
def engine():
    engine = Engine(1 * MiB, "allkeys-lru", prefault=False)
    yield engine
    engine.close()


def offset_of(engine: Engine, key: bytes) -> int:
    return engine.entries.dram_offset(engine.lookup(key))


def test_growth_within_the_chunk_is_in_place_and_signalled(engine):
    engine.put(b"k", b"a" * 100)                 # a 128-byte chunk
    before, rewritten = offset_of(engine, b"k"), []
    engine.overwrite_listeners.append(rewritten.append)
    assert engine.splice(b"k", 100, b"b" * 20) == 120
    assert offset_of(engine, b"k") == before
    assert rewritten == [b"k"]
    assert engine.value(engine.lookup(b"k")) == b"a" * 100 + b"b" * 20


def test_growth_past_the_chunk_copies_once_and_keeps_ttl_and_parent(engine):
    engine.put(b"p", b"x" * 10)
    engine.put(b"k", b"a" * 100, parent=b"p")
    engine.expiry.set(b"k", 2**62)
    dropped = []
    engine.drop_listeners.append(lambda slot, key: dropped.append(key))
    assert engine.splice(b"k", 200, b"z") == 201
    slot = engine.lookup(b"k")
    assert engine.value(slot) == b"a" * 100 + bytes(100) + b"z"
    assert dropped == [b"k"]                    # the old value left as in an overwrite
    assert engine.expiry.deadlines[b"k"] == 2**62
    assert engine.eviction.parent_of(slot) == engine.lookup(b"p")


def test_a_held_value_is_never_rewritten_in_place(engine):
    engine.put(b"k", b"a" * 100)
    hold = engine.holds.hold(engine.lookup(b"k"))
    old_view = engine.view(engine.lookup(b"k"))
    engine.splice(b"k", 0, b"B")
    assert bytes(old_view[:1]) == b"a"          # the reader still sends the old bytes
    assert engine.value(engine.lookup(b"k"))[:2] == b"Ba"
    engine.holds.release(hold)


def test_a_gap_inside_the_chunk_reads_as_zeros(engine):
    engine.put(b"k", b"x" * 100)
    engine.put(b"k", b"y" * 70)                 # same chunk: bytes 70..99 still hold x
    engine.splice(b"k", 90, b"z")
    assert engine.value(engine.lookup(b"k")) == b"y" * 70 + bytes(20) + b"z"
