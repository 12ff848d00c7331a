"""Batches of puts through the arena against real `kvstore serve` processes
(client/arena_writes.py): every value lands whole under its key and put-once answers per
value; a batch the node has no room for, a copy that fails half-way and a copy that
outlives its reservations each raise, store nothing, leave no reservation behind and
leave the client usable; the asyncio client too."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from client import AsyncKVClient, KVClient, ResponseError
from client.errors import TimeoutError
from conftest import eventually
from test_fastpath_faults import counters

MIB = 1 << 20
COUNT = 40


def value(n: int, size: int = MIB) -> np.ndarray:
    return np.full(size, n % 251, np.uint8)


def stored(kv: KVClient, keys: list[str]) -> list[int | None]:
    """Each key's version (a torn value fails here), or None."""
    out = []
    for got in kv.batch_get(keys):
        if got is None:
            out.append(None)
            continue
        data = np.frombuffer(got, np.uint8)
        assert (data == data[0]).all(), "a torn value was stored"
        out.append(int(data[0]))
    return out


def no_reservations_left(kv: KVClient) -> bool:
    kv.ping()                              # carries the give-backs the failed put left
    return counters(kv)["reservations_active"] == len(kv.fast_path.spares)


def test_every_value_of_a_batch_lands_whole_and_put_once_answers_per_value(server):
    with KVClient(unix_socket=server.unix_socket, fast_path="required") as kv:
        keys = [f"k{n}" for n in range(COUNT)]
        assert kv.batch_put({key: value(n) for n, key in enumerate(keys)}) == [True] * COUNT
        assert stored(kv, keys) == [n % 251 for n in range(COUNT)]
        again = {key: value(200) for key in keys[::2] + ["new"]}
        assert kv.batch_put(again) == [False] * len(keys[::2]) + [True]
        assert stored(kv, keys[:2] + ["new"]) == [0, 1, 200]
        assert kv.fast_path.stats.wire_calls == 0


def test_a_batch_the_node_has_no_room_for_stores_nothing(kvstore_factory):
    daemon = kvstore_factory("--dram-size", "24mb", "--maxmemory-policy", "noeviction")
    with KVClient(unix_socket=daemon.unix_socket, fast_path="required") as kv:
        keys = [f"k{n}" for n in range(COUNT)]
        with pytest.raises(ResponseError, match="OOM|room|memory"):
            kv.batch_put({key: value(n) for n, key in enumerate(keys)})
        assert stored(kv, keys) == [None] * COUNT
        assert eventually(lambda: no_reservations_left(kv))
        kv.delete(*keys)
        assert kv.put("after", value(7)) is True and stored(kv, ["after"]) == [7]


def test_a_copy_that_fails_half_way_gives_its_reservations_back_at_once(server):
    with KVClient(unix_socket=server.unix_socket, fast_path="required") as kv:
        arena = kv.fast_path.arena()
        write, copies = arena.write, []

        def failing(offset, view):
            copies.append(offset)
            if len(copies) == COUNT // 2:
                raise BufferError("the caller's buffer went away")
            write(offset, view)
        arena.write = failing
        keys = [f"k{n}" for n in range(COUNT)]
        with pytest.raises(BufferError):
            kv.batch_put({key: value(n) for n, key in enumerate(keys)})
        arena.write = write
        assert stored(kv, keys) == [None] * COUNT
        assert counters(kv)["reservations_active"] == len(kv.fast_path.spares)   # given back at once
        assert kv.put("after", value(9)) is True and stored(kv, ["after"]) == [9]


def test_a_copy_that_outlives_its_reservations_gives_them_back(server):
    with KVClient(unix_socket=server.unix_socket, fast_path="required") as kv:
        kv.fast_path.reservation_ttl_ms = 1       # half of it is over before the first copy ends
        with pytest.raises(TimeoutError):
            kv.batch_put({f"k{n}": value(n) for n in range(COUNT)})
        kv.fast_path.reservation_ttl_ms = 30_000
        assert eventually(lambda: no_reservations_left(kv))
        assert kv.put("after", value(3)) is True and stored(kv, ["after"]) == [3]


def test_the_async_client_puts_a_batch_through_the_arena(server):
    async def scenario() -> None:
        async with AsyncKVClient(unix_socket=server.unix_socket, fast_path="required") as kv:
            keys = [f"a{n}" for n in range(COUNT)]
            assert await kv.batch_put({key: value(n) for n, key in enumerate(keys)}) == [True] * COUNT
            assert kv.fast_path.stats.wire_calls == 0
    asyncio.run(scenario())
    with KVClient(unix_socket=server.unix_socket, fast_path="off") as wire:
        assert stored(wire, [f"a{n}" for n in range(COUNT)]) == [n % 251 for n in range(COUNT)]
