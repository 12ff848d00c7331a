"""Tests for client/block_transport.py: RespTransport against a real node, and KVClusterClient's use of it.

The RespTransport tests start the real kvstore daemon (one for the module,
each test on keys of its own; the node-down test starts and stops one of its
own) and reach it over TCP with the fast path off: the bytes cross the
socket, as they do between hosts. The cluster tests start no process: a
stand-in node client answers CLUSTER SLOTS and a recording transport shows
which calls reach it.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest
from conftest import Daemon, start_kvstore

from client import BufferTooSmall, ConnectionError, KVClient, KVClusterClient
from client.block_transport import BlockTransport, RespTransport

MiB = 1 << 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[Daemon]:
    running = start_kvstore(tmp_path_factory.mktemp("kvstore"))
    yield running
    running.stop()


@pytest.fixture
def blocks(daemon) -> Iterator[RespTransport]:
    """A RespTransport over a one-connection client (so a connection left dirty would show)."""
    transport = RespTransport(KVClient(daemon.host, daemon.port, fast_path="off", pool_size=1))
    yield transport
    transport.close()


def test_a_block_written_is_read_back_whole_and_into_a_caller_buffer(blocks):
    value = np.random.default_rng(1).integers(0, 256, MiB, dtype=np.uint8)
    assert blocks.write("rt:a", value) is True
    assert blocks.read("rt:a") == value.tobytes()
    into = np.zeros(2 * MiB, dtype=np.uint8)                    # larger than the value: fine
    assert blocks.read_into("rt:a", into) == MiB
    assert np.array_equal(into[:MiB], value) and not into[MiB:].any()


def test_a_write_is_put_once_unless_it_overwrites(blocks):
    assert blocks.write("once:a", b"first") is True
    assert blocks.write("once:a", b"second") is False
    assert blocks.read("once:a") == b"first"
    assert blocks.write("once:a", b"third", overwrite=True) is True
    assert blocks.read("once:a") == b"third"


def test_batches_land_in_the_callers_rows_in_order(blocks):
    keys = [f"batch:{i}" for i in range(4)]
    rows = np.arange(4 * 1024, dtype=np.uint8).reshape(4, 1024)
    assert blocks.batch_write(zip(keys, rows), parents=[None, *keys[:-1]]) == [True] * 4
    into = np.zeros_like(rows)
    assert blocks.batch_read_into(keys, list(into)) == [1024] * 4
    assert np.array_equal(into, rows)
    assert blocks.batch_read([keys[2], "batch:missing", keys[0]]) == [rows[2].tobytes(), None, rows[0].tobytes()]


def test_prefix_match_in_one_call_and_in_two_halves(blocks):
    keys = [f"chain:{i}" for i in range(5)]
    blocks.batch_write(zip(keys[:3], [b"x"] * 3), parents=[None, *keys[:2]])
    assert blocks.match_prefix(keys) == 3
    with blocks.match_sent(keys) as answer:
        assert answer() == 3
    assert blocks.match_prefix(["chain:none", *keys]) == 0


def test_a_match_whose_answer_is_not_read_leaves_the_connection_clean(blocks):
    blocks.write("clean:a", b"v")
    with blocks.match_sent(["clean:a"]):
        pass                                # answer never read: drained before the connection goes back
    assert blocks.read("clean:a") == b"v"   # the one pooled connection reads its own reply


def test_a_missing_key_is_none_and_leaves_the_buffer_alone(blocks):
    into = bytearray(b"untouched")
    assert blocks.read("missing:a") is None
    assert blocks.read_into("missing:a", into) is None
    assert into == b"untouched"
    assert blocks.batch_read_into(["missing:a", "missing:b"], [into, bytearray(4)]) == [None, None]


def test_a_buffer_too_small_names_the_sizes_and_the_connection_stays_usable(blocks):
    blocks.write("small:a", bytes(4096))
    with pytest.raises(BufferTooSmall) as caught:
        blocks.read_into("small:a", bytearray(4095))
    assert (caught.value.key, caught.value.size, caught.value.capacity) == ("small:a", 4096, 4095)
    with pytest.raises(BufferTooSmall):
        blocks.batch_read_into(["small:a"], [np.zeros(1000, dtype=np.uint8)])
    assert blocks.read_into("small:a", bytearray(4096)) == 4096


def test_buffers_that_cannot_be_written_in_place_are_refused_before_sending(blocks):
    blocks.write("shape:a", bytes(64))
    with pytest.raises(TypeError, match="writable"):
        blocks.read_into("shape:a", bytes(64))
    with pytest.raises(TypeError, match="C-contiguous"):
        blocks.read_into("shape:a", np.zeros((16, 16), dtype=np.uint8)[:, ::2])
    with pytest.raises(TypeError, match="buffer protocol"):
        blocks.read_into("shape:a", [0] * 64)
    with pytest.raises(TypeError, match="C-contiguous"):
        blocks.write("shape:b", np.zeros((16, 16), dtype=np.uint8)[:, ::2])
    assert blocks.read("shape:b") is None


def test_batches_of_unequal_lengths_are_refused(blocks):
    with pytest.raises(ValueError, match="2 keys but 1 buffers"):
        blocks.batch_read_into(["len:a", "len:b"], [bytearray(8)])
    with pytest.raises(ValueError, match="2 items but 1 parents"):
        blocks.batch_write([("len:a", b"a"), ("len:b", b"b")], parents=[None])
    assert blocks.read("len:a") is None


def test_a_node_that_is_down_raises_connection_error(tmp_path):
    node = start_kvstore(tmp_path)
    transport = RespTransport(KVClient(node.host, node.port, fast_path="off", retries=1, timeout=2.0))
    try:
        transport.write("down:a", b"v")
        node.stop()
        with pytest.raises(ConnectionError):
            transport.read_into("down:a", bytearray(8))
        with pytest.raises(ConnectionError):
            transport.batch_write([("down:b", b"v")], overwrite=True)
        with pytest.raises(ConnectionError):
            with transport.match_sent(["down:a"]) as answer:
                answer()
    finally:
        node.stop()
        transport.close()


class Recording(RespTransport):
    """A RespTransport that notes each block call (the stand-in client below answers them)."""

    calls: list[str] = []

    def read_into(self, key, buffer):
        self.calls.append("read_into")
        return super().read_into(key, buffer)

    def batch_write(self, items, **options):
        self.calls.append("batch_write")
        return super().batch_write(items, **options)


class OneNode:
    """A stand-in node client: owns every slot, stores values in a dict."""

    def __init__(self, host: str, port: int, **_):
        self.values: dict = {}

    def execute(self, command, *args):
        if command == "CLUSTER":                         # CLUSTER SLOTS: 7001 owns all
            return [[0, 16383, [b"127.0.0.1", 7001]]]
        return None                                      # KV.HOTKEYS: no hot keys

    def get_into(self, key, buffer):
        memoryview(buffer)[:len(self.values[key])] = self.values[key]
        return len(self.values[key])

    def batch_put(self, items, *, parents, overwrite, chain_links):
        self.values.update(items)
        return [True] * len(parents)

    def close(self) -> None:
        pass


def test_the_cluster_client_moves_blocks_through_the_nodes_transport(monkeypatch):
    monkeypatch.setattr("client.cluster.KVClient", OneNode)
    monkeypatch.setattr("client.cluster.RespTransport", Recording)
    Recording.calls = []
    with KVClusterClient(["127.0.0.1:7000"]) as kv:
        assert isinstance(kv._transport("127.0.0.1:7001"), BlockTransport)
        assert kv.batch_put([("k", b"value")]) == [True]
        into = bytearray(5)
        assert kv.get_into("k", into) == 5 and into == b"value"
    assert Recording.calls == ["batch_write", "read_into"]
