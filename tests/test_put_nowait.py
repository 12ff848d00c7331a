"""put_nowait / batch_put_nowait / flush against a real node: the bytes are handed over at once,
the commits are acknowledged later; read-your-writes, visibility after flush, failures at flush."""
from __future__ import annotations

import asyncio
import signal

import numpy as np
import pytest

from client import AsyncKVClient, KVClient, PutsFailed

MIB = 1 << 20


def pattern(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


@pytest.mark.parametrize("fast_path", ["required", "off"])
def test_put_nowait_reads_its_own_writes_and_others_see_it_after_flush(server, fast_path):
    values = {f"k{i}": pattern(i, MIB + i) for i in range(12)}
    small = b"x" * 100
    with KVClient(unix_socket=server.unix_socket, fast_path=fast_path) as kv, \
            KVClient(unix_socket=server.unix_socket) as other:
        for i, (key, value) in enumerate(values.items()):
            assert kv.put_nowait(key, value, parent=f"k{i - 1}" if i else None) is None
        kv.put_nowait("small", small)
        assert kv._puts.pending() > 0
        assert kv.get("k3") == values["k3"].tobytes()          # waits for its own commit
        assert kv.exists("small") == 1
        assert kv.flush() == len(values) + 1                   # every commit since the last flush
        assert kv._puts.pending() == 0
        for key, value in values.items():
            assert other.get(key) == value.tobytes()
        assert other.match_prefix(list(values)) == len(values)
        kv.batch_put_nowait({"b1": pattern(50, MIB), "b2": pattern(51, MIB)})
        assert kv.flush() == 2
        assert other.get("b2") == pattern(51, MIB).tobytes()
        kv.put_nowait("k0", pattern(99, MIB))                 # put-once: not an error, not stored
        assert kv.flush() == 1
        assert other.get("k0") == values["k0"].tobytes()
        if fast_path == "required":
            assert kv.fast_path.stats.writes >= len(values) + 3


@pytest.mark.parametrize("fast_path", ["required", "off"])
def test_a_single_put_nowait_is_read_back_at_once(server, fast_path):
    with KVClient(unix_socket=server.unix_socket, fast_path=fast_path) as kv:
        kv.put_nowait("one", pattern(7, MIB))
        assert kv._puts.pending() == 1
        into = np.empty(MIB, np.uint8)
        assert kv.get_into("one", into) == MIB and np.array_equal(into, pattern(7, MIB))
        assert kv._puts.pending() == 0
        kv.put_nowait("two", pattern(8, MIB))
        assert kv.delete("two") == 1                          # the delete comes after the commit
        assert kv.flush() == 2


@pytest.mark.parametrize("fast_path", ["auto", "off"])
def test_flush_names_the_keys_that_failed(kvstore_factory, fast_path):
    node = kvstore_factory("--dram-size", "8mb")
    with KVClient(unix_socket=node.unix_socket, fast_path=fast_path) as kv:
        kv.put_nowait("fits", pattern(1, MIB))
        kv.put_nowait("too-big", pattern(2, 16 * MIB))
        kv.put_nowait("fits-too", pattern(3, MIB))
        with pytest.raises(PutsFailed) as failed:
            kv.flush()
        assert failed.value.keys == [b"too-big"]
        assert "OOM" in str(failed.value.failures[b"too-big"]).upper()
        assert kv.flush() == 0                                 # reported once
        assert kv.get("fits") == pattern(1, MIB).tobytes()
        assert kv.get("fits-too") == pattern(3, MIB).tobytes()


def test_a_node_killed_before_the_flush_fails_the_pending_keys(kvstore_factory):
    node = kvstore_factory()
    kv = KVClient(unix_socket=node.unix_socket, retries=0)
    try:
        kv.put_nowait("a", pattern(1, MIB))
        kv.put_nowait("b", b"small")
        pending = kv._puts.pending()
        node.stop(signal.SIGKILL)
        kv.put_nowait("c", pattern(3, MIB))
        with pytest.raises(PutsFailed) as failed:
            kv.flush()
        # every key whose commit was not acknowledged before the node died is named
        assert set(failed.value.keys) >= {b"c"}
        assert len(failed.value.keys) >= 1 + (pending > 0)
    finally:
        kv._puts.close()
        kv._transport.close()


def test_async_client_put_nowait_and_flush(server):
    async def main():
        async with AsyncKVClient(unix_socket=server.unix_socket) as kv:
            for i in range(6):
                await kv.put_nowait(f"a{i}", pattern(i, MIB))
            assert await kv.get("a5") == pattern(5, MIB).tobytes()
            await kv.batch_put_nowait([("a6", b"six"), ("a7", b"seven")])
            assert await kv.flush() >= 2
            with KVClient(unix_socket=server.unix_socket) as other:
                assert other.get("a7") == b"seven"
                assert other.get("a0") == pattern(0, MIB).tobytes()

    asyncio.run(main())


def test_async_flush_reports_failures(kvstore_factory):
    node = kvstore_factory("--dram-size", "8mb")

    async def main():
        async with AsyncKVClient(unix_socket=node.unix_socket) as kv:
            await kv.put_nowait("big", pattern(1, 16 * MIB))
            with pytest.raises(PutsFailed) as failed:
                await kv.flush()
            assert failed.value.keys == [b"big"]

    asyncio.run(main())
