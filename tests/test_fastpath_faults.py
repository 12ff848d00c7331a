"""Faults on the fast path against a real `kvstore serve` process: leases that expire
mid-copy never yield torn data, and a client killed with SIGKILL while holding
leases, reservations and a half-written block leaks nothing."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np

from client import KVClient, LeaseExpired
from conftest import eventually

ROOT = str(Path(__file__).resolve().parents[1])
MIB = 1 << 20


def counters(kv: KVClient) -> dict[str, int]:
    """The node's lease counters (KV.LEASES), its DRAM in use and its connections so far."""
    reply = kv.execute("KV.LEASES")
    fields = {bytes(k).decode(): v for k, v in zip(reply[::2], reply[1::2])}
    info = kv.execute("INFO").decode()
    fields["dram_used"] = int(info.split("dram_used:")[1].split()[0])
    fields["connections"] = int(info.split("total_connections_received:")[1].split()[0])
    return fields


def test_a_lease_that_expires_mid_copy_never_returns_torn_data(server):
    """Every value is one byte repeated (its version); a torn copy would mix versions."""
    keys = [f"v{i}" for i in range(4)]
    stop = threading.Event()

    def overwrite() -> None:
        with KVClient(unix_socket=server.unix_socket, fast_path="off") as writer:
            version = 0
            while not stop.is_set():
                version += 1
                writer.put(keys[version % len(keys)], np.full(6 * MIB, version % 256, np.uint8), overwrite=True)

    with KVClient(unix_socket=server.unix_socket, fast_path="off") as setup:
        for key in keys:
            setup.put(key, np.zeros(6 * MIB, np.uint8))
    thread = threading.Thread(target=overwrite)
    thread.start()
    whole = expired = 0
    try:
        with KVClient(unix_socket=server.unix_socket, fast_path="required", lease_ttl_ms=1) as kv:
            kv.fast_path.index_reads = False            # every get leases (the shared index: test_fastpath_index.py)
            into = np.empty(6 * MIB, np.uint8)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                try:
                    size = kv.get_into(keys[whole % len(keys)], into)
                except LeaseExpired:
                    expired += 1
                    continue
                assert size == 6 * MIB
                assert (into == into[0]).all(), "a torn value was returned"
                whole += 1
            retries = kv.fast_path.stats.lease_retries
    finally:
        stop.set()
        thread.join()
    assert retries + expired > 0, "no lease ever expired: the test did not exercise expiry"
    assert whole > 0


HOLDER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from client import KVClient
    kv = KVClient(unix_socket=sys.argv[1], fast_path="required", lease_ttl_ms=600000)
    kv.batch_get(["held0", "held1", "held2"])      # the releases are deferred: the leases stay held
    token = kv.fast_path.arena().token
    kv.execute("KV.RESERVE", token, 600000, 1 << 20, 1 << 20)
    kv.put_layer("half", 0, np.zeros(4096, np.float32), n_layers=4, timeout_ms=500)
    print("ready", flush=True)
    time.sleep(60)
""")


def test_a_killed_client_leaks_no_lease_reservation_or_partial_block(server):
    with KVClient(unix_socket=server.unix_socket, fast_path="off") as kv:
        for i in range(3):
            kv.put(f"held{i}", np.full(MIB, i, np.uint8))
        kv.execute("KV.ARENA")
        baseline = counters(kv)
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, server.unix_socket], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "ready"
            held = counters(kv)
            assert held["leases_active"] == 3 and held["reservations_active"] == 2
            assert held["partial_blocks"] == 1
            assert held["dram_used"] > baseline["dram_used"]
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(10)
        finally:
            holder.kill()
        reclaimed = eventually(lambda: (lambda c: c["leases_active"] == 0 and c["reservations_active"] == 0
                                      and c["partial_blocks"] == 0
                                      and c["dram_used"] == baseline["dram_used"])(counters(kv)))
        after = counters(kv)
        assert reclaimed, f"not reclaimed: {after} (baseline {baseline})"
        assert after["leases_reclaimed"] >= 3 and after["reservations_reclaimed"] >= 2
        assert after["partial_blocks_abandoned"] == 1
        assert kv.match_prefix(["held0", "held1", "held2"]) == 3    # the values themselves stay
