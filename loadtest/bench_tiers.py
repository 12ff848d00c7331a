"""The tiers' figures of issue 3, each next to its reference measured in the same run.

    python -m loadtest.bench_tiers [--quick] [--dir DIR] [--repeats N] [--trace FILE]
                                   [--markdown] [--json FILE]

Tables (medians of ``--repeats`` runs; the subject and its reference take
turns within each repeat, their order alternating, so load from other
processes on this shared host falls on both):

1. SSD tier through the daemon vs raw rocksdict on the same disk, 256 KiB and
   1 MiB values, through redis-py (TCP) and through the SDK (Unix socket and
   the shared arena). Writes: a write-through node takes puts (8 in flight)
   until every value is a record on SSD (receive + arena + RocksDB), against
   ``Rdict`` puts of the same values with the WAL on and block compression
   off. Reads: the node is restarted so every value is on SSD only, and gets
   (8 in flight, promotion off) read each once in random order, against
   ``Rdict`` gets in the same order after a reopen. Target: ratio >= 0.8.
   Beside each, bytes per CPU-second (node and client together).
2. GET latency of 1 MiB values that hit SSD and are promoted (``--promote-hits
   1``), next to the same GETs once the values are in DRAM: p50 per repeat.
   Then (``wire-get``) redis-py GETs of 1 MiB values on SSD alone (promotion off), once
   after a restart and twice more (read on the loop from the page cache), each followed
   by a GET of a value in DRAM on the same node. Target: ratio >= 0.8.
3. DRAM-hit GETs on a node with an SSD tier vs one without (same arena size,
   every value in DRAM): 1 MiB GB/s and 4 KiB ops/s. Target: ratio >= 0.95.
4. Warm restart with 100,000 values on SSD: values per second the daemon
   reports in its log, and from its start to the index loaded, against
   ``SSDTier.open`` + ``scan_index`` in this process; PING latency while the
   index loads.
5. DRAM hit ratio with the working set at 4x DRAM on a trace-like read
   pattern (Mooncake trace hash_ids), by replay through the store's eviction
   policy as a library (see loadtest/hit_ratio.py): kvstore vs exact LRU vs
   the offline optimum (Belady). Target: kvstore >= 0.9 of Belady.

Tables 2 and 3 send values over a bare RESP socket (`RawClient`), not redis-py, so
the client's own copies do not cap what the daemon is measured at.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import redis

from client import KVClient
from kvstore.tiers.ssd import SSDTier
from loadtest import hit_ratio
from loadtest.bench_ssd_raw import RAW, Store, timed, value_pool
from loadtest.procs import HOST, ProcessGroup, Server, free_port, wait_for_ping
from loadtest.report import Table, Target, machine_info

KIB, MIB, GB = 1 << 10, 1 << 20, 1e9
DAEMON = "kvstore"
TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "conversation_trace.jsonl"
RECOVERED = re.compile(rb"Recovered (\d+) values from the SSD tier in ([\d.]+) s")


@dataclass(frozen=True)
class Settings:
    repeats: int = 3
    sizes: tuple[int, ...] = (256 * KIB, MIB)
    bytes_per_run: int = 256 * MIB
    in_flight: int = 8
    latency_values: int = 48
    dram_hit_bytes: int = 256 * MIB
    small_gets: int = 20_000
    restart_values: int = 100_000
    restart_value_size: int = 4 * KIB
    trace_requests: int | None = None        # None: the whole trace
    dram_fractions: tuple[int, ...] = (4, 2, 8)

    def quick(self) -> Settings:
        return replace(self, repeats=1, bytes_per_run=16 * MIB, latency_values=6, dram_hit_bytes=16 * MIB,
                       small_gets=2000, restart_values=5000, trace_requests=400, dram_fractions=(4,))


# ------------------------------------------------------------------ a bare RESP client


class RawClient:
    """Pipelined SET and GET of known-size values over one socket, with no copies of values."""

    def __init__(self, port: int, timeout: float = 60.0):
        self.sock = socket.create_connection((HOST, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray(4 * MIB)

    def close(self) -> None:
        self.sock.close()

    def set_many(self, keys: list[bytes], values: list[bytes], in_flight: int) -> None:
        """SET ``values[i % len(values)]`` under ``keys[i]``, ``in_flight`` at a time."""
        for first in range(0, len(keys), in_flight):
            batch = keys[first:first + in_flight]
            for i, key in enumerate(batch, first):
                value = values[i % len(values)]
                head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(value))
                self.sock.sendmsg([head, value, b"\r\n"])
            self._expect(b"+OK\r\n" * len(batch))

    def get_many(self, keys: list[bytes], size: int, in_flight: int) -> memoryview:
        """GET each key (every value ``size`` bytes), ``in_flight`` at a time; the last value."""
        head = b"$%d\r\n" % size
        reply = len(head) + size + 2
        if len(self._buf) < reply:
            self._buf = bytearray(reply)
        view = memoryview(self._buf)
        for first in range(0, len(keys), in_flight):
            batch = keys[first:first + in_flight]
            self.sock.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in batch))
            for _ in batch:
                self._read_exactly(view[:reply])
                if view[:len(head)] != head:
                    raise RuntimeError(f"unexpected reply {bytes(view[:40])!r}")
        return view[len(head):len(head) + size]

    def command(self, *args: bytes) -> bytes:
        """One command; its reply's first chunk (enough for PING and small INFO sections)."""
        self.sock.sendall(b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args))
        return self.sock.recv(65536)

    def _expect(self, reply: bytes) -> None:
        view = memoryview(self._buf)[:len(reply)]
        self._read_exactly(view)
        if view != reply:
            raise RuntimeError(f"unexpected reply {bytes(view[:60])!r}")

    def _read_exactly(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("the server closed the connection")
            got += n


def info_field(port: int, section: bytes, name: bytes) -> int:
    client = RawClient(port, timeout=10)
    try:
        text = client.command(b"INFO", section)
    finally:
        client.close()
    return int(re.search(rb"\r\n" + name + rb":(\d+)", text).group(1))


# ------------------------------------------------------------------ nodes


def start_node(group: ProcessGroup, name: str, *flags: str) -> Server:
    port = free_port()
    process = group.start(name, [sys.executable, "-m", "kvstore", "serve", "--port", str(port), *flags])
    wait_for_ping(HOST, port, process)
    return Server(name, HOST, port, process)


def restart_node(group: ProcessGroup, node: Server) -> Server:
    """Stop ``node`` cleanly and start the same command line on the same port."""
    argv = node.process.popen.args
    group.stop(node.process)
    process = group.start(node.name, argv)
    wait_for_ping(HOST, node.port, process)
    wait_for(lambda: info_field(node.port, b"ssd", b"ssd_loading") == 0, 120)
    return Server(node.name, HOST, node.port, process)


def wait_for(predicate, timeout: float, poll: float = 0.005) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the node did not get there in time")
        time.sleep(poll)


def mb_flag(nbytes: int) -> str:
    return f"{max(nbytes // MIB, 8)}mb"


def label(size: int) -> str:
    return f"{size // KIB} KiB" if size < MIB else f"{size // MIB} MiB"


# ------------------------------------------------------------------ 1. SSD throughput


CLIENTS = ("redis-py", "SDK")


def ssd_keys(size: int, settings: Settings) -> list[bytes]:
    return [b"%016d" % i for i in range(max(settings.bytes_per_run // size, settings.in_flight))]


def daemon_cpu_s(pid: int) -> float:
    """CPU seconds of every thread of process ``pid`` so far (/proc/PID/task/*/schedstat)."""
    total = 0
    for path in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(path.read_text().split()[0])
        except (OSError, IndexError, ValueError):     # a thread that ended meanwhile
            pass
    return total / 1e9


class SSDClient:
    """One way a client puts and reads values through the node: redis-py (over TCP, ``in_flight``
    commands in a pipeline) or the SDK (over the Unix socket with the fast path, ``in_flight``
    keys per batch_put / batch_get_into)."""

    def __init__(self, kind: str, node: Server, unix_socket: str, size: int):
        self.kind = kind
        self.size = size
        self.buffers = [bytearray(size)]
        if kind == "redis-py":
            self.client = redis.Redis(host=HOST, port=node.port, socket_timeout=120)
            self.client.exists(b"warm-up")        # connect before the clock runs
        else:
            self.client = KVClient(unix_socket=unix_socket, fast_path="required", timeout=120)
            self.client.get_into(b"warm-up", self.buffers[0])   # connect and map the arena (all of it at once)

    def ready_to_read(self, key: bytes) -> None:
        """Read one value before the clock runs: the SDK opens its reader of the node's SSD
        files at its first value from SSD (a once-per-process cost, like mapping the arena)."""
        if self.kind == "SDK":
            self.client.get_into(key, self.buffers[0])

    def put(self, keys: list[bytes], pool: list[bytes], in_flight: int) -> None:
        for first in range(0, len(keys), in_flight):
            batch = [(key, pool[int(key) % len(pool)]) for key in keys[first:first + in_flight]]
            if self.kind == "redis-py":
                pipe = self.client.pipeline(transaction=False)
                for key, value in batch:
                    pipe.set(key, value)
                pipe.execute()
            else:
                self.client.batch_put(batch)

    def get(self, keys: list[bytes], in_flight: int) -> bytes:
        """Read every key, ``in_flight`` at a time; the last value."""
        for first in range(0, len(keys), in_flight):
            batch = keys[first:first + in_flight]
            if self.kind == "redis-py":
                pipe = self.client.pipeline(transaction=False)
                for key in batch:
                    pipe.get(key)
                last = pipe.execute()[-1]
            else:
                self.buffers += [bytearray(self.size) for _ in range(in_flight - len(self.buffers))]
                self.client.batch_get_into(batch, self.buffers[:len(batch)])
                last = self.buffers[len(batch) - 1]
        return bytes(last)

    def close(self) -> None:
        self.client.close()


def daemon_ssd_round(group: ProcessGroup, root: str, size: int, kind: str,
                     settings: Settings) -> dict[str, float]:
    """Through one node and one client: GB/s of puts until all land on SSD, then of gets
    that all read SSD (after a restart); and GB per CPU-second of node and client together."""
    pool, keys = value_pool(size), ssd_keys(size, settings)
    path = tempfile.mkdtemp(prefix="bench-tiers-", dir=root)
    sock = path + ".sock"
    node = start_node(group, "kvstore-ssd", "--dram-size", mb_flag(2 * len(keys) * size), "--ssd-dir", path,
                      "--unixsocket", sock, "--ssd-write-policy", "write-through",
                      "--promote-hits", "1000000000")
    try:
        client = SSDClient(kind, node, sock, size)
        put_s, put_cpu = timed_with_cpu(node, lambda: (
            client.put(keys, pool, settings.in_flight),
            wait_for(lambda: info_field(node.port, b"ssd", b"ssd_records") == len(keys), 300)))
        client.close()
        node = restart_node(group, node)
        client = SSDClient(kind, node, sock, size)
        order = random.Random(size).sample(keys, len(keys))
        client.ready_to_read(order[0])
        last = []
        get_s, get_cpu = timed_with_cpu(node, lambda: last.append(client.get(order, settings.in_flight)))
        if last[0] != pool[int(order[-1]) % len(pool)]:
            raise RuntimeError("the node returned a wrong value")
        client.close()
    finally:
        group.stop(node.process)
        shutil.rmtree(path, ignore_errors=True)
        Path(sock).unlink(missing_ok=True)
    moved = len(keys) * size / GB
    return {"put": moved / put_s, "get": moved / get_s, "get cpu": moved / get_cpu, "put cpu": moved / put_cpu}


def timed_with_cpu(node: Server | None, action) -> tuple[float, float]:
    """Wall seconds of ``action`` and CPU seconds spent on it by this process and ``node``'s."""
    pid = node.process.popen.pid if node is not None else None
    cpu = time.process_time() + (daemon_cpu_s(pid) if pid else 0.0)
    start = time.perf_counter()
    action()
    wall = time.perf_counter() - start
    return wall, time.process_time() + (daemon_cpu_s(pid) if pid else 0.0) - cpu


def raw_ssd_round(root: str, size: int, settings: Settings) -> dict[str, float]:
    """GB/s (and GB per CPU-second) of the same puts and gets on raw rocksdict in this process."""
    pool, keys = value_pool(size), ssd_keys(size, settings)
    store = Store(RAW, tempfile.mkdtemp(prefix="bench-tiers-", dir=root), wal=True)
    try:
        put_s, put_cpu = timed_with_cpu(None, lambda: store.run("put", keys, pool))
        # Reopen before reading, as the daemon side restarts its node: reads come
        # from SST files (page cache), not from the memtable or block cache of the writes.
        store = store.reopen()
        order = random.Random(size).sample(keys, len(keys))
        get_s, get_cpu = timed_with_cpu(None, lambda: store.run("get", order, pool))
    finally:
        store.close()
        shutil.rmtree(store.path, ignore_errors=True)
    moved = len(keys) * size / GB
    return {"put": moved / put_s, "get": moved / get_s, "get cpu": moved / get_cpu, "put cpu": moved / put_cpu}


def ssd_table(group: ProcessGroup, root: str, settings: Settings) -> Table:
    table = Table(f"SSD tier through the daemon vs raw rocksdict ({root})", DAEMON, RAW)
    for size in settings.sizes:
        rows = {(op, kind): table.row(f"{op} {label(size)}, {kind}", "GB/s", Target(0.8))
                for op in ("put", "get") for kind in CLIENTS}
        rows.update({(f"{op} cpu", kind): table.row(f"{op} {label(size)}, {kind}, per CPU-second", "GB/CPU-s")
                     for op in ("put", "get") for kind in CLIENTS})
        for repeat in range(settings.repeats):
            sides = [(RAW, None)] + [(DAEMON, kind) for kind in CLIENTS]
            for column, kind in sides[repeat % 3:] + sides[:repeat % 3]:
                if kind is None:
                    figures = raw_ssd_round(root, size, settings)
                    for (op, client_kind), row in rows.items():
                        row.add(RAW, figures[op])
                else:
                    for op, value in daemon_ssd_round(group, root, size, kind, settings).items():
                        rows[op, kind].add(DAEMON, value)
    table.notes.append(f"{settings.bytes_per_run // MIB} MiB per run, {settings.in_flight} requests in flight "
                       "(redis-py: a pipeline of that many commands; SDK: batch_put and batch_get_into of that "
                       "many keys over the Unix socket with the fast path, one value read before the clock runs to open its "
                       "reader of the node's SSD files); daemon writes: write-through until "
                       "INFO ssd_records counts every value; daemon reads: after a restart, every value on SSD "
                       "only, promotion off; rocksdict reads after a reopen; 'per CPU-second': bytes per CPU "
                       "second of the node's threads and the client together (rocksdict: this process), a cost "
                       "that holds whatever else the host runs")
    return table


# ------------------------------------------------------------------ 2. promote latency


def latency_table(group: ProcessGroup, root: str, settings: Settings) -> Table:
    table = Table("GET latency of 1 MiB values", "SSD hit, promoted", "DRAM hit")
    row = table.row("GET 1 MiB, p50", "ms")
    spread = []
    pool = value_pool(MIB)
    keys = [b"lat%08d" % i for i in range(settings.latency_values)]
    for _ in range(settings.repeats):
        with values_on_ssd(group, root, keys, pool, settings, promote_hits=1) as node:
            client = RawClient(node.port)
            for column in ("SSD hit, promoted", "DRAM hit"):
                samples = [timed_get(client, key) for key in keys]
                row.add(column, statistics.median(samples) * 1000)
                spread.append((column, np.percentile(samples, 90) * 1000))
            if info_field(node.port, b"ssd", b"ssd_promotions") != len(keys):
                raise RuntimeError("not every SSD hit was promoted")
            client.close()
    for column in ("SSD hit, promoted", "DRAM hit"):
        p90 = statistics.median(v for c, v in spread if c == column)
        table.notes.append(f"{column}: p90 {p90:.2f} ms")
    table.notes.append(f"{settings.latency_values} values per repeat, one GET at a time, after a restart "
                       "(every value on SSD only, --promote-hits 1); then the same GETs from DRAM")
    return table


@contextmanager
def values_on_ssd(group: ProcessGroup, root: str, keys: list[bytes], pool: list[bytes], settings: Settings,
                  promote_hits: int):
    """A write-through node whose ``keys`` (values from ``pool``) are on SSD alone: written,
    recorded on SSD, the node restarted; stopped and its directory removed afterwards."""
    path = tempfile.mkdtemp(prefix="bench-tiers-", dir=root)
    node = start_node(group, "kvstore-on-ssd", "--dram-size", mb_flag(4 * len(keys) * MIB), "--ssd-dir", path,
                      "--ssd-write-policy", "write-through", "--promote-hits", str(promote_hits))
    try:
        client = RawClient(node.port)
        client.set_many(keys, pool, settings.in_flight)
        wait_for(lambda: info_field(node.port, b"ssd", b"ssd_records") == len(keys), 120)
        client.close()
        node = restart_node(group, node)
        yield node
    finally:
        group.stop(node.process)
        shutil.rmtree(path, ignore_errors=True)


def timed_get(client: RawClient, key: bytes) -> float:
    start = time.perf_counter()
    client.get_many([key], MIB, 1)
    return time.perf_counter() - start


# ------------------------------------------------------------------ 2b. redis-py GETs of values on SSD


def wire_get_table(group: ProcessGroup, root: str, settings: Settings) -> Table:
    """redis-py GETs of 1 MiB values on SSD alone (promotion off), each right after a GET of
    a value of the same size in DRAM on the same node (written after the restart, its SSD
    copy done): once after the restart (a reader thread reads each), then twice more (the
    tier remembers their records and the page cache holds their bytes: read on the loop)."""
    table = Table("redis-py GET of 1 MiB values", "on SSD", "in DRAM")
    first = table.row("GET 1 MiB, first read after a restart", "GET/s")
    again = table.row("GET 1 MiB, on SSD in the page cache", "GET/s", Target(0.8))
    pool = value_pool(MIB)
    keys = [b"wire%08d" % i for i in range(settings.latency_values)]
    in_dram = [b"dram%08d" % i for i in range(settings.latency_values)]
    for _ in range(settings.repeats):
        with values_on_ssd(group, root, keys, pool, settings, promote_hits=1_000_000) as node:
            raw = RawClient(node.port)
            raw.set_many(in_dram, pool, settings.in_flight)
            raw.close()
            wait_for(lambda: info_field(node.port, b"ssd", b"ssd_records") == 2 * len(keys), 120)
            client = redis.Redis(HOST, node.port)
            passes = [[(timed(lambda: client.get(key)), timed(lambda: client.get(other)))
                       for key, other in zip(keys, in_dram)] for _ in range(3)]
            if info_field(node.port, b"ssd", b"ssd_promotions"):
                raise RuntimeError("a value was promoted: the SSD reads would not all be SSD reads")
            client.close()
            for row, pairs in ((first, passes[0]), (again, passes[1] + passes[2])):
                row.add("on SSD", 1 / statistics.median(ssd for ssd, _ in pairs))
                row.add("in DRAM", 1 / statistics.median(dram for _, dram in pairs))
    table.notes.append(f"{len(keys)} values per repeat, one GET at a time over redis-py (TCP), --promote-hits "
                       "1000000, each GET of a value on SSD followed by one of a value in DRAM")
    return table


# ------------------------------------------------------------------ 3. DRAM hits with and without SSD


def dram_hit_table(group: ProcessGroup, root: str, settings: Settings) -> Table:
    with_ssd, without = "with SSD tier", "DRAM only"
    table = Table("DRAM-hit GETs on a node with an SSD tier vs one without", with_ssd, without)
    big = table.row("GET 1 MiB from DRAM", "GB/s", Target(0.95))
    small = table.row("GET 4 KiB from DRAM, 16 in flight", "kops/s", Target(0.95))
    path = tempfile.mkdtemp(prefix="bench-tiers-", dir=root)
    arena = mb_flag(4 * settings.dram_hit_bytes)
    nodes = {with_ssd: start_node(group, "kvstore-with-ssd", "--dram-size", arena, "--ssd-dir", path),
             without: start_node(group, "kvstore-dram-only", "--dram-size", arena)}
    big_keys = [b"big%06d" % i for i in range(max(settings.dram_hit_bytes // MIB // 4, 4))]
    small_keys = [b"small%06d" % i for i in range(1000)]
    try:
        for node in nodes.values():
            client = RawClient(node.port)
            client.set_many(big_keys, value_pool(MIB), 4)
            client.set_many(small_keys, value_pool(4 * KIB), 16)
            client.close()
        for repeat in range(settings.repeats):
            for column in (list(nodes) if repeat % 2 == 0 else list(nodes)[::-1]):
                client = RawClient(nodes[column].port)
                reads = big_keys * 4
                start = time.perf_counter()
                client.get_many(reads, MIB, 4)
                big.add(column, len(reads) * MIB / (time.perf_counter() - start) / GB)
                reads = (small_keys * (settings.small_gets // len(small_keys) + 1))[:settings.small_gets]
                start = time.perf_counter()
                client.get_many(reads, 4 * KIB, 16)
                small.add(column, len(reads) / (time.perf_counter() - start) / 1000)
                client.close()
    finally:
        for node in nodes.values():
            group.stop(node.process)
        shutil.rmtree(path, ignore_errors=True)
    table.notes.append(f"both nodes --dram-size {arena}, every value in DRAM; {len(big_keys) * 4} GETs of 1 MiB "
                       f"and {settings.small_gets} of 4 KiB per repeat")
    return table


# ------------------------------------------------------------------ 4. warm restart


def populate(path: str, settings: Settings) -> None:
    """``restart_values`` chained values stored by the SSD tier itself, then closed."""
    value = np.random.default_rng(1).bytes(settings.restart_value_size)
    tier = SSDTier.open(path, 1 << 40)
    for start in range(0, settings.restart_values, 1000):
        stop = min(start + 1000, settings.restart_values)
        tier.put_batch([(b"%032x" % i, value, b"%032x" % (i - 1) if i else None, None) for i in range(start, stop)])
    tier.close()


def restart_table(group: ProcessGroup, root: str, settings: Settings) -> Table:
    reference = "SSDTier.open + scan_index"
    table = Table(f"Warm restart with {settings.restart_values:,} values on SSD", DAEMON, reference)
    rate = table.row("values recovered per second (daemon log)", "values/s")
    wall = table.row("values per second, start to index loaded", "values/s")
    ping = table.row("PING while loading, p50", "ms")
    ping_max = table.row("PING while loading, max", "ms")
    path = tempfile.mkdtemp(prefix="bench-tiers-", dir=root)
    populate(path, settings)
    pings_seen = []
    try:
        for _ in range(settings.repeats):
            seconds, latencies, logged = daemon_restart(group, path)
            rate.add(DAEMON, logged)
            wall.add(DAEMON, settings.restart_values / seconds)
            pings_seen.append(len(latencies))
            if latencies:
                ping.add(DAEMON, statistics.median(latencies) * 1000)
                ping_max.add(DAEMON, max(latencies) * 1000)
            start = time.perf_counter()
            tier = SSDTier.open(path, 1 << 40)
            count = sum(1 for _ in tier.scan_index())
            tier.close()
            for row in (rate, wall):
                row.add(reference, count / (time.perf_counter() - start))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    table.notes.append(f"{settings.restart_value_size // KIB} KiB values with parent links; PINGs answered while "
                       f"INFO said ssd_loading:1, per repeat: {pings_seen}; 'start' is the spawn of the process "
                       "(Python start-up and the arena's pre-fault included)")
    return table


def daemon_restart(group: ProcessGroup, path: str) -> tuple[float, list[float], float]:
    """Start a node on ``path``: (seconds to index loaded, PING latencies while loading, logged values/s)."""
    port = free_port()
    start = time.perf_counter()
    process = group.start("kvstore-restart", [sys.executable, "-m", "kvstore", "serve", "--port", str(port),
                                              "--dram-size", "64mb", "--ssd-dir", path])
    client = None
    while client is None:
        try:
            client = RawClient(port, timeout=30)
        except OSError:
            if process.popen.poll() is not None:
                raise RuntimeError(f"the node exited:\n{process.log_tail()}")
            time.sleep(0.002)
    latencies = []
    while True:
        sent = time.perf_counter()
        if not client.command(b"PING").startswith(b"+PONG"):
            raise RuntimeError("PING was not answered with PONG")
        took = time.perf_counter() - sent
        if b"ssd_loading:0" in client.command(b"INFO", b"ssd"):
            break
        latencies.append(took)
    seconds = time.perf_counter() - start
    client.close()
    wait_for(lambda: RECOVERED.search(process.log_path.read_bytes()), 30, poll=0.01)
    recovered, took = RECOVERED.search(process.log_path.read_bytes()).groups()
    group.stop(process)
    return seconds, latencies, int(recovered) / max(float(took), 1e-3)


# ------------------------------------------------------------------ 5. hit ratio


def hit_ratio_table(trace: Path, settings: Settings) -> Table:
    belady, lru, sticky = "Belady (optimal)", "LRU", "kvstore, promote-hits 2"
    table = Table("DRAM hit ratio on the trace's read pattern (replay of the policies)", DAEMON, belady,
                  extras=(lru, sticky))
    accesses = hit_ratio.load_accesses(trace, settings.trace_requests)
    blocks = hit_ratio.working_set(accesses)
    for fraction in settings.dram_fractions:
        capacity = max(blocks // fraction, 1)
        row = table.row(f"working set {fraction}x DRAM ({capacity:,} blocks)", "hit ratio",
                        Target(0.9) if fraction == 4 else None)
        for column, hits in ((belady, lambda: hit_ratio.belady_hits(accesses, capacity)),
                             (lru, lambda: hit_ratio.lru_hits(accesses, capacity)),
                             (DAEMON, lambda: hit_ratio.kvstore_hits(accesses, capacity, promote_hits=1)),
                             (sticky, lambda: hit_ratio.kvstore_hits(accesses, capacity, promote_hits=2))):
            try:
                row.add(column, hits() / len(accesses))
            except Exception as exc:     # a broken policy still leaves the other columns to compare
                row.fail(column, f"{type(exc).__name__}: {exc}")
        lru_ratio = row.ratio(lru, belady)
        table.notes.append(f"{fraction}x: LRU/Belady {lru_ratio:.3f}")
    table.notes.append(f"{len(accesses):,} block reads of {settings.trace_requests or 'all'} requests of "
                       f"{trace.name}, {blocks:,} distinct blocks; every first read is a miss for all "
                       f"policies (best possible: {1 - blocks / len(accesses):.3f}). '{DAEMON}' promotes on "
                       "the first SSD hit; 'promote-hits 2' is the daemon's default (10 s window, trace time)")
    return table


# ------------------------------------------------------------------ main


TABLES = ("ssd", "latency", "wire-get", "dram-hit", "restart", "hit-ratio")


def run(settings: Settings, root: str, trace: Path, only: list[str] | None = None) -> list[Table]:
    makers = {"ssd": lambda group: ssd_table(group, root, settings),
              "latency": lambda group: latency_table(group, root, settings),
              "wire-get": lambda group: wire_get_table(group, root, settings),
              "dram-hit": lambda group: dram_hit_table(group, root, settings),
              "restart": lambda group: restart_table(group, root, settings),
              "hit-ratio": lambda group: hit_ratio_table(trace, settings)}
    with ProcessGroup() as group:
        return [makers[name](group) for name in TABLES if not only or name in only]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small repeat of everything (a smoke run)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the RocksDB directories go")
    parser.add_argument("--repeats", type=int, help="runs per figure (median reported)")
    parser.add_argument("--trace", type=Path, default=TRACE, help="Mooncake trace (JSONL with hash_ids)")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--json", metavar="FILE", help="write every sample as JSON")
    parser.add_argument("--only", action="append", choices=TABLES, help="run only this table (repeatable)")
    args = parser.parse_args()
    settings = Settings().quick() if args.quick else Settings()
    if args.repeats:
        settings = replace(settings, repeats=args.repeats)
    machine = machine_info()        # the load average at start, beside the figures
    tables = run(settings, args.dir, args.trace, args.only)
    for table in tables:
        print(table.render_markdown(machine) if args.markdown else table.render_text(machine), end="\n\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([table.to_json(machine) for table in tables], f, indent=1)


if __name__ == "__main__":
    main()
