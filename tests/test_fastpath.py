"""The local fast path against a real `kvstore serve` process (and a real redis-server
for the fallback): gets and puts through the arena, modes, restarts, bad input."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from client import AsyncKVClient, BufferTooSmall, KVClient, ResponseError
from client.errors import FastPathUnavailable
from proto import fastpath as fp

MIB = 1 << 20


def pattern(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def leases(kv: KVClient) -> dict[str, int]:
    reply = kv.execute(fp.KV_LEASES)
    return {bytes(k).decode(): v for k, v in zip(reply[::2], reply[1::2])}


@pytest.mark.parametrize("via", ["unix", "tcp"])
def test_put_and_get_move_through_the_arena(server, via):
    where = {"unix_socket": server.unix_socket} if via == "unix" else {}
    with KVClient(server.host, server.port, fast_path="required", **where) as kv:
        value = pattern(1, 3 * MIB + 5)
        assert kv.put("k", value) is True
        assert kv.put("k", value) is False               # put-once through PUBLISH NX
        into = np.zeros(4 * MIB, np.uint8)
        assert kv.get_into("k", into) == value.nbytes
        assert np.array_equal(into[:value.nbytes], value)
        assert kv.get("k") == value.tobytes()
        assert kv.get("absent") is None
        assert kv.batch_get_into(["k", "absent"], [into, bytearray(1)]) == [value.nbytes, None]
        stats = kv.fast_path.stats
        assert stats.reads == 4 and stats.writes == 2 and stats.wire_calls == 0
        assert leases(kv)["reservations_published"] == 2
    with KVClient(server.host, server.port, fast_path="off") as wire:
        assert wire.get("k") == value.tobytes()          # what the fast path stored is the value


def test_batch_put_and_small_puts(server):
    with KVClient(unix_socket=server.unix_socket) as kv:
        values = {f"b{i}": pattern(i, MIB // 2) for i in range(6)}
        assert kv.batch_put(values, parents=[None, *list(values)[:-1]]) == [True] * 6
        assert kv.put("small", b"tiny") is True            # under FAST_PUT_MIN: the wire
        assert kv.fast_path.stats.wire_calls == 1 and kv.fast_path.stats.writes == 1
        assert kv.match_prefix(list(values)) == 6
        got = kv.batch_get(list(values) + ["small"])
        assert [bytes(g) for g in got[:-1]] == [v.tobytes() for v in values.values()]
        assert got[-1] == b"tiny"


def test_buffer_too_small_leaves_the_client_usable(server):
    with KVClient(unix_socket=server.unix_socket, fast_path="required") as kv:
        kv.put("k", pattern(2, MIB))
        with pytest.raises(BufferTooSmall) as raised:
            kv.get_into("k", bytearray(10))
        assert raised.value.size == MIB and raised.value.capacity == 10
        with pytest.raises(TypeError):
            kv.get_into("k", b"read-only")
        assert kv.get_into("k", bytearray(MIB)) == MIB


def test_modes_and_a_node_without_a_fast_path(server, redis_server):
    with pytest.raises(ValueError):
        KVClient(port=server.port, fast_path="sometimes")
    with KVClient(port=server.port, fast_path="off") as kv:
        kv.put("k", pattern(3, MIB))
        assert kv.get("k") is not None
        assert kv.fast_path.stats.reads == 0
    with KVClient(port=redis_server.port) as kv:          # auto: redis has no KV.ARENA
        assert kv.execute("SET", "k", b"v") == "OK"
        assert kv.get("k") == b"v"
        assert "no fast path" in kv.fast_path.unavailable
    with KVClient(port=redis_server.port, fast_path="required") as kv:
        with pytest.raises(FastPathUnavailable):
            kv.get("k")


def test_a_node_restart_is_noticed_and_the_arena_mapped_again(kvstore_factory):
    daemon = kvstore_factory()
    with KVClient(port=daemon.port, fast_path="required") as kv:
        kv.put("k", pattern(4, MIB))
        old_mapping = kv.fast_path.arena()
        kvstore_factory.restart(daemon)
        assert kv.get("k") is None                   # not the dead node's bytes
        kv.put("k", pattern(5, MIB))
        assert kv.get("k") == pattern(5, MIB).tobytes()
        assert kv.fast_path.arena() is not old_mapping


def test_bad_fast_path_input_gets_clear_errors(server):
    with KVClient(unix_socket=server.unix_socket, fast_path="required") as kv:
        kv.put("k", pattern(5, MIB))
        token = kv.fast_path.arena().token
        with pytest.raises(ResponseError, match="STALEARENA"):
            kv.execute(fp.KV_LEASE, b"x" * 16, 1000, "k")
        with pytest.raises(ResponseError, match="TTL"):
            kv.execute(fp.KV_LEASE, token, 0, "k")
        with pytest.raises(ResponseError, match="EXPIRED"):
            kv.execute(fp.KV_PUBLISH, 12345, "k2")
        before = leases(kv)
        with pytest.raises(ResponseError, match="OOM"):
            kv.execute(fp.KV_RESERVE, token, 1000, MIB, 1 << 40)
        after = leases(kv)                                # the put's spare stays; the failed RESERVE left nothing
        assert after["reservations_active"] == before["reservations_active"] == len(kv.fast_path.spares)
        assert kv.execute(fp.KV_RELEASE, 42) == [0]                    # unknown lease: not valid


def test_async_client_pipelines_a_long_batch_through_the_arena(server):
    values = [pattern(i, 256 * 1024) for i in range(80)]
    keys = [f"blk{i}" for i in range(len(values))]

    async def scenario():
        async with AsyncKVClient(unix_socket=server.unix_socket, fast_path="required") as kv:
            assert await kv.batch_put(zip(keys, values)) == [True] * len(keys)
            into = np.zeros((len(keys) + 1, 256 * 1024), np.uint8)
            lengths = await kv.batch_get_into(keys + ["absent"], list(into))
            assert lengths == [256 * 1024] * len(keys) + [None]
            assert all(np.array_equal(row, v) for row, v in zip(into, values))
            assert await kv.get("blk3") == values[3].tobytes()
            return kv.fast_path.stats
    stats = asyncio.run(scenario())
    assert stats.reads >= 3 and stats.wire_calls == 0
