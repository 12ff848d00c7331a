"""How long a node's event loop stands still while its SSD tier writes: PING latency under writes.

    python -m loadtest.loop_stalls [--seconds 4] [--repeats 3] [--value-bytes 1048576] [--quick]

Two nodes side by side, one with DRAM only and one writing every value
through to an SSD tier; on each, a client writes values as fast as it can
while another sends one PING every 2 ms. rocksdict holds the GIL for the whole
of every call into RocksDB, so anything the tier does in one call (a large
write batch, a write RocksDB delays while its flushes catch up) is time the
event loop cannot run: it shows as PING latency. Prints PING p50, p99 and the
worst per node (medians over the repeats) and the SSD node's over the
DRAM-only node's (the reference, measured in the same run, taking turns), and
the SSD node's own counts: values on SSD, stalls waited out, write errors
(any error exits 1: a write that failed is a write the latency did not pay for).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import redis

from loadtest.procs import HOST, ProcessGroup, start_server
from loadtest.report import describe_machine, machine_info

PING_EVERY_S = 0.002
WARM_UP_S = 0.5          # the writer's first SETs reach the node before PINGs are timed


def ping_latencies(port: int, value: bytes, seconds: float) -> list[float]:
    """PING round trips (ms) while another client SETs ``value`` under 1,500 keys in turn."""
    stop = threading.Event()

    def write() -> None:
        writer, n = redis.Redis(HOST, port, socket_timeout=60), 0
        while not stop.is_set():
            writer.set(b"k%d" % (n % 1500), value)
            n += 1
    thread = threading.Thread(target=write)
    thread.start()
    pinger, latencies = redis.Redis(HOST, port, socket_timeout=60), []
    time.sleep(WARM_UP_S)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        pinger.ping()
        latencies.append((time.perf_counter() - started) * 1e3)
        time.sleep(PING_EVERY_S)
    stop.set()
    thread.join()
    return latencies


def one_round(group: ProcessGroup, root: str, ssd: bool, value: bytes, seconds: float) -> dict[str, float]:
    flags = ["--ssd-dir", tempfile.mkdtemp(dir=root), "--ssd-write-policy", "write-through"] if ssd else []
    node = start_server(group, "kvstore-ssd" if ssd else "kvstore", lambda port: [
        sys.executable, "-m", "kvstore", "serve", "--port", str(port), "--dram-size", "2gb", *flags])
    try:
        latencies = sorted(ping_latencies(node.port, value, seconds))
        ssd_info = redis.Redis(HOST, node.port, socket_timeout=60).info("ssd")
        if ssd_info.get("ssd_errors"):
            print(node.process.log_tail())
    finally:
        group.stop(node.process)
    return {"p50": latencies[len(latencies) // 2], "p99": latencies[int(len(latencies) * 0.99)],
            "max": latencies[-1], "stalls": ssd_info.get("ssd_write_stalls", 0),
            "errors": ssd_info.get("ssd_errors", 0), "records": ssd_info.get("ssd_records", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--value-bytes", type=int, default=1 << 20)
    parser.add_argument("--quick", action="store_true", help="one repeat of 2 seconds")
    args = parser.parse_args()
    repeats, seconds = (1, 2.0) if args.quick else (args.repeats, args.seconds)
    print(describe_machine(machine_info()))
    value, runs = os.urandom(args.value_bytes), {False: [], True: []}
    with ProcessGroup() as group, tempfile.TemporaryDirectory(prefix="loop-stalls-") as root:
        for repeat in range(repeats):
            for ssd in ((False, True) if repeat % 2 == 0 else (True, False)):
                runs[ssd].append(one_round(group, root, ssd, value, seconds))
    print(f"PING every {PING_EVERY_S * 1e3:.0f} ms while a client SETs {args.value_bytes}-byte values, "
          f"ms (medians of {repeats})")
    for stat in ("p50", "p99", "max"):
        dram, ssd = (statistics.median(run[stat] for run in runs[kind]) for kind in (False, True))
        print(f"  {stat:4s} DRAM only {dram:7.2f}   SSD written through {ssd:7.2f}   ratio {ssd / dram:5.2f}")
    print("SSD node per repeat: values on SSD at the end, write stalls waited out, write errors (must be 0): "
          + ", ".join(f"{run['records']} / {run['stalls']} / {run['errors']}" for run in runs[True]))
    if any(run["errors"] for run in runs[True]):
        sys.exit(1)


if __name__ == "__main__":
    main()
