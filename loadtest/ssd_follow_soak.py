"""Local reads of SSD values under churn: nothing wrong, torn or stale is ever returned.

    python -m loadtest.ssd_follow_soak [--seconds 60] [--keys 64] [--readers 4] [--quick]

One node with a small DRAM arena over an SSD tier (write-back: values reach
SSD when newer writes push them down). A writer overwrites and deletes a set
of keys with versioned values (every value's first 8 bytes are its version,
the rest derived from key and version) and notes each version once the node
acknowledged it; filler writes keep DRAM under pressure, so each new version
is demoted in turn. Readers on several threads, one SDK client each, read
random keys with `get_into`: values still in DRAM from the arena, values on
SSD alone from the node's RocksDB files (client/ssd_reads.py), the rest
through the node. Each read must be a whole version of its key, and no older
than the version acknowledged before the read began (a deleted key may read
as absent).

Prints the reads by where they were served and the failures of each kind;
exits 1 on any failure. Not part of the test suite (it runs for a minute);
tests/test_fastpath_ssd.py has the short version.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import redis

from client import KVClient, LeaseExpired
from loadtest.procs import HOST, ProcessGroup, start_server
from loadtest.report import describe_machine, machine_info

VALUE_BYTES = 256 * 1024


@dataclass
class Tally:
    reads: int = 0
    absent: int = 0
    outrun: int = 0          # LeaseExpired: a writer ended every lease during the copies (no value)
    ssd_here: int = 0
    torn: list = field(default_factory=list)
    stale: list = field(default_factory=list)


def versioned(key: int, version: int) -> bytes:
    """Version ``version`` of key number ``key``: its version, then bytes only it has."""
    return version.to_bytes(8, "little") + np.random.default_rng(key * 1_000_003 + version).bytes(VALUE_BYTES - 8)


def write(r: redis.Redis, keys: int, acked: list[int], stop: threading.Event) -> None:
    """Overwrite (and now and then delete) random keys, noting each acknowledged version."""
    rng, version, filler = random.Random(1), 0, 0
    while not stop.is_set():
        version += 1
        n = rng.randrange(keys)
        if version % 11 == 0:
            r.delete(b"key%d" % n)
        else:
            r.set(b"key%d" % n, versioned(n, version))
        acked[n] = version
        filler += 1
        r.set(b"filler%d" % (filler % 256), versioned(10**6, filler))     # keeps DRAM under pressure


def read(sock: str, keys: int, acked: list[int], stop: threading.Event, tally: Tally, seed: int) -> None:
    rng, buffer = random.Random(seed), bytearray(VALUE_BYTES)
    with KVClient(unix_socket=sock, fast_path="required", timeout=30) as kv:
        while not stop.is_set():
            n = rng.randrange(keys)
            floor = acked[n]
            try:
                got = kv.get_into(b"key%d" % n, buffer)
            except LeaseExpired:
                tally.outrun += 1
                continue
            tally.reads += 1
            if got is None:
                tally.absent += 1
                continue
            version = int.from_bytes(buffer[:8], "little")
            if buffer != versioned(n, version):
                tally.torn.append((n, version))
            elif version < floor:
                tally.stale.append((n, version, floor))
        tally.ssd_here += kv.fast_path.stats.ssd_reads


def soak(seconds: float, keys: int, readers: int) -> Tally:
    with ProcessGroup() as group, tempfile.TemporaryDirectory(prefix="ssd-soak-") as root:
        sock = f"{root}/node.sock"
        node = start_server(group, "kvstore-ssd", lambda port: [
            sys.executable, "-m", "kvstore", "serve", "--port", str(port), "--unixsocket", sock,
            "--dram-size", "16mb", "--ssd-dir", f"{root}/ssd", "--promote-hits", "1000000"])
        r = redis.Redis(HOST, node.port, socket_timeout=30)
        for n in range(keys):
            r.set(b"key%d" % n, versioned(n, 0))
        acked, stop, tally = [0] * keys, threading.Event(), Tally()
        threads = [threading.Thread(target=write, args=(r, keys, acked, stop))]
        threads += [threading.Thread(target=read, args=(sock, keys, acked, stop, tally, seed))
                    for seed in range(readers)]
        for thread in threads:
            thread.start()
        time.sleep(seconds)
        stop.set()
        for thread in threads:
            thread.join()
        return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="10 seconds")
    args = parser.parse_args()
    print(describe_machine(machine_info()))
    tally = soak(10.0 if args.quick else args.seconds, args.keys, args.readers)
    print(f"reads {tally.reads}: {tally.ssd_here} read here from SSD, {tally.absent} absent (deleted), "
          f"{tally.outrun} outrun by the writer (LeaseExpired, no value)")
    print(f"torn {len(tally.torn)}, stale {len(tally.stale)} (must both be 0)")
    for failure in (tally.torn + tally.stale)[:10]:
        print("  ", failure)
    sys.exit(1 if tally.torn or tally.stale else 0)


if __name__ == "__main__":
    main()
