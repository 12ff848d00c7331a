"""LMCache's remote-store traffic, replayed with redis-py asyncio and a 150-connection pool against a real
`kvstore serve` small enough to evict: per chunk SET key+"kv_bytes" then SET key+"metadata"; lookups
EXISTS key+"metadata"; reads GET metadata then GET kv_bytes, and DEL metadata when the bytes are gone.
Under eviction no read may return bytes of the wrong length or content."""
from __future__ import annotations

import asyncio
import random
import struct

import pytest
import redis.asyncio as aioredis
import xxhash

from conftest import start_kvstore

POOL = 150
CHUNKS = 360
META = struct.Struct("<QQ")          # length, xxh64 of the bytes: LMCache's packed header, in spirit


def chunk_key(i: int) -> str:
    return f"vllm@smollm2-135m@1@0@{xxhash.xxh64_hexdigest(str(i).encode())}"


def chunk_bytes(i: int) -> bytes:
    size = 48 * 1024 + (i % 7) * 16 * 1024       # lengths differ, so a mixed-up value shows
    return random.Random(i).randbytes(size)


@pytest.fixture
def small_store(tmp_path):
    daemon = start_kvstore(tmp_path, "--dram-size", "16mb")
    yield daemon
    daemon.stop()


async def store_chunk(r, i: int) -> None:
    data = chunk_bytes(i)
    await r.set(chunk_key(i) + "kv_bytes", data)
    await r.set(chunk_key(i) + "metadata", META.pack(len(data), xxhash.xxh64_intdigest(data)))


async def lookup_and_read(r, i: int, tally: dict) -> None:
    key = chunk_key(i)
    if not await r.exists(key + "metadata"):
        tally["lookup_misses"] += 1
        return
    meta = await r.get(key + "metadata")
    if meta is None:
        tally["lookup_misses"] += 1
        return
    data = await r.get(key + "kv_bytes")
    if data is None:
        await r.delete(key + "metadata")
        tally["bytes_gone"] += 1
        return
    length, digest = META.unpack(meta)
    if len(data) != length or xxhash.xxh64_intdigest(data) != digest or data != chunk_bytes(i):
        tally["wrong"] += 1
    else:
        tally["hits"] += 1


async def replay(port: int) -> tuple[dict, dict]:
    pool = aioredis.ConnectionPool(host="127.0.0.1", port=port, max_connections=POOL)
    r = aioredis.Redis(connection_pool=pool)
    tally = {"hits": 0, "lookup_misses": 0, "bytes_gone": 0, "wrong": 0}
    limit = asyncio.Semaphore(POOL)

    async def bounded(coro):
        async with limit:
            await coro

    order = list(range(CHUNKS))
    random.Random(7).shuffle(order)
    await asyncio.gather(*(bounded(store_chunk(r, i)) for i in order))
    reads = [random.Random(i).randrange(CHUNKS) for i in range(2 * CHUNKS)]
    writes = list(range(CHUNKS, CHUNKS + CHUNKS // 2))     # new chunks keep eviction going during reads
    await asyncio.gather(*(bounded(lookup_and_read(r, i, tally)) for i in reads),
                         *(bounded(store_chunk(r, i)) for i in writes))
    info = await r.info("stats")
    connected = (await r.info("clients"))["connected_clients"]
    await r.aclose()
    await pool.aclose()
    return tally, {"evicted": info.get("evicted_keys", 0), "clients": connected}


def test_lmcache_traffic_under_eviction_never_reads_wrong_bytes(small_store):
    tally, server = asyncio.run(replay(small_store.port))
    assert tally["wrong"] == 0
    assert tally["hits"] > 0
    assert tally["lookup_misses"] + tally["bytes_gone"] > 0, "the store never evicted: the test proves nothing"
    assert server["clients"] > 1
