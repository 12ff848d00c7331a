"""What a slot move sends when values live on SSD or GPU (kvstore/cluster/outgoing.py, migration.py).

A source `Migrator` in this process, whose engine has a real RocksDB SSD tier
in tmp_path (values put there as a restart finds them) and, for the GPU, the
host-memory stand-in of tests/test_tier_moves.py (a real device where cupy
finds one); its pushes are recorded instead of sent. What is checked:
- values on SSD or GPU move with the others, in the move's order, byte for
  byte, and leave the source; nothing is counted as dropped;
- the SSD reads run on the tier's reader threads (batched), not on the loop;
- a value whose SSD copy fails verification is dropped and counted as such;
- a value read for a move whose slot stopped moving stays where it was.
The same with real node processes, etcd and a SIGTERM drain is in
tests/test_cluster_migration.py.
"""
from __future__ import annotations

import asyncio
import threading

import pytest

from kvstore.admin.config import Config
from kvstore.cluster.migration import Migrator
from kvstore.cluster.node import ClusterState
from kvstore.cluster.slots import SLOTS, SlotMap
from kvstore.store.engine import Engine
from kvstore.store.entries import GPU, SSD
from kvstore.tiers.manager import TieringConfig, TierManager
from kvstore.tiers.gpu import gpu_available
from kvstore.tiers.ssd import SSDTier
from kvstore.tiers.ssd_worker import SSDWorker
from tests.test_cluster_migration import ADDRS, A, B, ImportLinks, step_to
from tests.test_tier_fetch import SIZE, damage_payload, store_on_ssd, value_of
from tests.test_tier_moves import FakeGPU, until

MIB, GIB = 1 << 20, 1 << 30


def migrator(engine: Engine, tiers: TierManager, heat=None) -> tuple[ClusterState, Migrator, ImportLinks]:
    cluster = ClusterState(A, ADDRS[A])
    cluster.apply(SlotMap.build(1, ADDRS, [A] * SLOTS))
    links = ImportLinks()
    moves = Migrator(engine, cluster, links, lambda: Config(cluster_move_budget=5.0), lambda: heat or {}, tiers)
    moves.attach()
    return cluster, moves, links


@pytest.fixture
def ssd_node(tmp_path):
    """An engine with a real SSD tier (promotion off, so a read never rehomes a value)."""
    tier = SSDTier.open(str(tmp_path / "ssd"), GIB)
    worker = SSDWorker(tier, readers=2)
    engine = Engine(4 * MIB, prefault=False)
    tiers = TierManager(engine, TieringConfig(promote_hits=1_000_000), ssd_worker=worker)
    yield engine, tiers, tier
    tiers.close()
    engine.close()


def sent_values(links: ImportLinks) -> dict[bytes, bytes]:
    return {batch[i]: batch[i + 3] for batch in links.batches for i in range(0, len(batch), 4)}


def test_values_on_ssd_move_with_the_others_read_on_the_tiers_threads(ssd_node):
    engine, tiers, tier = ssd_node
    on_ssd = [b"ssd-%02d" % i for i in range(12)]
    in_dram = [b"dram-%02d" % i for i in range(4)]
    store_on_ssd(engine, tier, on_ssd)
    for key in in_dram:
        engine.put(key, value_of(key))
    reads_on = []
    read_many = tier.get_many_into
    tier.get_many_into = lambda *args: reads_on.append(threading.current_thread().name) or read_many(*args)

    async def scenario():
        cluster, moves, links = migrator(engine, tiers, heat={on_ssd[3]: 5, in_dram[1]: 2})
        step_to(cluster, B)
        await until(lambda: moves.stats.moves == 1)
        return moves, links

    moves, links = asyncio.run(scenario())
    sent = sent_values(links)
    assert sent == {key: value_of(key) for key in on_ssd + in_dram}          # every value, byte for byte
    order = [key for batch in links.batches for key in batch[0::4]]
    assert order[:2] == [on_ssd[3], in_dram[1]]                             # hottest first, whatever the tier
    assert reads_on and threading.main_thread().name not in reads_on        # never on the loop's thread
    assert engine.index == {}
    assert (moves.stats.moved_keys, moves.stats.moved_bytes) == (16, 16 * SIZE)
    assert (moves.stats.dropped_keys, moves.stats.dropped_bytes) == (0, 0)
    assert engine.allocator.used == 0                                       # staged copies let go


def test_a_value_that_fails_verification_is_dropped_and_counted(ssd_node):
    engine, tiers, tier = ssd_node
    keys = [b"a", b"b", b"c"]
    store_on_ssd(engine, tier, keys)
    damage_payload(tier, b"b")                      # a payload its header's checksum does not match

    async def scenario():
        cluster, moves, links = migrator(engine, tiers)
        step_to(cluster, B)
        await until(lambda: moves.stats.moves == 1)
        return moves, links

    moves, links = asyncio.run(scenario())
    assert sent_values(links) == {b"a": value_of(b"a"), b"c": value_of(b"c")}
    assert (moves.stats.moved_keys, moves.stats.dropped_keys, moves.stats.dropped_bytes) == (2, 1, SIZE)


def test_a_value_read_for_a_move_that_stopped_stays(ssd_node):
    engine, tiers, tier = ssd_node
    store_on_ssd(engine, tier, [b"k"])

    async def scenario():
        cluster, moves, links = migrator(engine, tiers)
        started = asyncio.Event()
        fetch = tiers.fetch

        async def slow_fetch(items):
            started.set()
            await asyncio.sleep(0.05)
            return await fetch(items)
        tiers.fetch = slow_fetch
        step_to(cluster, B)
        await asyncio.wait_for(started.wait(), 10)
        cluster.apply(SlotMap.build(3, ADDRS, [A] * SLOTS))                 # the move is called off
        await until(lambda: moves.stats.moves == 1)
        return links

    links = asyncio.run(scenario())
    slot = engine.lookup(b"k")
    assert links.batches == [] and slot is not None and engine.tier_code(slot) == SSD
    assert engine.allocator.used == 0


def test_a_value_demoted_while_its_group_is_read_is_counted_as_dropped(ssd_node):
    engine, tiers, tier = ssd_node
    store_on_ssd(engine, tier, [b"cold"])
    engine.put(b"warm", value_of(b"warm"))              # in DRAM when gathered, with a clean SSD copy
    tier.put_batch([(b"warm", value_of(b"warm"), None, None)])
    engine.moves.mark_on_ssd(engine.lookup(b"warm"))

    async def scenario():
        cluster, moves, links = migrator(engine, tiers)
        fetch = tiers.fetch

        async def demoting_fetch(items):
            engine.moves.demoted_to_ssd(engine.lookup(b"warm"))      # DRAM pressure, meanwhile
            return await fetch(items)
        tiers.fetch = demoting_fetch
        step_to(cluster, B)
        await until(lambda: moves.stats.moves == 1)
        return moves, links

    moves, links = asyncio.run(scenario())
    assert sent_values(links) == {b"cold": value_of(b"cold")}
    assert (moves.stats.moved_keys, moves.stats.dropped_keys, moves.stats.dropped_bytes) == (1, 1, SIZE)
    assert engine.index == {}                           # nothing of a moving slot left behind uncounted


def gpu_node(gpu) -> tuple[Engine, TierManager]:
    engine = Engine(4 * MIB, prefault=False)
    return engine, TierManager(engine, TieringConfig(promote_hits=1), gpu=gpu)


def check_values_on_gpu_move(gpu) -> None:
    """Three values on ``gpu`` and one in DRAM move, byte for byte, and leave nothing behind."""
    engine, tiers = gpu_node(gpu)
    keys = [b"gpu-%d" % i for i in range(3)]
    moves, links = move_values_on_gpu(engine, tiers, keys)
    assert sent_values(links) == {key: value_of(key) for key in keys + [b"in-dram"]}
    assert engine.index == {} and gpu.used_bytes == 0 and moves.stats.dropped_keys == 0
    tiers.close()


def move_values_on_gpu(engine: Engine, tiers: TierManager, keys: list[bytes]) -> tuple[Migrator, ImportLinks]:
    async def scenario():
        for key in keys:
            engine.put(key, value_of(key))
            engine.get_entry(key)                                            # promote-hits 1: up it goes
            await until(lambda: engine.tier_code(engine.lookup(key)) == GPU)
        engine.put(b"in-dram", value_of(b"in-dram"))
        cluster, moves, links = migrator(engine, tiers)
        step_to(cluster, B)
        await until(lambda: moves.stats.moves == 1)
        return moves, links
    return asyncio.run(scenario())


def test_values_on_the_gpu_are_copied_to_host_and_move():
    check_values_on_gpu_move(FakeGPU(1 * MIB))


GPU_USABLE, GPU_REASON = gpu_available()


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_USABLE, reason=f"no usable GPU: {GPU_REASON}")
def test_values_on_a_real_gpu_are_copied_to_host_and_move():
    from kvstore.tiers.gpu import GPUTier
    check_values_on_gpu_move(GPUTier.open(8 * MIB))
