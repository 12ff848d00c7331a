"""First gets served from the node's shared index, against real `kvstore serve` processes.

A reader that holds no lease finds a DRAM value in the index and copies it with no round
trip. Each test here changes the value *during* that copy (the change is made, and
acknowledged by the node, inside the reader's copy, before the check that follows it):
overwritten in place and elsewhere, rewritten by SETRANGE, renamed, deleted, flushed,
expired, evicted, demoted to SSD, and the node restarted (stopped, or killed with
SIGKILL). The get must give the node's answer after the change, never the copied bytes.
Then: many copies racing a writer never return a torn or stale value; reads from the
index count as hits on the node; the async client and a TCP client use the index too; a
client killed while reading from it leaves the node nothing to reclaim.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from client import AsyncKVClient, KVClient, LeaseExpired
from conftest import eventually, wait_until
from test_fastpath_faults import ROOT, counters

MIB = 1 << 20


def version(n: int, size: int = MIB) -> np.ndarray:
    """A value whose every 8-byte word is its version: a torn copy mixes versions."""
    return np.full(size // 8, n, np.uint64).view(np.uint8)


def read_version(kv: KVClient, key: str, size: int = MIB) -> int | None:
    into = np.empty(size, np.uint8)
    got = kv.get_into(key, into)
    if got is None:
        return None
    words = into[:got].view(np.uint64)
    assert (words == words[0]).all(), "a torn value was returned"
    return int(words[0])


def during_the_copy(kv: KVClient, change) -> list[int]:
    """Run ``change()`` inside ``kv``'s next copy out of the arena, before it copies: the
    copy then reads bytes that may already be gone. Returns how many times it ran."""
    arena = kv.fast_path.arena()
    copy, ran = arena.read_into, []

    def hooked(offset: int, size: int, dest) -> None:
        if not ran:
            ran.append(1)
            change()
        copy(offset, size, dest)
    arena.read_into = hooked
    return ran


@pytest.fixture
def pair(server):
    """A reader on the fast path and a writer on the wire, the index published."""
    with KVClient(unix_socket=server.unix_socket, fast_path="required") as reader, \
            KVClient(unix_socket=server.unix_socket, fast_path="off") as writer:
        reader.fast_path.arena()                 # the first mapping: the node publishes from now on
        yield reader, writer


def commands_processed(kv: KVClient) -> int:
    info = kv.execute("INFO", "stats").decode()
    return int(info.split("total_commands_processed:")[1].split()[0])


def test_a_first_get_needs_no_round_trip(pair):
    reader, writer = pair
    writer.put("k", version(1))
    before = commands_processed(writer)
    assert read_version(reader, "k") == 1
    assert commands_processed(writer) == before + 1          # the INFO itself, nothing for the read
    stats = reader.fast_path.stats
    assert stats.index_reads == 1 and stats.cached_reads == 0 and stats.wire_calls == 0
    assert counters(writer)["leases_granted"] == 0


SMALL = 16 * 1024                # under the node's big-bulk size: received on the heap, so a
                                 # same-size overwrite rewrites the old extent in place

CHANGES = {
    "overwritten in place": (SMALL, lambda w: w.put("k", version(2, SMALL), overwrite=True), 2),
    "overwritten elsewhere": (MIB, lambda w: w.put("k", version(3, 2 * MIB), overwrite=True), 3),
    "rewritten by SETRANGE": (SMALL, lambda w: w.execute("SETRANGE", "k", 0, version(4, SMALL).tobytes()), 4),
    "renamed": (MIB, lambda w: w.execute("RENAME", "k", "k2"), None),
    "deleted": (MIB, lambda w: w.delete("k"), None),
    "flushed": (MIB, lambda w: w.execute("FLUSHALL"), None),
    "expired": (MIB, lambda w: (w.execute("PEXPIRE", "k", 1), eventually(lambda: w.exists("k") == 0)), None),
    "given an expiry": (MIB, lambda w: w.execute("PEXPIRE", "k", 60_000), 1),
}


@pytest.mark.parametrize("case", list(CHANGES))
def test_a_value_changed_during_the_copy_is_never_returned(pair, case):
    reader, writer = pair
    size, change, expected = CHANGES[case]
    writer.put("k", version(1, size))
    ran = during_the_copy(reader, lambda: change(writer))
    assert read_version(reader, "k", 2 * MIB) == expected
    assert ran and reader.fast_path.stats.index_races == 1


def test_a_value_evicted_during_the_copy_is_never_returned(kvstore_factory):
    daemon = kvstore_factory("--dram-size", "16mb")
    with KVClient(unix_socket=daemon.unix_socket, fast_path="required") as reader, \
            KVClient(unix_socket=daemon.unix_socket, fast_path="off") as writer:
        reader.fast_path.arena()
        writer.put("k", version(1))

        def evict() -> None:
            for n in range(24):                                  # 24 MiB through a 16 MiB arena
                writer.put(f"fill{n}", version(100 + n), overwrite=True)
            assert writer.exists("k") == 0
        ran = during_the_copy(reader, evict)
        assert read_version(reader, "k") is None
        assert ran and reader.fast_path.stats.index_races == 1


def test_a_value_demoted_during_the_copy_is_read_from_its_new_tier(kvstore_factory, tmp_path):
    daemon = kvstore_factory("--dram-size", "16mb", "--ssd-dir", str(tmp_path / "ssd"))
    with KVClient(unix_socket=daemon.unix_socket, fast_path="required") as reader, \
            KVClient(unix_socket=daemon.unix_socket, fast_path="off") as writer:
        reader.fast_path.arena()
        writer.put("k", version(1))

        def demote() -> None:
            for n in range(24):
                writer.put(f"fill{n}", version(100 + n), overwrite=True)
            wait_until(lambda: writer.locate(["k"])[0].tier == "ssd", what="k to reach SSD")
        ran = during_the_copy(reader, demote)
        assert read_version(reader, "k") == 1                   # the same value, read from SSD
        assert ran and reader.fast_path.stats.index_races == 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_node_restarted_during_the_copy_gives_the_new_nodes_answer(kvstore_factory, sig):
    daemons = [kvstore_factory()]
    with KVClient(unix_socket=daemons[0].unix_socket, fast_path="required") as reader:
        reader.fast_path.arena()
        with KVClient(unix_socket=daemons[0].unix_socket, fast_path="off") as writer:
            writer.put("k", version(1))
            writer.put("gone", version(1))

        def restart_node() -> None:
            daemons.append(kvstore_factory.restart(daemons[0], sig))
            with KVClient(unix_socket=daemons[-1].unix_socket, fast_path="off") as fresh:
                fresh.put("k", version(2))
        ran = during_the_copy(reader, restart_node)
        assert read_version(reader, "k") == 2
        assert read_version(reader, "gone") is None
        assert ran and reader.fast_path.stats.remaps == 1


def test_copies_racing_a_writer_are_whole_and_never_older_than_acknowledged(server):
    """The writer overwrites (in place and elsewhere) and deletes; ``acked`` is the last
    version the node acknowledged before a read started: the read returns it or a later one.
    A read whose every lease the writer ended during the copy raises LeaseExpired, as the SDK
    documents (a writer this fast can outrun a copy on a loaded host): never a value, and
    most reads still get one."""
    keys, acked, stop = ["r0", "r1"], {"r0": 0, "r1": 0}, threading.Event()

    def write() -> None:
        with KVClient(unix_socket=server.unix_socket, fast_path="off") as writer:
            n = 0
            while not stop.is_set():
                n += 1
                key = keys[n % 2]
                if n % 7 == 0:
                    writer.delete(key)
                else:
                    writer.put(key, version(n, MIB if n % 3 else 2 * MIB), overwrite=True)
                acked[key] = n
    with KVClient(unix_socket=server.unix_socket, fast_path="required") as reader:
        reader.fast_path.arena()
        thread = threading.Thread(target=write)
        thread.start()
        try:
            # A loaded host may start the writer late: 400 reads of keys not yet written would never
            # reach the index.
            wait_until(lambda: acked["r0"] or acked["r1"], what="the writer's first write")
            reads = outrun = 0
            while reads < 400:
                key = keys[reads % 2]
                floor = acked[key]
                try:
                    got = read_version(reader, key, 2 * MIB)
                except LeaseExpired:
                    outrun += 1
                else:
                    assert got is None or got >= floor, (key, got, floor)
                reads += 1
        finally:
            stop.set()
            thread.join()
        stats = reader.fast_path.stats
        # Most reads get a value (the docstring's promise): how many the writer outruns depends on
        # how the two threads share a loaded host's cores, not on any configured timeout.
        assert stats.index_reads > 0 and outrun < reads // 2, (stats, outrun)


def test_reads_from_the_index_count_as_hits(pair):
    reader, writer = pair
    writer.put("k", version(1))
    before = writer.stats()["hits"]
    for _ in range(3):
        assert read_version(reader, "k") == 1
    assert reader.fast_path.stats.index_reads == 3
    assert reader.stats()["hits"] == before + 3             # reported ahead of the next request
    for _ in range(300):                                    # a full batch goes on its own
        read_version(reader, "k")
    assert writer.stats()["hits"] >= before + 3 + 256


def test_the_async_client_and_a_tcp_client_read_from_the_index(server):
    with KVClient(unix_socket=server.unix_socket, fast_path="off") as writer:
        writer.execute("KV.ARENA")
        writer.put("k", version(5))
        writer.put("small", b"tiny")
    with KVClient(server.host, server.port, fast_path="required") as tcp:
        assert read_version(tcp, "k") == 5 and tcp.get("small") == b"tiny"
        assert tcp.fast_path.stats.index_reads == 2

    async def scenario() -> None:
        async with AsyncKVClient(unix_socket=server.unix_socket, fast_path="required") as kv:
            got = await kv.batch_get(["k", "small", "absent"])
            assert np.array_equal(np.frombuffer(got[0], np.uint8), version(5))
            assert got[1:] == [b"tiny", None]
            assert kv.fast_path.stats.index_reads == 2
    asyncio.run(scenario())


READER = """
import sys
import numpy as np
from client import KVClient
kv = KVClient(unix_socket=sys.argv[1], fast_path="required")
into = np.empty(1 << 20, np.uint8)
kv.get_into("k", into)
print(kv.fast_path.stats.index_reads, flush=True)
while True:
    kv.get_into("k", into)
"""


def test_a_client_killed_while_reading_from_the_index_leaks_nothing(pair, server):
    reader, writer = pair
    writer.put("k", version(1))
    baseline = counters(writer)
    child = subprocess.Popen([sys.executable, "-c", READER, server.unix_socket], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert int(child.stdout.readline()) == 1
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        child.kill()
    after = counters(writer)
    assert (after["leases_active"], after["reservations_active"], after["dram_used"]) == \
        (0, 0, baseline["dram_used"])
    assert read_version(reader, "k") == 1                    # the index is intact for everyone else
