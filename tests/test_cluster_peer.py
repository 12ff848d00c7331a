"""The node-to-node RESP client (kvstore/cluster/peer.py) against a real kvstore node and a silent socket."""
from __future__ import annotations

import asyncio
import socket

import pytest

from kvstore.cluster.peer import PeerError, PeerLink, PeerReplyError, encode
from tests.conftest import free_port


def test_requests_are_encoded_with_big_values_passed_as_they_are():
    big = memoryview(bytearray(b"x" * 100_000))
    parts = encode((b"SET", "k", 5, big))
    assert parts[1] is big
    assert b"".join(bytes(p) for p in parts) == b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n5\r\n$100000\r\n" \
        + b"x" * 100_000 + b"\r\n"


def test_pipelined_calls_error_replies_and_a_password(kvstore_factory):
    node = kvstore_factory(password="s3cret")

    async def scenario():
        link = PeerLink(f"127.0.0.1:{node.port}", password="s3cret")
        value = memoryview(bytes(range(256)) * 1000)
        replies = await link.pipeline([(b"SET", b"a", value), (b"GET", b"a"), (b"MGET", b"a", b"none"),
                                       (b"NOSUCH",), (b"EXISTS", b"a")])
        assert replies[:3] == ["OK", bytes(value), [bytes(value), None]] and replies[4] == 1
        assert isinstance(replies[3], PeerReplyError) and "unknown command" in str(replies[3])
        with pytest.raises(PeerReplyError):
            await link.call(b"NOSUCH")
        assert await link.call(b"PING") == "PONG"               # an error reply leaves the link up
        results = await asyncio.gather(*(link.call(b"ECHO", b"%d" % i) for i in range(50)))
        assert results == [b"%d" % i for i in range(50)]          # replies matched to calls in order
        wrong = PeerLink(f"127.0.0.1:{node.port}", password="nope")
        with pytest.raises(PeerError, match="refused AUTH"):
            await wrong.call(b"PING")
        link.close()

    asyncio.run(scenario())


def test_a_silent_peer_times_out_and_a_dead_one_fails_fast_then_the_link_reconnects():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    port = free_port()

    async def scenario():
        link = PeerLink(f"127.0.0.1:{silent.getsockname()[1]}", timeout=0.3)
        with pytest.raises(PeerError, match="did not answer within 0.3 s"):
            await link.call(b"PING")
        dead = PeerLink(f"127.0.0.1:{port}", timeout=0.3)
        with pytest.raises(PeerError, match="cannot connect"):
            await dead.call(b"PING")
        with pytest.raises(PeerError, match="unreachable"):
            await dead.call(b"PING")                            # within the reconnect interval: no attempt
        async def pong(reader, writer):
            while await reader.read(1024):
                writer.write(b"+PONG\r\n")

        server = await asyncio.start_server(pong, "127.0.0.1", port)
        try:
            await asyncio.sleep(0.6)
            assert await dead.call(b"PING") == "PONG"
        finally:
            server.close()

    try:
        asyncio.run(scenario())
    finally:
        silent.close()
