"""kvstore next to a real redis-server, driven by the same clients in the same run.

    python -m loadtest.bench_vs_redis [--quick] [--only GROUP] [--json FILE] [--markdown]

Both servers start on free loopback ports with the same memory limit. Each
figure is measured `--repeats` times, the servers taking turns going first,
and the table reports medians and the ratio kvstore/Redis, which is what the
targets are set on (issue 2):

- large:    redis-benchmark SET/GET of 64 KiB, 1 MiB, 4 MiB values   ratio >= 1.0
- redis-py: one redis-py client, SET then GET loops of the same sizes ratio >= 1.0
            (and the server's CPU time per SET and per GET, all threads; plus
            Mooncake Store's put/get over TCP as a third column when its
            CPU-only wheel is installed: the anchor to beat)
- small:    redis-benchmark 100-byte SET/GET, -c 50, -P 1 and -P 16   >= 0.9 and >= 0.3
            (and the server's CPU time per command over each run, all threads)
- match:    KV.MATCH of a 1-, 16- and 256-key chain from a raw socket p50 <= 0.5 ms at 256,
            one command per call. Redis has no KV.MATCH; its column times EXISTS of the
            same keys in one command, the closest thing it can answer in one round trip.

redis-py with hiredis copies each large SET value into fresh buffers on the
client side, which caps SET near 0.6 GB/s whatever the server: both servers
are measured with that same client, and the ratio is what counts.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from functools import partial

import redis

from loadtest.procs import (DEFAULT_KVSTORE_CMD, ProcessGroup, Server, start_kvstore, start_mooncake,
                            start_redis)
from loadtest.report import Table, Target, log, machine_info, one_line, record, turns

KVSTORE, REDIS, MOONCAKE = "kvstore", "redis", "mooncake"
KIB, MIB = 1 << 10, 1 << 20
GB = 1e9
# What a measurement may raise when a server misbehaves: noted in the table, the run goes on.
MEASUREMENT_ERRORS = (OSError, redis.RedisError, RuntimeError, subprocess.SubprocessError, ValueError)
GROUPS = ("large", "redis-py", "small", "match")   # in the order they run
WARMUP_ROUNDS = 3  # untimed round trips before a one-client loop: connection set-up and first-touch page faults


@dataclass(frozen=True)
class Settings:
    """How much work each figure gets; `quick()` is the smoke-run variant."""

    repeats: int = 5
    memory: str = "2gb"
    sizes: tuple[int, ...] = (64 * KIB, MIB, 4 * MIB)
    large_bytes: int = 1 << 30          # bytes one redis-benchmark run of large values moves, per test
    large_clients: int = 4
    redispy_bytes: int = 512 * MIB      # bytes one redis-py SET (or GET) loop moves
    small_requests: int = 200_000       # per test at -P 1; -P 16 runs five times as many
    match_calls: int = 2000             # timed calls per chain length
    groups: tuple[str, ...] = GROUPS
    mooncake: bool = True
    kvstore_cmd: str = DEFAULT_KVSTORE_CMD

    @classmethod
    def quick(cls) -> Settings:
        return cls(repeats=1, large_bytes=128 * MIB, redispy_bytes=64 * MIB, small_requests=20_000,
                   match_calls=300)


def size_label(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def parse_size(text: str) -> int:
    """Redis-style sizes: 2gb, 512mb, 64kb, or plain bytes."""
    units = {"gb": 1 << 30, "mb": 1 << 20, "kb": 1 << 10, "b": 1}
    lowered = text.strip().lower()
    for suffix, factor in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * factor)
    return int(lowered)


# --- redis-benchmark -------------------------------------------------------------------------------

def redis_benchmark(server: Server, *, size: int, requests: int, clients: int, pipeline: int = 1,
                    tests: str = "set,get") -> dict[str, float]:
    """Requests per second of each test, from redis-benchmark's CSV output."""
    argv = ["redis-benchmark", "-h", server.host, "-p", str(server.port), "-t", tests, "-d", str(size),
            "-n", str(requests), "-c", str(clients), "-P", str(pipeline), "--csv"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    rates = {row["test"]: float(row["rps"]) for row in csv.DictReader(io.StringIO(done.stdout)) if row.get("rps")}
    if done.returncode != 0 or len(rates) != len(tests.split(",")):
        raise RuntimeError(f"redis-benchmark exited {done.returncode}: {(done.stderr or done.stdout).strip()[:120]}")
    return rates


def bench_large(table: Table, servers: dict[str, Server], settings: Settings, group: ProcessGroup) -> None:
    for size in settings.sizes:
        rows = [table.row(f"redis-benchmark {op} {size_label(size)} -c {settings.large_clients}", "GB/s",
                          Target(1.0)) for op in ("SET", "GET")]
        requests = max(settings.large_bytes // size, settings.large_clients)
        log(f"redis-benchmark SET/GET {size_label(size)} x {requests}")
        for name, server in turns(servers, settings.repeats):
            def measure(server=server) -> list[float]:
                rates = redis_benchmark(server, size=size, requests=requests, clients=settings.large_clients)
                return [rates["SET"] * size / GB, rates["GET"] * size / GB]
            record(rows, name, measure, MEASUREMENT_ERRORS)


def bench_small(table: Table, servers: dict[str, Server], settings: Settings, group: ProcessGroup) -> None:
    for pipeline, target, requests in ((1, 0.9, settings.small_requests), (16, 0.3, 5 * settings.small_requests)):
        rows = [table.row(f"redis-benchmark {op} 100 B -c 50 -P {pipeline}", "ops/s", Target(target))
                for op in ("SET", "GET")]
        rows.append(table.row(f"server CPU per command, SET+GET 100 B -P {pipeline}", "us"))
        log(f"redis-benchmark SET/GET 100 B -P {pipeline} x {requests}")
        for name, server in turns(servers, settings.repeats):
            def measure(server=server) -> list[float]:
                before = server_cpu_ns(server)
                rates = redis_benchmark(server, size=100, requests=requests, clients=50, pipeline=pipeline)
                return [rates["SET"], rates["GET"], (server_cpu_ns(server) - before) / (2 * requests) / 1000]
            record(rows, name, measure, MEASUREMENT_ERRORS)


def server_cpu_ns(server: Server) -> int:
    """CPU time the server's process has used, all its threads (Linux's schedstat), in ns:
    what a command costs the server, whatever else the host is running."""
    task_dir = f"/proc/{server.process.pid}/task"
    total = 0
    for task in os.listdir(task_dir):
        with contextlib.suppress(FileNotFoundError):
            with open(f"{task_dir}/{task}/schedstat") as stat:
                total += int(stat.read().split()[0])
    return total


# --- redis-py and Mooncake: one client, a SET loop then a GET loop ---------------------------------

def redispy_set_get(server: Server, size: int, iterations: int) -> list[float]:
    """GB/s of `iterations` SETs of one value, then as many GETs of it, from one redis-py client;
    then the server's CPU time per SET and per GET (µs), which the host's load disturbs far less."""
    value = os.urandom(size)
    client = redis.Redis(host=server.host, port=server.port, socket_timeout=60)
    try:
        key = f"bench:redis-py:{size}"
        for _ in range(WARMUP_ROUNDS):
            client.set(key, value)
            client.get(key)
        cpu_before, started = server_cpu_ns(server), time.perf_counter()
        for _ in range(iterations):
            client.set(key, value)
        set_seconds, set_cpu = time.perf_counter() - started, server_cpu_ns(server) - cpu_before
        cpu_before, started = server_cpu_ns(server), time.perf_counter()
        for _ in range(iterations):
            got = client.get(key)
        get_seconds, get_cpu = time.perf_counter() - started, server_cpu_ns(server) - cpu_before
        if got != value:
            raise RuntimeError(f"GET returned {len(got or b'')} bytes that differ from the {size} stored")
        client.delete(key)
    finally:
        client.close()
    volume = size * iterations
    return [volume / set_seconds / GB, volume / get_seconds / GB,
            set_cpu / iterations / 1000, get_cpu / iterations / 1000]


class MooncakeClient:
    """A MooncakeDistributedStore client in this process that keeps no segment of its own, so every
    put and get crosses TCP to the holder process."""

    def __init__(self, master_address: str, metadata_url: str, log_path: str) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        with stderr_to(log_path):  # its setup logs a page to stderr whatever GLOG_* says
            rc = self.store.setup("127.0.0.1", metadata_url, 0, 64 * MIB, "tcp", "", master_address)
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        self.generation = 0

    def put_get(self, size: int, iterations: int) -> list[float]:
        """GB/s of `iterations` puts of fresh keys (Mooncake objects are put once), then gets of them."""
        self.generation += 1
        value = os.urandom(size)
        for n in range(WARMUP_ROUNDS):
            self.store.put(f"warmup-{self.generation}-{n}", value)
            self.store.get(f"warmup-{self.generation}-{n}")
        keys = [f"bench-{self.generation}-{i}" for i in range(iterations)]
        started = time.perf_counter()
        for key in keys:
            if (rc := self.store.put(key, value)) != 0:
                raise RuntimeError(f"Mooncake put returned {rc}")
        put_seconds = time.perf_counter() - started
        started = time.perf_counter()
        for key in keys:
            got = self.store.get(key)
        get_seconds = time.perf_counter() - started
        if got != value:
            raise RuntimeError(f"Mooncake get returned {len(got)} bytes that differ from the {size} stored")
        self.store.remove_all()
        volume = size * iterations
        return [volume / put_seconds / GB, volume / get_seconds / GB]

    def close(self) -> None:
        self.store.close()


@contextlib.contextmanager
def stderr_to(path: str):
    """Send this process's file descriptor 2 (native libraries write there) to a file for a while."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as sink:
            os.dup2(sink.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def connect_mooncake(group: ProcessGroup, settings: Settings) -> MooncakeClient | str:
    """A Mooncake client with a segment as large as the others' memory, or the one-line reason there is none."""
    try:
        import mooncake.store  # noqa: F401  (fails fast when the wheel or libibverbs1 is missing)

        cluster = start_mooncake(group, parse_size(settings.memory))
        return MooncakeClient(cluster.master_address, cluster.metadata_url, str(group.log_dir / "mooncake-client.log"))
    except (ImportError, OSError, RuntimeError) as exc:
        return one_line(exc, 200)


def bench_redispy(table: Table, servers: dict[str, Server], settings: Settings, group: ProcessGroup) -> None:
    columns: dict[str, object] = dict(servers)
    mooncake = connect_mooncake(group, settings) if settings.mooncake else None
    if isinstance(mooncake, MooncakeClient):
        columns[MOONCAKE] = mooncake
    elif mooncake is not None:
        table.notes.append(f"Mooncake Store not measured: {mooncake}")
    try:
        for size in settings.sizes:
            rows = [table.row(f"redis-py {op} {size_label(size)}", "GB/s", Target(1.0)) for op in ("SET", "GET")]
            rows += [table.row(f"server CPU per redis-py {op} {size_label(size)}", "us") for op in ("SET", "GET")]
            iterations = max(settings.redispy_bytes // size, 1)
            log(f"redis-py SET/GET {size_label(size)} x {iterations}")
            for name, target in turns(columns, settings.repeats):
                if name == MOONCAKE:
                    measure = partial(mooncake.put_get, size, iterations)
                else:
                    measure = partial(redispy_set_get, target, size, iterations)
                record(rows, name, measure, MEASUREMENT_ERRORS)
    finally:
        if isinstance(mooncake, MooncakeClient):
            mooncake.close()
            table.notes.append("mooncake column: MooncakeDistributedStore put/get from this process (no segment "
                               "of its own) to a holder process over TCP, fresh keys each put (objects are put once).")


# --- KV.MATCH --------------------------------------------------------------------------------------

class RespError(RuntimeError):
    """An error reply from the server."""


class RespConnection:
    """A blocking RESP2 connection with nothing between the timer and the wire: one write, one reply."""

    def __init__(self, server: Server) -> None:
        self.sock = socket.create_connection((server.host, server.port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = self.sock.makefile("rb")

    @staticmethod
    def encode(*args: str | bytes) -> bytes:
        parts = [b"*%d\r\n" % len(args)]
        for arg in args:
            data = arg.encode() if isinstance(arg, str) else arg
            parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
        return b"".join(parts)

    def call_encoded(self, payload: bytes):
        self.sock.sendall(payload)
        return self.read_reply()

    def call(self, *args: str | bytes):
        return self.call_encoded(self.encode(*args))

    def read_reply(self):
        line = self.reader.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionError("connection closed in the middle of a reply")
        kind, body = line[:1], line[1:-2]
        if kind == b"+":
            return body
        if kind == b"-":
            raise RespError(body.decode(errors="replace"))
        if kind == b":":
            return int(body)
        if kind == b"$":
            return None if int(body) < 0 else self.reader.read(int(body) + 2)[:-2]
        if kind == b"*":
            return None if int(body) < 0 else [self.read_reply() for _ in range(int(body))]
        raise ConnectionError(f"unexpected reply {line[:40]!r}")

    def commands_processed(self) -> int:
        info = self.call("INFO", "stats").decode()
        for line in info.splitlines():
            if line.startswith("total_commands_processed:"):
                return int(line.split(":", 1)[1])
        raise RuntimeError("INFO stats has no total_commands_processed")

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


CHAIN_LENGTHS = (1, 16, 256)


def chain_keys(length: int) -> list[str]:
    """Block keys as the SDK writes them: 32 hex characters, here under a benchmark prefix."""
    return [f"bench:{os.urandom(16).hex()}" for _ in range(length)]


def store_chain(conn: RespConnection, column: str, keys: list[str]) -> None:
    """KV.PUT each block with its parent link on kvstore; plain SET on Redis."""
    value = os.urandom(64)
    parent = None
    for key in keys:
        if column == KVSTORE:
            conn.call("KV.PUT", key, value, *(("PARENT", parent) if parent else ()))
        else:
            conn.call("SET", key, value)
        parent = key


def time_match(conn: RespConnection, column: str, keys: list[str], calls: int) -> tuple[list[float], float]:
    """Latencies in ms of `calls` KV.MATCH (EXISTS on Redis) of all keys, and server commands per call."""
    payload = conn.encode("KV.MATCH" if column == KVSTORE else "EXISTS", *keys)
    for _ in range(min(calls, 50)):
        if (answer := conn.call_encoded(payload)) != len(keys):
            raise RuntimeError(f"match of {len(keys)} stored keys answered {answer!r}")
    first = conn.commands_processed()
    before = conn.commands_processed()
    info_cost = before - first              # what one INFO adds to the count, however the server counts it
    latencies = []
    for _ in range(calls):
        started = time.perf_counter()
        conn.call_encoded(payload)
        latencies.append((time.perf_counter() - started) * 1000)
    commands = conn.commands_processed() - before - info_cost
    return latencies, commands / calls


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(fraction * len(ordered)), len(ordered) - 1)]


def bench_match(table: Table, servers: dict[str, Server], settings: Settings, group: ProcessGroup) -> None:
    rows = {length: table.row(f"KV.MATCH {length}-key chain p50 (Redis: EXISTS of the keys)", "ms",
                              Target(0.5, "value") if length == 256 else None) for length in CHAIN_LENGTHS}
    p99 = table.row("KV.MATCH 256-key chain p99 (Redis: EXISTS of the keys)", "ms")
    per_call = table.row("server commands per KV.MATCH call (max over 1/16/256 keys)", "cmds", Target(1.0, "value"))
    chains = {length: chain_keys(length) for length in CHAIN_LENGTHS}
    log(f"KV.MATCH of {'/'.join(map(str, CHAIN_LENGTHS))}-key chains x {settings.match_calls}")
    for name, server in turns(servers, settings.repeats):
        def measure(name=name, server=server) -> list[float]:
            conn = RespConnection(server)
            try:
                results = {}
                for length, keys in chains.items():
                    store_chain(conn, name, keys)
                    results[length] = time_match(conn, name, keys, settings.match_calls)
            finally:
                conn.close()
            p50s = [statistics.median(results[length][0]) for length in CHAIN_LENGTHS]
            return [*p50s, percentile(results[256][0], 0.99), max(cost for _, cost in results.values())]
        record([*rows.values(), p99, per_call], name, measure, MEASUREMENT_ERRORS)
    table.notes.append("KV.MATCH rows: the redis column times EXISTS k1..kN in one command, the closest "
                       "one-round-trip question Redis can answer (it counts keys, not a prefix).")


# --- the run ---------------------------------------------------------------------------------------

BENCHES = {"large": bench_large, "redis-py": bench_redispy, "small": bench_small, "match": bench_match}


def run(settings: Settings, group: ProcessGroup) -> Table:
    """Start both servers in `group`, measure the selected groups, and return the table."""
    extras = (MOONCAKE,) if settings.mooncake and "redis-py" in settings.groups else ()
    table = Table("kvstore vs Redis (medians of %d runs)" % settings.repeats, KVSTORE, REDIS, extras)
    servers = {KVSTORE: start_kvstore(group, settings.memory, settings.kvstore_cmd),
               REDIS: start_redis(group, settings.memory)}
    for name, server in servers.items():
        log(f"{name}: pid {server.process.pid} on {server.host}:{server.port}")
    table.notes.append(f"{KVSTORE}/{REDIS}: median of the per-run ratios, the servers running back to back "
                       "in each run and taking turns to go first.")
    for name in GROUPS:
        if name in settings.groups:
            BENCHES[name](table, servers, settings, group)
    table.notes.append(f"Both servers hold at most {settings.memory}; redis-server "
                       f"{redis_version()} with persistence off.")
    return table


def redis_version() -> str:
    done = subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
    fields = dict(part.split("=", 1) for part in done.stdout.split() if "=" in part)
    return fields.get("v", "unknown")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_vs_redis", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one run of each figure with less data (smoke run)")
    parser.add_argument("--only", action="append", choices=GROUPS, metavar="GROUP",
                        help=f"measure only this group ({', '.join(GROUPS)}); may be repeated")
    parser.add_argument("--repeats", type=int, help="runs of each figure, servers alternating (default 5, quick 1)")
    parser.add_argument("--memory", default="2gb", help="--dram-size of kvstore and maxmemory of Redis (default 2gb)")
    parser.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake Store column")
    parser.add_argument("--json", metavar="FILE", help="write every sample, median and ratio to FILE")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown with date and machine")
    parser.add_argument("--kvstore-cmd", default=DEFAULT_KVSTORE_CMD, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    settings = Settings.quick() if args.quick else Settings()
    return replace(settings, repeats=args.repeats or settings.repeats, memory=args.memory,
                   groups=tuple(args.only or GROUPS), mooncake=not args.no_mooncake, kvstore_cmd=args.kvstore_cmd)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = settings_from(args)
    machine = machine_info()
    try:
        with ProcessGroup() as group:
            table = run(settings, group)
    except KeyboardInterrupt:
        log("interrupted; every server started was stopped")
        return 130
    print(table.render_markdown(machine) if args.markdown else table.render_text(machine))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table.to_json(machine), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
