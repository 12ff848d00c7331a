"""LMCache 0.5.6's own remote connectors against a real `kvstore serve`: `redis://` (its
RedisConnector: redis-py asyncio, a pool of 150, a `kv_bytes` and a `metadata` key per chunk) and
`resp://` (its RESPConnector over the compiled `lmcache_redis` client: one key per chunk).

Both are built as LMCache builds them (`LocalCPUBackend` over a `PinMemoryAllocator`,
`CreateConnector(url, loop, local_cpu_backend, config)`, the loop in its own thread), and every
chunk read is checked byte for byte. Under eviction (a node whose DRAM holds a fraction of what is
put) a chunk read is a miss or the bytes put, never other bytes.

LMCache 0.5.6's native RESP client does not return from a GET of a missing key (against Redis 7
too), so `resp://` is read only where a lookup just found the chunk and nothing is being written.
Its synchronous lookups (`exists_sync`, `batched_contains`) are left out too: called from a thread
other than the connector's loop, the completion can be drained before the call registers its
future, and the call then waits forever (one of our first two runs hung there).
"""
from __future__ import annotations

import asyncio
import random

import pytest
import redis

from loadtest.bench_lmcache import Rig
from loadtest.bench_memory import orphans

CHUNKS = 10


@pytest.fixture(scope="module")
def rig():
    rig = Rig(layers=4, tokens=256, hidden=128, cpu_bytes=48 << 20)      # 512 KiB chunks
    yield rig
    rig.close()


@pytest.fixture(scope="module")
def server(kvstore_module_factory):
    """One node for the tests that use distinct keys (a node start costs a second on a busy host)."""
    return kvstore_module_factory()


@pytest.fixture
def small_node(kvstore_factory):
    return kvstore_factory("--dram-size", "16mb")              # ~30 chunks of 512 KiB


def release(*memory_objs) -> None:
    """Give back chunks read (a put takes over its chunk's reference, as LMCache's callers expect)."""
    for memory_obj in memory_objs:
        if memory_obj is not None:
            memory_obj.ref_count_down()


def resp_extra() -> dict:
    return {"save_chunk_meta": False, "resp_num_threads": 2}


def test_redis_connector_round_trips_every_byte(rig, server):
    connector, backend = rig.connector(f"redis://{server.host}:{server.port}")
    keys = [rig.key(i) for i in range(CHUNKS)]
    chunks = [rig.chunk(backend, i) for i in range(CHUNKS)]
    assert rig.run(connector.batched_async_contains("l0", keys)) == 0
    assert not rig.run(connector.exists(keys[0]))

    rig.run(connector.batched_put(keys[:-1], chunks[:-1]))
    rig.run(connector.put(keys[-1], chunks[-1]))
    assert rig.run(connector.exists(keys[0])) and connector.exists_sync(keys[-1])
    assert rig.run(connector.batched_async_contains("l1", keys + [rig.key(999)])) == CHUNKS

    for i, key in enumerate(keys):
        got = rig.run(connector.get(key))
        assert rig.right(i, got), f"chunk {i} came back with other bytes"
        release(got)
    prefix = rig.run(connector.batched_get_non_blocking("l2", keys))
    assert len(prefix) == CHUNKS and all(rig.right(i, m) for i, m in enumerate(prefix))
    release(*prefix)
    assert rig.run(connector.get(rig.key(999))) is None


def test_resp_connector_round_trips_every_byte(rig, server):
    connector, backend = rig.connector(f"resp://{server.host}:{server.port}", resp_extra())
    keys = [rig.key(100 + i) for i in range(CHUNKS)]
    chunks = [rig.chunk(backend, 100 + i) for i in range(CHUNKS)]
    assert rig.run(connector.batched_async_contains("l0", keys)) == 0
    assert not rig.run(connector.exists(keys[0]))

    rig.run(connector.batched_put(keys[:-1], chunks[:-1]))
    rig.run(connector.put(keys[-1], chunks[-1]))
    assert rig.run(connector.exists(keys[-1])) and rig.run(connector.exists(keys[0]))
    assert rig.run(connector.batched_async_contains("l1", keys + [rig.key(999)])) == CHUNKS
    assert rig.run(connector.batched_async_contains("l2", keys[:4] + [rig.key(999)] + keys[4:])) == 4

    for i, key in enumerate(keys):
        got = rig.run(connector.get(key))
        assert rig.right(100 + i, got), f"chunk {100 + i} came back with other bytes"
        release(got)
    got = rig.run(connector.batched_get(keys))
    assert all(rig.right(100 + i, m) for i, m in enumerate(got))
    release(*got)


def test_both_layouts_share_a_node_without_touching_each_other(rig, server):
    """`redis://` keys carry suffixes, `resp://` keys do not: one chunk key stored both ways."""
    redis_conn, redis_backend = rig.connector(f"redis://{server.host}:{server.port}")
    resp_conn, resp_backend = rig.connector(f"resp://{server.host}:{server.port}", resp_extra())
    a, b = rig.chunk(redis_backend, 7), rig.chunk(resp_backend, 8)
    rig.run(redis_conn.put(rig.key(300), a))
    assert not rig.run(resp_conn.exists(rig.key(300)))
    rig.run(resp_conn.put(rig.key(300), b))
    got_redis, got_resp = rig.run(redis_conn.get(rig.key(300))), rig.run(resp_conn.get(rig.key(300)))
    assert rig.right(7, got_redis) and rig.right(8, got_resp)
    release(got_redis, got_resp)


async def _reads_under_writes(rig, connector, backend, stored: int, tally: dict) -> None:
    """Waves of concurrent gets of random stored chunks, each wave beside puts of new chunks (so
    the node evicts while it serves the reads)."""
    rng = random.Random(5)
    new = stored

    async def read(i: int) -> None:
        got = await connector.get(rig.key(i))
        if got is None:
            tally["misses"] += 1
        elif rig.right(i, got):
            tally["hits"] += 1
        else:
            tally["wrong"] += 1
        release(got)

    async def write(i: int) -> None:
        chunk = rig.chunk(backend, i)
        await connector.put(rig.key(i), chunk)

    for _ in range(8):
        await asyncio.gather(*(read(rng.randrange(new)) for _ in range(6)), *(write(new + j) for j in range(3)))
        new += 3


def _store(rig, connector, backend, count: int, batch: int = 8) -> None:
    for start in range(0, count, batch):
        ids = range(start, min(count, start + batch))
        chunks = [rig.chunk(backend, i) for i in ids]
        rig.run(connector.batched_put([rig.key(i) for i in ids], chunks))


def test_redis_connector_under_eviction_reads_a_miss_never_wrong_bytes(rig, small_node):
    connector, backend = rig.connector(f"redis://{small_node.host}:{small_node.port}")
    _store(rig, connector, backend, 80)                 # 40 MiB into 16 MiB of DRAM
    tally = {"hits": 0, "misses": 0, "wrong": 0}
    rig.run(_reads_under_writes(rig, connector, backend, 80, tally))
    assert tally["wrong"] == 0, tally
    assert tally["hits"] > 0 and tally["misses"] > 0, f"no eviction or no hit: the test proves nothing {tally}"
    assert rig.run(connector.batched_async_contains("l", [rig.key(0), rig.key(1)])) < 2


def test_eviction_takes_a_chunks_two_keys_together(rig, small_node):
    """evict-companions (kvstore/store/companions.py): under eviction no `metadata` key is left
    without its `kv_bytes` (a lookup finding a chunk that is not there) nor the other way round;
    with it off, size-aware eviction leaves `metadata` keys behind."""
    connector, backend = rig.connector(f"redis://{small_node.host}:{small_node.port}")
    client = redis.Redis(small_node.host, small_node.port)
    _store(rig, connector, backend, 80)                 # 40 MiB into 16 MiB of DRAM
    whole, lone_metadata, lone_kv = orphans(client)
    assert 0 < whole < 80 and (lone_metadata, lone_kv) == (0, 0)
    assert client.info("memory")["evicted_keys_companion"] >= 80 - whole
    client.config_set("evict-companions", "")
    _store(rig, connector, backend, 160)
    assert orphans(client)[1] > 0, "without companions, metadata keys outlive their chunks"


def test_a_delete_takes_no_companion(server):
    client = redis.Redis(server.host, server.port)
    client.set(b"chunkkv_bytes", b"v" * 1000)
    client.set(b"chunkmetadata", b"m")
    assert client.delete(b"chunkkv_bytes") == 1 and client.get(b"chunkmetadata") == b"m"


def test_resp_connector_under_eviction_reads_a_miss_never_wrong_bytes(rig, small_node):
    connector, backend = rig.connector(f"resp://{small_node.host}:{small_node.port}", resp_extra())
    _store(rig, connector, backend, 80)
    tally = {"hits": 0, "misses": 0, "wrong": 0}
    for i in random.Random(3).sample(range(80), 40):
        if not rig.run(connector.exists(rig.key(i))):
            tally["misses"] += 1
            continue
        got = rig.run(connector.get(rig.key(i)))
        tally["hits" if rig.right(i, got) else "wrong"] += 1
        release(got)
    assert tally["wrong"] == 0, tally
    assert tally["hits"] > 0 and tally["misses"] > 0, f"no eviction or no hit: the test proves nothing {tally}"
    assert rig.run(connector.batched_async_contains("l", [rig.key(i) for i in range(80)])) < 80


def test_redis_plugin_form_through_lmcache_remote_backend(rig, server):
    """`remote_storage_plugins: ["redis"]` + `remote_storage_plugin.redis.redis_url`, as
    docs/engines.md gives it: LMCache's RemoteBackend on its own RedisConnector."""
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    config = rig.config(extra={"remote_storage_plugin.redis.redis_url": f"redis://{server.host}:{server.port}"},
                        plugins=["redis"])
    local = rig.backend(config)
    backend = RemoteBackend(config, rig.metadata, rig.loop, local, "cpu", plugin_name="redis")
    assert type(backend.connection.getWrappedConnector()).__name__ == "RedisConnector"
    backend.submit_put_task(rig.key(700), rig.chunk(local, 700)).result(10)
    assert backend.contains(rig.key(700))
    got = backend.get_blocking(rig.key(700))
    assert rig.right(700, got)
    release(got)
