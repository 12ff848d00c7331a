"""Reads of values from the SSD tier into DRAM (TierManager.fetch and install, kvstore/tiers/manager.py).

What is checked, on a real RocksDB in tmp_path and an engine in this process:
- the SSD values of one fetch (a whole prefix, or the keys of pipelined
  commands) are read by one call per reader thread, whose headers come from
  one batched multi_get, not one task and one thread hand-off per key;
- every value comes back byte for byte, and a value that fails verification
  is dropped while the others of the same fetch are still served;
- values read for a socket reply are RocksDB's own bytes, staged outside the
  arena (no extent, no copy), up to a bound per fetch; a read that makes a
  value hot still gives it a home in the arena.
"""
from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from kvstore.store.engine import Engine
from kvstore.store.entries import DRAM
from kvstore.tiers import manager as tiering
from kvstore.tiers.manager import TieringConfig, TierManager
from kvstore.tiers.ssd import SSDTier
from kvstore.tiers.ssd_worker import SSDWorker

KIB, MIB = 1 << 10, 1 << 20
SIZE = 64 * KIB
GIB = 1 << 30


def value_of(key: bytes) -> bytes:
    return np.random.default_rng(sum(key)).bytes(SIZE)


@pytest.fixture
def node(tmp_path):
    """An engine whose index knows values that are only on SSD, as after a restart."""
    tier = SSDTier.open(str(tmp_path / "ssd"), GIB)
    worker = SSDWorker(tier)
    engine = Engine(4 * MIB, prefault=False)
    tiers = TierManager(engine, TieringConfig(promote_hits=1_000_000), ssd_worker=worker)
    yield engine, tiers, tier
    worker.close()
    tiers.close()
    engine.close()


def store_on_ssd(engine: Engine, tier: SSDTier, keys: list[bytes]) -> None:
    tier.put_batch([(key, value_of(key), None, None) for key in keys])
    for key in keys:
        engine.add_from_ssd(key, SIZE, None)


def test_a_prefix_on_ssd_is_read_by_one_call_per_reader_thread(node):
    engine, tiers, tier = node
    keys = [b"block-%d" % i for i in range(8)]
    store_on_ssd(engine, tier, keys)
    calls = []
    submit = tiers.worker.submit
    tiers.worker.submit = lambda fn, *args: calls.append(fn.__name__) or submit(fn, *args)

    async def read_all():
        return tiers.install(await tiers.fetch(tiers.pending_fetch(keys)))

    staged = asyncio.run(read_all())
    assert calls == ["get_many_into"] * tiers.worker.readers
    assert [engine.value(engine.lookup(key)) for key in keys] == [value_of(key) for key in keys]
    tiers.unstage(staged)
    assert all(engine.tier_code(engine.lookup(key)) != DRAM for key in keys)


def damage_payload(tier, key: bytes) -> None:
    """Zero a value's payload where it lies in its segment file: its checksum no longer matches."""
    loc = tier._store.locate(key)[0]
    os.pwrite(tier._store._fds[loc.segment], bytes(loc.length), loc.offset)


@pytest.mark.parametrize("into_arena", [True, False], ids=["arena", "socket"])
def test_a_value_that_fails_verification_is_dropped_and_the_rest_are_served(node, into_arena):
    engine, tiers, tier = node
    keys = [b"a", b"b", b"c"]
    store_on_ssd(engine, tier, keys)
    damage_payload(tier, b"b")

    async def read_all():
        return tiers.install(await tiers.fetch(tiers.pending_fetch(keys), into_arena=into_arena))

    staged = asyncio.run(read_all())
    assert engine.lookup(b"b") is None
    assert [engine.value(engine.lookup(key)) for key in (b"a", b"c")] == [value_of(b"a"), value_of(b"c")]
    tiers.unstage(staged)


def fetch_and_install(tiers: TierManager, keys: list[bytes], into_arena: bool) -> list[int]:
    async def read_all():
        return tiers.install(await tiers.fetch(tiers.pending_fetch(keys), into_arena=into_arena))
    return asyncio.run(read_all())


def count_reads(tiers: TierManager) -> list[str]:
    calls = []
    submit = tiers.worker.submit
    tiers.worker.submit = lambda fn, *args: calls.append(fn.__name__) or submit(fn, *args)
    return calls


def test_values_for_a_socket_reply_are_rocksdbs_own_bytes_and_take_no_extent(node):
    engine, tiers, tier = node
    keys = [b"block-%d" % i for i in range(8)]
    store_on_ssd(engine, tier, keys)
    calls = count_reads(tiers)
    used = engine.allocator.used
    staged = fetch_and_install(tiers, keys, into_arena=False)
    assert calls == ["get_many"] * tiers.worker.readers
    assert engine.allocator.used == used
    assert all(engine.lookup(key) in engine.entries.heap_copies for key in keys)     # outside the arena
    assert [engine.value(engine.lookup(key)) for key in keys] == [value_of(key) for key in keys]
    tiers.unstage(staged)
    assert all(engine.tier_code(engine.lookup(key)) != DRAM for key in keys)


def test_socket_staging_is_bounded_on_the_node_and_the_rest_go_to_the_arena(node, monkeypatch):
    engine, tiers, tier = node
    monkeypatch.setattr(tiering, "WIRE_STAGING_BYTES", 3 * SIZE)
    keys = [b"block-%d" % i for i in range(8)]
    later = [b"later-%d" % i for i in range(2)]
    store_on_ssd(engine, tier, keys + later)
    calls = count_reads(tiers)
    staged = fetch_and_install(tiers, keys, into_arena=False)
    on_heap = [key for key in keys if engine.lookup(key) in engine.entries.heap_copies]
    assert on_heap == keys[:3] and engine.moves.heap_bytes == 3 * SIZE
    assert sorted(set(calls)) == ["get_many", "get_many_into"]
    assert [engine.value(engine.lookup(key)) for key in keys] == [value_of(key) for key in keys]
    staged_later = fetch_and_install(tiers, later, into_arena=False)     # while the first three stay staged
    assert not any(engine.lookup(key) in engine.entries.heap_copies for key in later)
    tiers.unstage(staged + staged_later)
    assert engine.moves.heap_bytes == 0
    assert fetch_and_install(tiers, later, into_arena=False) and engine.moves.heap_bytes == 2 * SIZE


def test_a_socket_read_that_makes_a_value_hot_gives_it_a_home_in_the_arena(node):
    engine, tiers, tier = node
    tiers.cfg.promote_hits = 2
    store_on_ssd(engine, tier, [b"hot"])
    tiers.unstage(fetch_and_install(tiers, [b"hot"], into_arena=False))
    assert engine.tier_code(engine.lookup(b"hot")) != DRAM
    assert fetch_and_install(tiers, [b"hot"], into_arena=False) == []
    slot = engine.lookup(b"hot")
    assert engine.tier_code(slot) == DRAM and engine.value(slot) == value_of(b"hot")
    assert tiers.stats[tiering.SSD].promotions == 1


def test_a_socket_read_of_cached_values_is_made_on_the_loop_into_extents(node):
    """fetch_now: the tier remembers the records it wrote and the page cache holds the bytes,
    so the values are read without a reader thread, into DRAM extents, byte for byte."""
    engine, tiers, tier = node
    keys = [b"block-%d" % i for i in range(4)]
    store_on_ssd(engine, tier, keys)
    calls = count_reads(tiers)
    used = engine.allocator.used
    fetched = tiers.fetch_now(tiers.pending_fetch(keys), into_arena=False)
    assert fetched is not None and calls == []
    staged = tiers.install(fetched)
    assert engine.allocator.used == used + 4 * SIZE and not engine.entries.heap_copies
    assert [engine.value(engine.lookup(key)) for key in keys] == [value_of(key) for key in keys]
    tiers.unstage(staged)
    assert engine.allocator.used == used and all(engine.tier_code(engine.lookup(key)) != DRAM for key in keys)


def test_fetch_now_leaves_to_the_reader_threads_what_it_cannot_read_at_once(node):
    engine, tiers, tier = node
    store_on_ssd(engine, tier, [b"known", b"forgotten"])
    tier._recent.pop(b"forgotten")                      # a record not remembered (as after a restart)
    used = engine.allocator.used
    assert tiers.fetch_now(tiers.pending_fetch([b"known", b"forgotten"]), into_arena=False) is None
    assert engine.allocator.used == used                # the extent reserved for the first went back
    assert tiers.fetch_now(tiers.pending_fetch([b"known"]), into_arena=True) is None      # a lease: the arena's
    tiers.cfg.promote_hits = 1                          # a read that would make it hot: promotion's path
    assert tiers.fetch_now(tiers.pending_fetch([b"known"]), into_arena=False) is None
