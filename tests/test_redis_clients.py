"""Real Redis clients, unchanged, against the daemon.

Starts a real redis-server and a `kvstore serve` daemon and drives both with
the clients the store must serve: redis-py (sync, pipelines, both reply
parsers, RESP2 and its default RESP3), redis-py asyncio with a 150-connection
pool used the way LMCache's `redis://` connector uses it, the redis-cli and
redis-benchmark binaries, and a strict raw-socket client like LMCache's
`resp://` connector. Every test runs against Redis as well, so a failure on
kvstore alone is a compatibility gap, not a wrong expectation.
"""
from __future__ import annotations

import asyncio
import os
import re
import select
import socket
import struct
import subprocess
import threading
import time

import pytest
import redis
import redis.asyncio
from redis._parsers import _HiredisParser, _RESP2Parser, _RESP3Parser

from conftest import Daemon
from test_redis_compat import RespConnection, encode_command, node, target  # noqa: F401  (shared fixtures)

MiB = 1 << 20


def pattern(size: int, seed: int) -> bytes:
    """Distinct, position-dependent content, so a shifted or mixed-up value shows."""
    block = bytes((seed + i) % 251 for i in range(4096))
    return (block * (size // 4096 + 1))[:size]


PARSERS = {
    "hiredis-resp3": dict(parser_class=_HiredisParser),
    "hiredis-resp2": dict(parser_class=_HiredisParser, protocol=2),
    "python-resp3": dict(parser_class=_RESP3Parser, protocol=3),
    "python-resp2": dict(parser_class=_RESP2Parser, protocol=2),
}


@pytest.fixture(params=PARSERS)
def client(request, target) -> redis.Redis:
    pool = redis.ConnectionPool(host=target.host, port=target.port, socket_timeout=30,
                                **PARSERS[request.param])
    conn = redis.Redis(connection_pool=pool)
    yield conn
    conn.close()
    pool.disconnect()


def test_redis_py_basic_commands(client):
    assert client.ping() is True
    assert client.set("k", "v") is True
    assert client.get("k") == b"v"
    assert client.get("missing") is None
    assert client.set("k", "w", nx=True) is None
    assert client.set("k", "x", xx=True, ex=100) is True
    assert 0 < client.ttl("k") <= 100
    assert client.mset({"a": "1", "b": "2"}) is True
    assert client.mget(["a", "missing", "b"]) == [b"1", None, b"2"]
    assert client.exists("a", "b", "missing") == 2
    assert client.getdel("a") == b"1"
    assert client.delete("a", "b", "missing") == 1
    assert client.strlen("k") == 1
    assert client.type("k") == b"string"
    assert client.dbsize() == 1
    assert sorted(client.scan_iter(match="*")) == [b"k"]
    assert client.client_setname("py") is True
    assert client.client_getname() in ("py", b"py")
    assert client.info()["redis_version"]
    with pytest.raises(redis.ResponseError, match="wrong number of arguments"):
        client.execute_command("GET")


def test_redis_py_pipeline_without_transaction(client):
    pipe = client.pipeline(transaction=False)
    for i in range(200):
        pipe.set(f"p{i}", i)
    for i in range(200):
        pipe.get(f"p{i}")
    pipe.get("missing")
    replies = pipe.execute()
    assert replies[:200] == [True] * 200
    assert replies[200:400] == [str(i).encode() for i in range(200)]
    assert replies[400] is None


def test_redis_py_pipeline_with_transaction(client):
    """redis-py's default pipeline wraps the batch in MULTI/EXEC."""
    pipe = client.pipeline()
    pipe.set("t", "1").get("t").exists("t", "missing").delete("t")
    assert pipe.execute() == [True, b"1", 1, 1]


@pytest.mark.parametrize("size_mib", [1, 4, 8])
def test_redis_py_large_values(client, size_mib):
    value = pattern(size_mib * MiB, size_mib)
    assert client.set("large", value) is True
    assert client.strlen("large") == len(value)
    assert client.get("large") == value
    other = pattern(size_mib * MiB, size_mib + 1)
    assert client.mset({"large-a": value, "large-b": other}) is True
    assert client.mget(["large-b", "large-a"]) == [other, value]


def test_redis_py_unix_socket(node):
    conn = redis.Redis(unix_socket_path=node.unix_socket)
    try:
        assert conn.set("via-unix", b"\x00" * MiB) is True
        assert conn.get("via-unix") == b"\x00" * MiB
    finally:
        conn.close()


async def lmcache_round(daemon: Daemon, chunks: int, chunk_size: int) -> int:
    """What LMCache's redis connector does: a 150-connection pool guarded by a
    semaphore; per chunk, SET `<key>kv_bytes` then `<key>metadata`; EXISTS on
    the metadata key; GET metadata then kv_bytes; DEL. Returns the peak number
    of connected clients seen by the server."""
    pool = redis.asyncio.ConnectionPool(host=daemon.host, port=daemon.port, max_connections=150)
    conn = redis.asyncio.Redis.from_pool(pool)
    gate = asyncio.Semaphore(150)

    async def put(i: int) -> None:
        async with gate:
            await conn.set(f"chunk{i:05d}kv_bytes", pattern(chunk_size, i))
            await conn.set(f"chunk{i:05d}metadata", struct.pack("<qii", chunk_size, i, 2))

    async def check(i: int) -> None:
        async with gate:
            assert await conn.exists(f"chunk{i:05d}metadata") == 1
            meta = await conn.get(f"chunk{i:05d}metadata")
            assert struct.unpack("<qii", meta) == (chunk_size, i, 2)
            assert await conn.get(f"chunk{i:05d}kv_bytes") == pattern(chunk_size, i)

    async def drop(i: int) -> None:
        async with gate:
            assert await conn.delete(f"chunk{i:05d}metadata", f"chunk{i:05d}kv_bytes") == 2
            assert not await conn.exists(f"chunk{i:05d}metadata")

    try:
        await asyncio.gather(*(put(i) for i in range(chunks)))
        await asyncio.gather(*(check(i) for i in range(chunks)))
        clients = (await conn.info("clients"))["connected_clients"]
        await asyncio.gather(*(drop(i) for i in range(chunks)))
        assert await conn.dbsize() == 0
        return clients
    finally:
        await conn.aclose()
        await pool.disconnect()


def test_redis_py_asyncio_pool_like_lmcache(target):
    clients = asyncio.run(lmcache_round(target, chunks=400, chunk_size=32 * 1024))
    assert clients >= 100, "the pool should have opened close to 150 connections"


def redis_cli(daemon: Daemon, *args: str, stdin: bytes = b"") -> str:
    done = subprocess.run(["redis-cli", "-h", daemon.host, "-p", str(daemon.port), *args],
                          capture_output=True, timeout=30, input=stdin)
    assert done.returncode == 0, done.stderr
    return done.stdout.decode()


def test_redis_cli_commands(target):
    assert redis_cli(target, "PING") == "PONG\n"
    assert redis_cli(target, "SET", "cli", "hello world") == "OK\n"
    assert redis_cli(target, "GET", "cli") == "hello world\n"
    assert redis_cli(target, "--no-raw", "GET", "cli") == '"hello world"\n'
    assert redis_cli(target, "--no-raw", "GET", "missing") == "(nil)\n"
    assert redis_cli(target, "--no-raw", "EXISTS", "cli", "cli") == "(integer) 2\n"
    assert redis_cli(target, "--no-raw", "MGET", "cli", "missing") == '1) "hello world"\n2) (nil)\n'
    assert redis_cli(target, "--no-raw", "GET") == \
        "(error) ERR wrong number of arguments for 'get' command\n"
    assert re.search(r"^redis_version:\d+\.\d+\.\d+\r?$", redis_cli(target, "INFO"), re.M)
    assert redis_cli(target, "--scan", "--pattern", "c*") == "cli\n"
    assert redis_cli(target, "DBSIZE") == "1\n"


def test_redis_cli_keyspace_tools(target):
    """--bigkeys and --memkeys walk the keyspace with SCAN, TYPE, STRLEN and MEMORY USAGE."""
    redis_cli(target, "SET", "big", "x" * 1000)
    redis_cli(target, "SET", "small", "x")
    assert "Biggest string found '\"big\"' has 1000 bytes" in redis_cli(target, "--bigkeys")
    assert re.search(r"Biggest string found '\"big\"' has \d+ bytes", redis_cli(target, "--memkeys"))


def test_redis_cli_pipe_mode(target):
    """Mass insertion: raw RESP on stdin, ended by an ECHO the tool waits for."""
    requests = b"".join(encode_command("SET", f"pipe:{i}", i) for i in range(10000))
    output = redis_cli(target, "--pipe", stdin=requests)
    assert "errors: 0, replies: 10000" in output
    assert redis_cli(target, "DBSIZE") == "10000\n"


class RecordingProxy:
    """A TCP relay in front of a server that records what its clients send."""

    def __init__(self, daemon: Daemon):
        self.upstream = (daemon.host, daemon.port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sent = bytearray()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        client, _ = self.listener.accept()
        with client, socket.create_connection(self.upstream) as server:
            peers = {client: server, server: client}
            while True:
                ready, _, _ = select.select(list(peers), [], [], 30)
                if not ready:
                    return
                for sock in ready:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    if sock is client:
                        self.sent += data
                    peers[sock].sendall(data)

    def close(self) -> None:
        self.listener.close()
        self.thread.join(5)


def read_until(fd: int, marker: bytes, timeout: float = 10.0) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while marker not in seen:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"waited for {marker!r}, saw {seen!r}"
        if select.select([fd], [], [], remaining)[0]:
            seen += os.read(fd, 4096)
    return seen


def test_redis_cli_interactive_session_asks_command_docs(target):
    proxy = RecordingProxy(target)
    primary, secondary = os.openpty()
    cli = subprocess.Popen(["redis-cli", "-p", str(proxy.port)], stdin=secondary, stdout=secondary,
                           stderr=secondary, env={**os.environ, "TERM": "dumb"},
                           start_new_session=True)
    os.close(secondary)
    try:
        read_until(primary, b"> ")
        os.write(primary, b"PING\r")
        assert b"PONG" in read_until(primary, b"PONG")
        os.write(primary, b"SET inter active\r")
        read_until(primary, b"OK")
        os.write(primary, b"GET inter\r")
        read_until(primary, b'"active"')
        os.write(primary, b"quit\r")
        assert cli.wait(10) == 0
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        os.close(primary)
        proxy.close()
    assert encode_command("COMMAND", "DOCS") in proxy.sent


def benchmark(daemon: Daemon, *args: str) -> dict[str, float]:
    """redis-benchmark's requests per second by test name."""
    done = subprocess.run(["redis-benchmark", "-h", daemon.host, "-p", str(daemon.port), "-q", *args],
                          capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    text = done.stdout.decode().replace("\r", "\n")
    return {name: float(rate) for name, rate in
            re.findall(r"^\s*([A-Z_]+(?: \(\d+ keys\))?): ([\d.]+) requests per second", text, re.M)}


def test_redis_benchmark_smoke(target):
    rates = benchmark(target, "-t", "set,get,ping_inline,mset", "-n", "2000")
    assert set(rates) == {"SET", "GET", "PING_INLINE", "MSET (10 keys)"}
    assert all(rate > 0 for rate in rates.values())


def test_redis_benchmark_pipelined(target):
    rates = benchmark(target, "-t", "set,get", "-n", "5000", "-P", "16")
    assert set(rates) == {"SET", "GET"} and all(rate > 0 for rate in rates.values())


def test_redis_benchmark_large_values(target):
    rates = benchmark(target, "-t", "set,get", "-n", "200", "-c", "10", "-d", "65536")
    assert set(rates) == {"SET", "GET"} and all(rate > 0 for rate in rates.values())
    with RespConnection(target) as conn:
        assert conn.call("STRLEN", "key:__rand_int__") == b":65536\r\n"


def test_strict_native_client_16mib(target):
    """LMCache's resp:// client: one 16 MiB chunk per key, replies parsed strictly."""
    values = {f"chunk-{i}": pattern(16 * MiB, i) for i in range(2)}
    conns = [RespConnection(target, timeout=60) for _ in values]
    try:
        for conn, (key, value) in zip(conns, values.items()):
            conn.send(encode_command("SET", key, value))
        assert [conn.read_reply() for conn in conns] == [b"+OK\r\n"] * len(conns)
        for conn, (key, value) in zip(conns, values.items()):
            assert conn.call("EXISTS", key) == b":1\r\n"
            reply = conn.call("GET", key)
            assert reply[:12] == b"$16777216\r\n" + value[:1]
            assert reply == b"$16777216\r\n" + value + b"\r\n"
        assert conns[0].call("GET", "missing") == b"$-1\r\n"
        assert conns[0].call("DEL", *values) == b":2\r\n"
    finally:
        for conn in conns:
            conn.close()

