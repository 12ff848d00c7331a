"""Integration tests for client/async_client.py (AsyncKVClient) against real processes.

Like test_client_sync.py: one real kvstore daemon for the module (emptied
before each test, over TCP and its Unix socket), daemons of their own for a
password and a restart, and loopback listeners that never answer or drop a
connection. Each test runs its scenario in a fresh event loop, on asyncio's
default loop and, where the transport differs, on uvloop too.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import numpy as np
import pytest
import uvloop
from test_client_sync import node, payload, scripted_server, server, silent_listener  # noqa: F401  (shared fixtures)

from client import (AsyncKVClient, AuthenticationError, BlockHasher, BufferTooSmall, ConnectionError,
                    KVError, Location, Namespace, ResponseError, TimeoutError)

MiB = 1 << 20
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def run(scenario: Awaitable[Any], loop: str = "asyncio") -> Any:
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        return runner.run(scenario)


@pytest.fixture(params=["tcp", "unix"])
def endpoint(request, server) -> dict[str, Any]:
    """Keyword arguments that reach the module's daemon over TCP or its Unix socket."""
    where = {"host": server.host, "port": server.port}
    if request.param == "unix":
        where["unix_socket"] = server.unix_socket
    return where


@pytest.mark.parametrize("loop", LOOPS)
def test_put_get_and_missing_keys(endpoint, loop):
    async def scenario():
        async with AsyncKVClient(**endpoint) as kv:
            assert await kv.ping() is True
            assert await kv.put("k", b"first") is True
            assert await kv.put("k", b"second") is False
            assert await kv.put("k", b"third", overwrite=True) is True
            assert await kv.get("k") == b"third"
            assert await kv.get("absent") is None
            big = payload(3 * MiB + 1)
            assert await kv.put("big", np.frombuffer(big, dtype=np.uint8)) is True
            assert await kv.get("big") == big
    run(scenario(), loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_get_into_numpy_and_bytearray(endpoint, loop):
    async def scenario():
        async with AsyncKVClient(**endpoint) as kv:
            value = payload(2 * MiB, seed=5)
            await kv.put("k", value, parent=None)
            array = np.zeros(MiB, dtype=np.uint16)
            assert await kv.get_into("k", array) == 2 * MiB
            assert array.tobytes() == value
            small = bytearray(b"#" * 8)
            await kv.put("s", b"abc")
            assert await kv.get_into("s", small) == 3 and small == b"abc#####"
            assert await kv.get_into("absent", small) is None
    run(scenario(), loop)


def test_buffer_too_small_keeps_the_connection(server):
    async def scenario():
        async with AsyncKVClient(server.host, server.port, pool_size=1) as kv:
            await kv.put("k", payload(MiB, seed=6))
            conn_id = await kv.execute("CLIENT", "ID")
            target = bytearray(100)
            with pytest.raises(BufferTooSmall):
                await kv.get_into("k", target)
            assert target == bytes(100)
            assert await kv.get("k") == payload(MiB, seed=6)
            assert await kv.execute("CLIENT", "ID") == conn_id
    run(scenario())


def test_exists_and_delete(endpoint):
    async def scenario():
        async with AsyncKVClient(**endpoint) as kv:
            await kv.batch_put({"a": b"1", "b": b"2"})
            assert await kv.exists("a", "b", "c") == 2
            assert await kv.delete("a", "c") == 1
            assert await kv.exists("a") == 0
    run(scenario())


def test_batches(endpoint):
    async def scenario():
        async with AsyncKVClient(**endpoint) as kv:
            blocks = np.random.default_rng(7).integers(0, 255, (32, 100_000), dtype=np.uint8)
            keys = [f"b{i}" for i in range(len(blocks))]
            assert await kv.batch_put(zip(keys, blocks), parents=[None, *keys[:-1]]) == [True] * 32
            assert await kv.batch_put([(keys[0], b"x")]) == [False]
            got = await kv.batch_get([*keys, "missing"])
            assert got[:-1] == [row.tobytes() for row in blocks] and got[-1] is None
            into = np.zeros_like(blocks)
            assert await kv.batch_get_into(keys, list(into)) == [100_000] * 32
            assert np.array_equal(into, blocks)
    run(scenario())


def test_match_locate_and_stats(endpoint):
    async def scenario():
        async with AsyncKVClient(**endpoint) as kv:
            hasher = BlockHasher(Namespace("tiny-llama", dtype="float16"), 8)
            prompt = np.arange(8 * 5 + 3)
            keys = hasher.keys(prompt)
            await kv.batch_put([(k, b"kv") for k in keys[:3]], parents=[None, *keys[:2]])
            assert await kv.match_prefix(keys) == 3
            assert await kv.match_tokens(hasher, prompt) == 24
            assert await kv.locate([keys[0], keys[4]]) == [Location("dram", 2), None]
            before = await kv.stats()
            await kv.get(keys[0])
            assert (await kv.stats())["hits"] == before["hits"] + 1
    run(scenario())


def test_concurrent_tasks_share_a_small_pool(server):
    async def scenario():
        async with AsyncKVClient(server.host, server.port, pool_size=2) as kv:
            async def roundtrip(n: int) -> bool:
                value = payload(50_000 + n, seed=n)
                await kv.put(f"task-{n}", value)
                return await kv.get(f"task-{n}") == value
            assert all(await asyncio.gather(*(roundtrip(n) for n in range(40))))
    run(scenario())


def test_cancelled_call_leaves_the_pool_consistent(server):
    async def scenario():
        async with AsyncKVClient(server.host, server.port, pool_size=1) as kv:
            keys = [f"c{i}" for i in range(16)]
            await kv.batch_put([(k, payload(256 * 1024, seed=i)) for i, k in enumerate(keys)])
            for delay_steps in range(0, 40, 4):
                task = asyncio.create_task(kv.batch_get(keys))
                for _ in range(delay_steps):
                    await asyncio.sleep(0)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                assert await kv.get(keys[3]) == payload(256 * 1024, seed=3)
    run(scenario())


def test_server_error_reply(server):
    async def scenario():
        async with AsyncKVClient(server.host, server.port) as kv:
            with pytest.raises(ResponseError) as raised:
                await kv.execute("KV.MATCH")
            assert "wrong number of arguments" in raised.value.message
            assert await kv.ping()
    run(scenario())


def test_password(kvstore_factory):
    daemon = kvstore_factory(password="pw")

    async def scenario():
        async with AsyncKVClient(daemon.host, daemon.port, password="pw") as kv:
            assert await kv.put("k", b"v") and await kv.get("k") == b"v"
        async with AsyncKVClient(unix_socket=daemon.unix_socket, password="pw") as kv:
            assert await kv.get("k") == b"v"
        async with AsyncKVClient(daemon.host, daemon.port, password="nope") as kv:
            with pytest.raises(AuthenticationError):
                await kv.ping()
        async with AsyncKVClient(daemon.host, daemon.port) as kv:
            with pytest.raises(AuthenticationError):
                await kv.get("k")
    run(scenario())


def test_server_restarted_mid_session(kvstore_factory):
    daemons = [kvstore_factory()]

    async def scenario():
        async with AsyncKVClient(daemons[0].host, daemons[0].port) as kv:
            assert await kv.put("before", b"1")
            daemons.append(kvstore_factory.restart(daemons[0]))
            assert await kv.put("after", b"2") is True
            assert await kv.get("before") is None
            assert await kv.get("after") == b"2"
    run(scenario())


def test_reads_retry_and_put_once_does_not():
    async def scenario(port: int, reply_kind: str):
        async with AsyncKVClient(port=port, retries=2) as kv:
            if reply_kind == "get":
                assert await kv.get("k") == b"hello"
            else:
                with pytest.raises(ConnectionError):
                    await kv.put("k", b"v")
    with scripted_server(b"$5\r\nhello\r\n", drop_first=True) as port:
        run(scenario(port, "get"))
    with scripted_server(b":1\r\n", drop_first=True) as port:
        run(scenario(port, "put"))


@pytest.mark.parametrize("loop", LOOPS)
def test_timeout_against_a_server_that_never_answers(loop):
    async def scenario(port: int):
        async with AsyncKVClient(port=port, timeout=0.2) as kv:
            with pytest.raises(TimeoutError):
                await kv.ping()
    with silent_listener() as port:
        run(scenario(port), loop)


def test_closed_client_refuses_work(server):
    async def scenario():
        kv = AsyncKVClient(server.host, server.port)
        await kv.ping()
        await kv.close()
        with pytest.raises(KVError):
            await kv.ping()
    run(scenario())


def test_replies_split_at_every_boundary_are_parsed():
    big = payload(100_001, seed=10)
    replies = b"$3\r\nabc\r\n$%d\r\n" % len(big) + big + b"\r\n"

    async def scenario(port: int):
        async with AsyncKVClient(port=port, pool_size=1) as kv:
            into = bytearray(len(big))
            assert await kv.batch_get_into(["a", "b"], [bytearray(3), into]) == [3, len(big)]
            assert into == big
    with scripted_server(replies, trickle=True) as port:
        run(scenario(port))
