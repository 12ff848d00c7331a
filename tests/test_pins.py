"""Unit tests of the soft pins (kvstore.store.pins), through an engine with a small arena.

What is checked: a pinned value is evicted after every unpinned one; unpin
takes the pin off once (and answers whether there was one); a pin lapses at
its deadline or when its value leaves the index, and a new value of the key
starts unpinned; pinning an absent or expired key fails.
"""
from __future__ import annotations

import pytest

from kvstore.store.deadlines import now_ms
from kvstore.store.engine import Engine

KiB = 1 << 10
VALUE = bytes(64 * KiB)


@pytest.fixture
def engine():
    engine = Engine(4 * len(VALUE), prefault=False)
    yield engine
    engine.close()


def pinned(engine: Engine, key: bytes) -> bool:
    return engine.lookup(key) in engine.pins._pins


def test_a_pinned_value_is_evicted_last(engine):
    for key in (b"a", b"b", b"c", b"d"):
        engine.put(key, VALUE)
    assert engine.pins.pin(b"a", 60_000)          # the oldest, else the first to go
    engine.put(b"e", VALUE)
    assert engine.lookup(b"a") is not None and engine.lookup(b"b") is None


def test_unpin_takes_the_pin_off_once(engine):
    engine.put(b"k", VALUE)
    assert engine.pins.pin(b"k", 60_000)
    assert engine.pins.unpin(b"k") and not engine.pins.unpin(b"k")
    assert not pinned(engine, b"k")


def test_a_pin_lapses_at_its_deadline(engine):
    engine.put(b"short", VALUE)
    engine.put(b"long", VALUE)
    engine.pins.pin(b"short", -1)
    engine.pins.pin(b"long", 60_000)
    engine.pins.expire()
    assert not pinned(engine, b"short") and pinned(engine, b"long")


def test_a_new_value_starts_unpinned(engine):
    engine.put(b"k", VALUE)
    engine.pins.pin(b"k", 60_000)
    engine.put(b"k", bytes(3 * KiB))              # another size: a new entry
    engine.pins.expire()
    assert not pinned(engine, b"k") and not engine.pins._pins


def test_an_absent_or_expired_key_is_not_pinned(engine):
    assert not engine.pins.pin(b"absent", 60_000)
    engine.put(b"gone", VALUE)
    engine.expiry.set(b"gone", now_ms() - 1)
    assert not engine.pins.pin(b"gone", 60_000) and engine.lookup(b"gone") is None
