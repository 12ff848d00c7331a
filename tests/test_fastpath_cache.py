"""Cached leases and spare reservations against real `kvstore serve` processes: a value
another client changed (overwrite, delete, flush, expiry, eviction pressure, an SSD
tier that demotes) is never returned from a held lease once the change is
acknowledged, under a tiny lease TTL too; spares are reused by later puts and a
killed client's spares and held leases are reclaimed. The readers here read without
the shared index (tests/test_fastpath_index.py covers it), so every first get leases."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from client import KVClient
from conftest import eventually
from test_fastpath_faults import ROOT, counters

MIB = 1 << 20


def version(n: int, size: int = MIB) -> np.ndarray:
    return np.full(size, n % 251, np.uint8)


def leasing(kv: KVClient) -> KVClient:
    """``kv`` reading without the shared index: a get of a key it holds no lease on leases it."""
    kv.fast_path.index_reads = False
    return kv


def read_version(kv: KVClient, key: str, size: int = MIB) -> int | None:
    """The version a get returns (every byte must agree: a torn value fails here)."""
    into = np.empty(size, np.uint8)
    if kv.get_into(key, into) is None:
        return None
    assert (into == into[0]).all(), "a torn value was returned"
    return int(into[0])


@pytest.mark.parametrize("lease_ttl_ms", [5000, 2])
def test_a_held_lease_never_returns_a_value_another_client_changed(server, lease_ttl_ms):
    with leasing(KVClient(unix_socket=server.unix_socket, fast_path="required", lease_ttl_ms=lease_ttl_ms)) \
            as reader, KVClient(unix_socket=server.unix_socket, fast_path="off") as writer:
        for n in range(1, 40):
            writer.put("k", version(n), overwrite=True)           # acknowledged before the reads
            assert read_version(reader, "k") == n % 251
            assert read_version(reader, "k") == n % 251           # the second read may use the held lease
            if n % 10 == 0:
                writer.delete("k")
                assert read_version(reader, "k") is None
        writer.put("k", version(7), overwrite=True)
        assert read_version(reader, "k") == 7
        writer.execute("FLUSHALL")
        assert read_version(reader, "k") is None
        stats = reader.fast_path.stats
        if lease_ttl_ms == 5000:
            assert stats.cached_reads >= 39, stats                 # the repeated reads were served locally


def test_repeated_gets_hold_the_lease_until_it_is_given_up(server):
    with leasing(KVClient(unix_socket=server.unix_socket, fast_path="required")) as kv:
        kv.put("k", version(3))
        for _ in range(5):
            assert read_version(kv, "k") == 3
        assert kv.fast_path.stats.cached_reads == 4
        held = counters(kv)
        assert held["leases_active"] == 1 and held["lease_words_in_use"] == 1
    with KVClient(unix_socket=server.unix_socket, fast_path="off") as other:
        assert eventually(lambda: counters(other)["leases_active"] == 0)   # closing released it
        assert counters(other)["lease_words_in_use"] == 0


def test_a_key_with_an_expiry_is_never_read_past_it_from_a_held_lease(server):
    with leasing(KVClient(unix_socket=server.unix_socket, fast_path="required")) as kv:
        kv.put("k", version(4))
        kv.execute("PEXPIRE", "k", 2000)                       # room for both reads on a busy host
        expires = time.monotonic() + 2.0                       # no earlier than the server's deadline
        assert read_version(kv, "k") == 4
        assert read_version(kv, "k") == 4
        time.sleep(max(0.0, expires - time.monotonic()) + 0.1)
        assert read_version(kv, "k") is None


def test_eviction_pressure_leaves_held_values_whole_and_current(kvstore_factory):
    daemon = kvstore_factory("--dram-size", "16mb")
    with leasing(KVClient(unix_socket=daemon.unix_socket, fast_path="required")) as reader, \
            KVClient(unix_socket=daemon.unix_socket, fast_path="off") as writer:
        writer.put("held", version(9))
        assert read_version(reader, "held") == 9
        for n in range(40):                                    # 40 MiB through a 16 MiB arena
            writer.put(f"fill{n}", version(n), overwrite=True)
        on_node = writer.get("held")
        got = read_version(reader, "held")
        assert got == (None if on_node is None else on_node[0])


def test_values_demoted_to_ssd_read_back_current_through_held_leases(kvstore_factory, tmp_path):
    daemon = kvstore_factory("--dram-size", "16mb", "--ssd-dir", str(tmp_path / "ssd"))
    with leasing(KVClient(unix_socket=daemon.unix_socket, fast_path="required", lease_ttl_ms=20)) as reader, \
            KVClient(unix_socket=daemon.unix_socket, fast_path="off") as writer:
        for n in range(40):
            writer.put(f"v{n}", version(n), overwrite=True)
            assert read_version(reader, f"v{n}") == n % 251
        for n in range(40):                                   # the early ones went to SSD and come back
            assert read_version(reader, f"v{n}") == n % 251
            writer.put(f"v{n}", version(n + 100), overwrite=True)
            assert read_version(reader, f"v{n}") == (n + 100) % 251


def test_puts_reuse_spares_reserved_by_the_previous_put(server):
    with KVClient(unix_socket=server.unix_socket, fast_path="required") as kv:
        for n in range(6):
            assert kv.put(f"p{n}", version(n)) is True
        assert kv.fast_path.stats.pooled_writes == 5
        assert counters(kv)["reservations_active"] == len(kv.fast_path.spares) > 0
        for n in range(6):
            assert read_version(kv, f"p{n}") == n
        assert kv.put("p0", version(50)) is False                 # put-once through a spare too


HOLDER = """
import sys, time
import numpy as np
from client import KVClient
kv = KVClient(unix_socket=sys.argv[1], fast_path="required")
kv.fast_path.index_reads = False                # a get leases (and holds the lease)
for n in range(3):
    kv.put(f"spare{n}", np.full(1 << 20, n, np.uint8))
kv.get("spare0"); kv.get("spare0")
print(len(kv.fast_path.spares), flush=True)
time.sleep(60)
"""


def test_a_killed_client_leaks_no_spare_or_held_lease(server):
    with KVClient(unix_socket=server.unix_socket, fast_path="off") as kv:
        kv.execute("KV.ARENA")
        baseline = counters(kv)
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, server.unix_socket], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True)
        try:
            spares = int(holder.stdout.readline())
            held = counters(kv)
            assert spares > 0 and held["reservations_active"] == spares and held["leases_active"] == 1
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(10)
        finally:
            holder.kill()
        reclaimed = eventually(lambda: (lambda c: c["leases_active"] == 0 and c["reservations_active"] == 0
                                      and c["lease_words_in_use"] == 0)(counters(kv)))
        after = counters(kv)
        assert reclaimed, f"not reclaimed: {after}"
        assert after["reservations_reclaimed"] - baseline["reservations_reclaimed"] == spares
        assert after["dram_used"] - baseline["dram_used"] == 3 * MIB    # the three values, nothing more
