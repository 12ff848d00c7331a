"""Tests of the keys with a TTL (kvstore.store.deadlines) and the active expiry cycle that samples them.

What is checked:
- the dense key list stays in step with the dict through every change the
  engine makes (set, overwrite, pop, del, clear), against a plain dict
  driven by the same random operations;
- a sample is distinct keys of the dict, at most as many as asked;
- changes that would bypass the list are refused;
- an expiry cycle's cost does not grow with the number of keys holding a
  TTL: the bytes it allocates (tracemalloc, a count, not a time) are the
  same with 2,000 keys and with 50,000; listing the keys, as a cycle used to,
  allocates 8 bytes a key.
"""
from __future__ import annotations

import random
import tracemalloc

import pytest

from kvstore.store.deadlines import Deadlines, now_ms
from kvstore.store.engine import Engine

MiB = 1 << 20


def test_the_key_list_follows_the_dict_through_random_changes():
    rng = random.Random(7)
    deadlines, reference = Deadlines(), {}
    for step in range(20_000):
        key = b"k%d" % rng.randrange(300)
        action = rng.random()
        if action < 0.5:
            deadlines[key] = reference[key] = step
        elif action < 0.8:
            assert deadlines.pop(key, None) == reference.pop(key, None)
        elif action < 0.99 and key in reference:
            del deadlines[key], reference[key]
        elif action >= 0.999:
            deadlines.clear()
            reference.clear()
    assert dict(deadlines) == reference
    assert sorted(deadlines._keys) == sorted(reference)
    assert all(deadlines._keys[pos] == key for key, pos in deadlines._pos.items())


def test_a_sample_is_distinct_keys_of_the_dict():
    deadlines = Deadlines()
    for i in range(100):
        deadlines[b"k%d" % i] = i
    for i in range(0, 100, 3):
        deadlines.pop(b"k%d" % i)
    sample = deadlines.sample(20)
    assert len(sample) == len(set(sample)) == 20 and set(sample) <= set(deadlines)
    assert sorted(deadlines.sample(1000)) == sorted(deadlines)
    assert Deadlines().sample(20) == []


def test_changes_that_would_bypass_the_key_list_are_refused():
    deadlines = Deadlines()
    with pytest.raises(TypeError):
        deadlines.update({b"k": 1})
    with pytest.raises(TypeError):
        deadlines.setdefault(b"k", 1)
    assert b"k" not in deadlines


def cycle_allocation(keys: int) -> int:
    """Peak bytes one expiry cycle allocates with ``keys`` keys holding a TTL (none due)."""
    engine = Engine(8 * MiB, prefault=False)
    try:
        deadline = now_ms() + 3_600_000
        for i in range(keys):
            key = b"%032x" % i
            engine.put(key, b"v")
            engine.expiry.set(key, deadline)
        engine.expiry.cycle()       # first-call allocations (caches) out of the way
        tracemalloc.start()
        try:
            assert engine.expiry.cycle() == 0
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    finally:
        engine.close()


def test_an_expiry_cycle_does_not_grow_with_the_keys_holding_a_ttl():
    few, many = cycle_allocation(2_000), cycle_allocation(50_000)
    assert many <= few + 512, f"a cycle allocated {few} bytes over 2,000 keys with a TTL, {many} over 50,000"
    assert many < 16 * 1024
