"""Reads of values from the SSD tier into DRAM (TierManager.fetch and install, kvstore/tiering.py).

What is checked, on a real RocksDB in tmp_path and an engine in this process:
- the SSD values of one fetch (a whole prefix, or the keys of pipelined
  commands) are read by one call per reader thread, whose headers come from
  one batched multi_get, not one task and one thread hand-off per key;
- every value comes back byte for byte, and a value that fails verification
  is dropped while the others of the same fetch are still served.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvstore.engine import Engine
from kvstore.slots import DRAM
from kvstore.tiering import TieringConfig, TierManager
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
    tier.put_batch([(key, value_of(key), None) for key in keys])
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


def test_a_value_that_fails_verification_is_dropped_and_the_rest_are_served(node):
    engine, tiers, tier = node
    keys = [b"a", b"b", b"c"]
    store_on_ssd(engine, tier, keys)
    tier._values[b"b"] = bytes(SIZE)               # a payload its header's checksum does not match

    async def read_all():
        return tiers.install(await tiers.fetch(tiers.pending_fetch(keys)))

    staged = asyncio.run(read_all())
    assert engine.lookup(b"b") is None
    assert [engine.value(engine.lookup(key)) for key in (b"a", b"c")] == [value_of(b"a"), value_of(b"c")]
    tiers.unstage(staged)
