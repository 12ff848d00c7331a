"""Values on SSD alone read by a local client from the node's RocksDB files (client/ssd_reads.py),
against real `kvstore serve` nodes with an SSD tier.

What is checked: a demoted value and a value loaded at a restart are read here with no
round trip, byte-exact, singly and as a batch; a value overwritten, deleted, or demoted
again after the client's follower last looked is never read from an old record (the
new value, or a miss), nor a torn or older version while readers race overwrites and
demotions; a client follows a restarted node's tier anew; a compressed record is read
through the node; an asyncio client reads SSD off its loop; a directory the client cannot open leaves every read to the node.
"""
from __future__ import annotations

import asyncio
import signal
import threading

import numpy as np
import pytest
import redis
from conftest import wait_until
from test_tiering import digest, on_ssd, restart, spill, start_tiered, tiers, value_of, write_values

from client import AsyncKVClient, KVClient
from client import ssd_reads
from client.ssd_reads import SSDReads
from loadtest.ssd_follow_soak import VALUE_BYTES, versioned
from proto import fastpath as fp

SIZE = VALUE_BYTES                 # loadtest.ssd_follow_soak.versioned makes values of this size
NO_PROMOTION = ("--promote-hits", "1000000")     # reads reported to the node leave values on SSD


@pytest.fixture
def node(kvstore_factory):
    """A node with an SSD tier under a small arena (values spill to SSD), and a redis-py client."""
    daemon = start_tiered(kvstore_factory, *NO_PROMOTION)
    return daemon, redis.Redis(daemon.host, daemon.port, socket_timeout=10)


def fast_client(daemon) -> KVClient:
    return KVClient(unix_socket=daemon.unix_socket, fast_path="required", timeout=30)


def read_all(kv: KVClient, keys: list[bytes]) -> dict[bytes, str | None]:
    buffer = bytearray(SIZE)
    return {key: None if kv.get_into(key, buffer) is None else digest(bytes(buffer)) for key in keys}


def read_batch(kv: KVClient, keys: list[bytes]) -> list[str]:
    """Digests of the values of ``keys``, read with one batch_get_into."""
    buffers = [bytearray(SIZE) for _ in keys]
    assert kv.batch_get_into(keys, buffers) == [SIZE] * len(keys)
    return [digest(bytes(buffer)) for buffer in buffers]


def test_demoted_values_are_read_here_byte_exact(node):
    daemon, r = node
    written = spill(r, 48)
    cold = on_ssd(r, list(written))
    with fast_client(daemon) as kv:
        assert read_all(kv, cold) == {key: written[key] for key in cold}
        assert kv.fast_path.stats.ssd_reads == len(cold) > 0
        assert read_batch(kv, cold) == [written[key] for key in cold]
        assert kv.fast_path.stats.ssd_reads == 2 * len(cold)
        assert kv.get(cold[0]) == value_of(int(cold[0][1:]))



def test_a_value_changed_after_its_demotion_is_never_read_from_an_old_record(node):
    daemon, r = node
    written = spill(r, 48)
    changed, deleted = on_ssd(r, list(written))[:2]
    with fast_client(daemon) as kv:
        assert read_all(kv, [changed, deleted]) == {changed: written[changed], deleted: written[deleted]}
        r.set(changed, value_of(1000))
        r.delete(deleted)
        assert read_all(kv, [changed, deleted]) == {changed: digest(value_of(1000)), deleted: None}
        before = kv.fast_path.stats.ssd_reads
        for batch in range(200):                    # newer values push the new one to SSD in turn
            if tiers(r, [changed]) == ["ssd"]:
                break
            write_values(r, range(2000 + 8 * batch, 2008 + 8 * batch))
        assert tiers(r, [changed]) == ["ssd"]

        def read_here() -> bool:
            """Every read right (through the node while the follower may not catch up yet)."""
            assert read_all(kv, [changed]) == {changed: digest(value_of(1000))}
            return kv.fast_path.stats.ssd_reads > before
        wait_until(read_here, what="the new record read here, after a catch-up")



def written_through(kvstore_factory, count: int):
    """A node that wrote ``count`` values through to SSD, restarted (every value on SSD alone):
    the node, and key -> digest."""
    daemon = start_tiered(kvstore_factory, "--ssd-write-policy", "write-through", *NO_PROMOTION, dram="64mb")
    r = redis.Redis(daemon.host, daemon.port, socket_timeout=10)
    written = write_values(r, range(count))
    wait_until(lambda: r.info("ssd")["ssd_records"] == count, what="every value written through")
    return restart(kvstore_factory, daemon), written


def test_after_a_restart_a_whole_prefix_is_read_here(kvstore_factory):
    daemon, written = written_through(kvstore_factory, 24)
    keys = list(written)
    with fast_client(daemon) as kv:
        assert read_batch(kv, keys) == list(written.values())
        assert kv.fast_path.stats.ssd_reads == len(keys)


def test_compressed_records_are_read_through_the_node(node):
    daemon, r = node
    for n in range(48):
        r.set(b"z%02d" % n, bytes([n]) * SIZE)       # lz4 takes these down to almost nothing
    keys = [b"z%02d" % n for n in range(48)]
    for _ in range(200):
        if on_ssd(r, keys):
            break
        r.set(b"filler", value_of(1))
    cold = on_ssd(r, keys)
    assert cold
    with fast_client(daemon) as kv:
        buffer = bytearray(SIZE)
        for key in cold:
            assert kv.get_into(key, buffer) == SIZE and buffer == bytes([int(key[1:])]) * SIZE
        assert kv.fast_path.stats.ssd_reads == 0



def test_a_directory_that_cannot_be_opened_leaves_reads_to_the_node(tmp_path):
    reads = SSDReads(str(tmp_path / "not-a-rocksdb"))
    assert reads.read(b"k", 3, fp.ssd_tag(b"abc")) is None
    assert reads.read(b"k", 3, fp.ssd_tag(b"abc")) is None       # tried once, not again
    reads.close()


def test_readers_racing_overwrites_and_demotions_see_whole_current_versions(node):
    """Readers on four threads, while another client overwrites the keys (each new version
    lands in DRAM, then newer writes push it to SSD): every read is one whole version of its
    key, and no thread sees a key's version go back."""
    daemon, r = node
    keys = [b"r%02d" % n for n in range(16)]
    for n, key in enumerate(keys):
        r.set(key, versioned(n, 0))
    write_values(r, range(40))                       # the keys go to SSD
    stop, failures, served = threading.Event(), [], [0]

    def reader(kv: KVClient, seed: int) -> None:
        rng, seen, buffer = np.random.default_rng(seed), {}, bytearray(SIZE)
        while not stop.is_set():
            n = int(rng.integers(len(keys)))
            if kv.get_into(keys[n], buffer) != SIZE:
                failures.append((keys[n], "missing"))
                continue
            version = int.from_bytes(buffer[:8], "little")
            if buffer != versioned(n, version) or version < seen.get(n, 0):
                failures.append((keys[n], version, seen.get(n)))
            seen[n] = version

    with fast_client(daemon) as kv:
        threads = [threading.Thread(target=reader, args=(kv, seed)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for version in range(1, 6):
            for n, key in enumerate(keys):
                r.set(key, versioned(n, version))
            write_values(r, range(100 * version, 100 * version + 40))
        stop.set()
        for thread in threads:
            thread.join()
        served[0] = kv.fast_path.stats.ssd_reads
    assert not failures, failures[:5]
    assert served[0] > 0



def test_a_node_killed_and_restarted_is_followed_anew(kvstore_factory):
    daemon, written = written_through(kvstore_factory, 8)
    keys = list(written)
    with fast_client(daemon) as kv:
        assert read_all(kv, keys) == written
        r = redis.Redis(daemon.host, daemon.port, socket_timeout=10)
        r.set(keys[0], value_of(500))
        wait_until(lambda: r.info("ssd")["ssd_records"] == 8, what="the overwrite written through")
        daemon = restart(kvstore_factory, daemon, signal.SIGKILL)
        assert read_all(kv, keys) == {**written, keys[0]: digest(value_of(500))}
        assert kv.fast_path.stats.remaps >= 1 and kv.fast_path.stats.ssd_reads >= 2 * len(keys) - 1


def test_an_asyncio_client_reads_ssd_off_its_loop(node, monkeypatch):
    """A read from SSD may wait on the disk: the asyncio client makes it on a worker thread,
    whatever the value's size."""
    daemon, r = node
    written = spill(r, 48)
    cold = on_ssd(r, list(written))[:3]
    threads, read = [], SSDReads.read

    def spy(self, *args):
        threads.append(threading.current_thread())
        return read(self, *args)
    monkeypatch.setattr(SSDReads, "read", spy)

    async def scenario() -> int:
        async with AsyncKVClient(unix_socket=daemon.unix_socket, fast_path="required") as kv:
            buffer = bytearray(SIZE)
            for key in cold:
                assert await kv.get_into(key, buffer) == SIZE and digest(bytes(buffer)) == written[key]
            return kv.fast_path.stats.ssd_reads
    assert asyncio.run(scenario()) == len(cold)
    assert len(threads) == len(cold) and threading.main_thread() not in threads


def test_catching_up_is_paced_by_how_long_it_takes(monkeypatch):
    """A follower catches up at most every CATCH_UP_S, and a catch-up that took t waits 10 t."""
    clock = [100.0]

    class SlowPrimary:
        def try_catch_up_with_primary(self) -> None:
            clock[0] += 0.02                             # 20 ms of WAL to replay

    monkeypatch.setattr(ssd_reads.time, "monotonic", lambda: clock[0])
    reads = ssd_reads.SSDReads("unused")
    reads._db = SlowPrimary()
    assert reads._catch_up()
    clock[0] += 0.1
    assert not reads._catch_up()                         # 0.2 s after the last one began
    clock[0] += 0.1
    assert reads._catch_up()
    SlowPrimary.try_catch_up_with_primary = lambda self: None
    clock[0] += 0.3
    assert reads._catch_up()
    clock[0] += 0.03
    assert not reads._catch_up()                         # a quick one: CATCH_UP_S later
    clock[0] += ssd_reads.CATCH_UP_S
    assert reads._catch_up()
