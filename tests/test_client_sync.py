"""Integration tests for client/sync_client.py (KVClient) against real processes.

They start the real kvstore daemon: one per module, emptied before each test
and reached over TCP and its Unix socket, plus daemons of their own (through
`kvstore_factory`) for a password and for a restart mid-session. Small loopback
listeners of their own stand for the failures a daemon does not produce on
demand: a server that never answers, one that drops a connection in the
middle of a request.
"""
from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np
import pytest
from conftest import Daemon, free_port

from client import (AuthenticationError, BlockHasher, BufferTooSmall, ConnectionError, KVClient,
                    KVError, Location, Namespace, ProtocolError, ResponseError, TimeoutError)

MiB = 1 << 20


@pytest.fixture(scope="module")
def node(kvstore_module_factory) -> Daemon:
    """One kvstore daemon for the tests of this module that do not stop or reconfigure it."""
    return kvstore_module_factory()


@pytest.fixture
def server(node) -> Daemon:
    """The module's daemon, emptied (FLUSHALL) before each test."""
    with KVClient(node.host, node.port) as kv:
        kv.execute("FLUSHALL")
    return node


@pytest.fixture(params=["tcp", "unix"])
def client(request, server) -> Iterator[KVClient]:
    via_socket = {"unix_socket": server.unix_socket} if request.param == "unix" else {}
    with KVClient(server.host, server.port, **via_socket) as kv:
        yield kv


def payload(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


# --- helpers shared with test_client_async.py -------------------------------------

@contextlib.contextmanager
def silent_listener() -> Iterator[int]:
    """A TCP port whose listener accepts connections (in the kernel backlog) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


@contextlib.contextmanager
def scripted_server(reply: bytes, *, drop_first: bool = False, trickle: bool = False) -> Iterator[int]:
    """A TCP port that answers every request it receives with the canned `reply`.

    drop_first: the first connection is closed as soon as its first request arrives.
    trickle: the reply goes out in pieces of varying size (1 byte to 64 KiB), so the
    client sees it split at every kind of boundary (inside CRLFs, headers, bodies).
    """
    listener = socket.create_server(("127.0.0.1", 0))

    def answer(conn: socket.socket) -> None:
        if not trickle:
            conn.sendall(reply)
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        offset = 0
        for size in itertools.cycle(TRICKLE_PIECES):
            if offset >= len(reply):
                return
            conn.sendall(reply[offset:offset + size])
            offset += size
            time.sleep(0.0005)

    def serve() -> None:
        drop = drop_first
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):     # the client may hang up mid-reply
                while conn.recv(1 << 20) and not drop:
                    answer(conn)
            drop = False

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


TRICKLE_PIECES = (1, 2, 3, 5, 8, 13, 4096, 1, 65536, 7)


# --- every method ----------------------------------------------------------------

def test_ping(client):
    assert client.ping() is True


def test_missing_key_is_not_an_error(client):
    assert client.get("absent") is None
    assert client.get_into("absent", bytearray(8)) is None
    assert client.batch_get(["absent", "also-absent"]) == [None, None]


def test_put_is_put_once_unless_overwrite(client):
    assert client.put("k", b"first") is True
    assert client.put("k", b"second") is False
    assert client.get("k") == b"first"
    assert client.put("k", b"third", overwrite=True) is True
    assert client.get("k") == b"third"


def test_put_accepts_any_bytes_like_value(client):
    array = np.arange(1000, dtype=np.float16).reshape(10, 100)
    client.put("array", array)
    client.put("view", memoryview(b"abcdef")[2:])
    client.put("bytearray", bytearray(b"xyz"))
    client.put("text", "héllo")
    assert client.get("array") == array.tobytes()
    assert client.get("view") == b"cdef"
    assert client.get("bytearray") == b"xyz"
    assert client.get("text") == "héllo".encode()


def test_large_value_round_trip(client):
    value = payload(3 * MiB + 7)
    assert client.put("big", value) is True
    got = client.get("big")
    assert isinstance(got, bytearray) and got == value


def test_put_with_parent_records_a_chain(client):
    assert client.put("root", b"r") is True
    assert client.put("child", b"c", parent="root") is True
    assert client.match_prefix(["root", "child"]) == 2


def test_get_into_numpy_array(client):
    value = payload(2 * MiB, seed=1)
    client.put("k", value)
    target = np.zeros(2 * MiB // 4, dtype=np.float32)
    assert client.get_into("k", target) == 2 * MiB
    assert target.tobytes() == value


def test_get_into_bytearray_leaves_the_rest_untouched(client):
    client.put("k", b"hello")
    target = bytearray(b"#" * 12)
    assert client.get_into("k", target) == 5
    assert target == b"hello#######"


def test_get_into_memoryview_slice(client):
    client.put("k", payload(100_000, seed=2))
    backing = bytearray(300_000)
    assert client.get_into("k", memoryview(backing)[100_000:]) == 100_000
    assert backing[100_000:200_000] == payload(100_000, seed=2)
    assert backing[:100_000] == bytes(100_000)


def test_get_into_rejects_read_only_and_strided_buffers(client):
    with pytest.raises(TypeError):
        client.get_into("k", b"immutable")
    with pytest.raises(TypeError):
        client.get_into("k", np.zeros((8, 8))[:, ::2])


@pytest.mark.parametrize("size", [10, 3 * MiB])
def test_buffer_too_small_keeps_the_connection(server, size):
    with KVClient(server.host, server.port, pool_size=1) as kv:
        kv.put("k", payload(size, seed=3))
        conn_id = kv.execute("CLIENT", "ID")
        target = bytearray(b"#" * (size - 1))
        with pytest.raises(BufferTooSmall) as raised:
            kv.get_into("k", target)
        assert (raised.value.size, raised.value.capacity) == (size, size - 1)
        assert target == b"#" * (size - 1)
        assert kv.get("k") == payload(size, seed=3)
        assert kv.execute("CLIENT", "ID") == conn_id


def test_exists_and_delete(client):
    client.batch_put({"a": b"1", "b": b"2"})
    assert client.exists("a", "b", "c") == 2
    assert client.exists() == 0
    assert client.delete("a", "c") == 1
    assert client.exists("a", "b") == 1
    assert client.delete() == 0


def test_batch_put_and_batch_get(client):
    items = [(f"block-{i}", payload(1000 + i, seed=i)) for i in range(50)]
    parents = [None] + [key for key, _ in items[:-1]]
    assert client.batch_put(items, parents=parents) == [True] * 50
    assert client.batch_put(items[:2] + [("fresh", b"f")]) == [False, False, True]
    assert client.batch_put({"fresh": b"g"}, overwrite=True) == [True]
    got = client.batch_get([key for key, _ in items] + ["missing", "fresh"])
    assert got == [value for _, value in items] + [None, b"g"]
    assert client.match_prefix([key for key, _ in items]) == 50


def test_batch_put_checks_parents_length(client):
    with pytest.raises(ValueError):
        client.batch_put([("a", b"1"), ("b", b"2")], parents=[None])


def test_batch_get_into_rows_of_one_array(client):
    blocks = np.random.default_rng(4).integers(0, 2**16, (64, 32 * 1024), dtype=np.uint16)
    keys = [f"row-{i}" for i in range(len(blocks))]
    client.batch_put(zip(keys, blocks))
    into = np.zeros_like(blocks)
    lengths = client.batch_get_into(keys + ["missing"], [*into, bytearray(4)])
    assert lengths == [blocks[0].nbytes] * 64 + [None]
    assert np.array_equal(into, blocks)


def test_batch_get_into_too_small_reads_every_reply(server):
    with KVClient(server.host, server.port, pool_size=1) as kv:
        kv.batch_put({"a": b"aaaa", "b": payload(MiB), "c": b"cc"})
        buffers = [bytearray(4), bytearray(10), bytearray(2)]
        with pytest.raises(BufferTooSmall) as raised:
            kv.batch_get_into(["a", "b", "c"], buffers)
        assert raised.value.key == "b"
        assert buffers == [b"aaaa", bytes(10), b"cc"]
        assert kv.batch_get(["c", "a"]) == [b"cc", b"aaaa"]


def test_match_prefix_counts_leading_keys(client):
    keys = [f"chain-{i}" for i in range(256)]
    client.batch_put([(k, b"v") for k in keys[:100]])
    client.put(keys[150], b"v")
    assert client.match_prefix(keys) == 100
    assert client.match_prefix(keys[1:]) == 99
    assert client.match_prefix(["nope", *keys]) == 0
    assert client.match_prefix([]) == 0


def test_match_tokens_counts_whole_cached_blocks(client):
    hasher = BlockHasher(Namespace("tiny-llama", dtype="float16"), 16, prefix="tiny:")
    prompt = np.arange(16 * 6 + 5)
    keys = hasher.keys(prompt)
    client.batch_put([(k, b"kv") for k in keys[:4]], parents=[None, *keys[:3]])
    assert client.match_tokens(hasher, prompt) == 4 * 16
    assert client.match_tokens(hasher, prompt[:40]) == 2 * 16
    assert client.match_tokens(hasher, prompt[:15]) == 0
    other_tenant = BlockHasher(Namespace("tiny-llama", dtype="float16", salt="t2"), 16, prefix="tiny:")
    assert client.match_tokens(other_tenant, prompt) == 0


def test_locate(client):
    client.put("here", payload(4096))
    assert client.locate(["here", "gone"]) == [Location("dram", 4096), None]
    assert client.locate([]) == []


def test_stats_counts_hits_and_misses(client):
    before = client.stats()
    assert {"hits", "misses", "keys", "evictions", "bytes_gpu", "bytes_dram", "bytes_ssd"} <= set(before)
    client.put("s", b"12345")
    client.get("s")
    client.get("not-there")
    after = client.stats()
    assert after["hits"] == before["hits"] + 1
    assert after["misses"] == before["misses"] + 1
    assert after["keys"] == before["keys"] + 1
    assert after["bytes_dram"] >= before["bytes_dram"] + 5


# --- errors and faults --------------------------------------------------------------

def test_server_error_reply_is_raised_and_the_connection_survives(server):
    with KVClient(server.host, server.port, pool_size=1) as kv:
        conn_id = kv.execute("CLIENT", "ID")
        with pytest.raises(ResponseError) as raised:
            kv.execute("KV.MATCH")
        assert raised.value.code == "ERR" and "wrong number of arguments" in raised.value.message
        with pytest.raises(ResponseError):
            kv.execute("NO.SUCH.COMMAND", "x")
        assert kv.ping() and kv.execute("CLIENT", "ID") == conn_id


@pytest.mark.parametrize("via", ["tcp", "unix"])
def test_password(kvstore_factory, via):
    daemon = kvstore_factory(password="pw")
    where = {"unix_socket": daemon.unix_socket} if via == "unix" else {}
    with KVClient(daemon.host, daemon.port, password="pw", **where) as kv:
        assert kv.put("k", b"v") and kv.get("k") == b"v"
    with KVClient(daemon.host, daemon.port, password="wrong", **where) as kv:
        with pytest.raises(AuthenticationError):
            kv.ping()
    with KVClient(daemon.host, daemon.port, **where) as kv:
        with pytest.raises(AuthenticationError):
            kv.get("k")


def test_server_restarted_mid_session(kvstore_factory):
    daemon = kvstore_factory()
    with KVClient(daemon.host, daemon.port) as kv:
        assert kv.put("before", b"1")
        daemon = kvstore_factory.restart(daemon)
        assert kv.put("after", b"2") is True     # not retried: the stale connection was replaced
        assert kv.get("before") is None          # a fresh daemon, an empty cache
        assert kv.batch_get(["after"]) == [b"2"]


def test_idempotent_reads_retry_after_a_dropped_connection():
    with scripted_server(b"$5\r\nhello\r\n", drop_first=True) as port:
        with KVClient(port=port, retries=2, timeout=5) as kv:
            assert kv.get("k") == b"hello"


def test_put_once_is_not_retried_after_it_was_sent():
    with scripted_server(b":1\r\n", drop_first=True) as port:
        with KVClient(port=port, retries=2, timeout=5) as kv:
            with pytest.raises(ConnectionError):
                kv.put("k", b"v")
            assert kv.put("k", b"v") is True


def test_timeout_against_a_server_that_never_answers():
    with silent_listener() as port:
        with KVClient(port=port, timeout=0.2) as kv:
            with pytest.raises(TimeoutError):
                kv.ping()
            with pytest.raises(TimeoutError):
                kv.get_into("k", bytearray(10))


def test_timeout_over_a_unix_socket_and_a_send_that_cannot_finish(tmp_path):
    """The sync client bounds its waits in the kernel (SO_RCVTIMEO/SO_SNDTIMEO): a reply that
    never comes and a send the peer never drains both end as the SDK's TimeoutError."""
    path = str(tmp_path / "silent.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen(8)
        with KVClient(unix_socket=path, timeout=0.2, fast_path="off") as kv:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                kv.ping()
            assert time.monotonic() - started < 2
            with pytest.raises(TimeoutError):
                kv.put("k", bytes(64 << 20))


def test_connection_refused_is_a_connection_error():
    with KVClient(port=free_port(), retries=1) as kv:
        with pytest.raises(ConnectionError) as raised:
            kv.get("k")
    assert isinstance(raised.value, KVError) and isinstance(raised.value, OSError)


def test_closed_client_refuses_work(server):
    kv = KVClient(server.host, server.port)
    kv.ping()
    kv.close()
    with pytest.raises(KVError):
        kv.ping()


def test_threads_share_one_client(server):
    with KVClient(server.host, server.port, pool_size=3) as kv:
        def worker(n: int) -> bool:
            key, value = f"thread-{n}", payload(20_000 + n, seed=n)
            kv.put(key, value)
            into = bytearray(len(value))
            return kv.get(key) == value and kv.get_into(key, into) == len(value) and into == value

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(worker, range(64)))
        assert kv.exists(*[f"thread-{n}" for n in range(64)]) == 64


BIG = payload(200_003, seed=9)


def test_replies_split_at_every_boundary_are_parsed():
    replies = (b"$5\r\nhello\r\n$-1\r\n$%d\r\n" % len(BIG) + BIG + b"\r\n$0\r\n\r\n")
    with scripted_server(replies, trickle=True) as port:
        with KVClient(port=port, pool_size=1) as kv:
            assert kv.batch_get(["a", "b", "c", "d"]) == [b"hello", None, BIG, b""]
            buffers = [bytearray(5), bytearray(1), np.zeros(len(BIG), np.uint8), bytearray(0)]
            assert kv.batch_get_into(["a", "b", "c", "d"], buffers) == [5, None, len(BIG), 0]
            assert buffers[0] == b"hello" and buffers[2].tobytes() == BIG


def test_nested_integer_and_error_replies_are_parsed():
    locate = b"*3\r\n*2\r\n$4\r\ndram\r\n:123\r\n$-1\r\n*2\r\n$3\r\nssd\r\n:0\r\n"
    with scripted_server(locate, trickle=True) as port:
        with KVClient(port=port) as kv:
            assert kv.locate(["a", "b", "c"]) == [Location("dram", 123), None, Location("ssd", 0)]
    with scripted_server(b"-OOM command not allowed\r\n", trickle=True) as port:
        with KVClient(port=port) as kv:
            with pytest.raises(ResponseError) as raised:
                kv.put("a", b"v")
    assert raised.value.code == "OOM"
    long_error = b"-ERR " + b"x" * 200_000 + b"\r\n"       # longer than the receive buffer
    with scripted_server(long_error, trickle=True) as port:
        with KVClient(port=port) as kv:
            with pytest.raises(ResponseError) as raised:
                kv.get("a")
    assert raised.value.message == "ERR " + "x" * 200_000


@pytest.mark.parametrize("garbage", [b"?what\r\n", b"$abc\r\n", b"$3\r\nabcXY", b":12x\r\n",
                                     b"+" + b"x" * (2 << 20)])
def test_bytes_that_are_not_resp_raise_protocol_error(garbage):
    with scripted_server(garbage) as port:
        with KVClient(port=port, retries=0) as kv:
            with pytest.raises(ProtocolError):
                kv.get("k")
