"""The cluster's figures, each a ratio or a bound measured in one run.

    python -m loadtest.bench_cluster [--quick] [--repeats N] [--only NAME ...]

- striped:   3 nodes vs 1 node, each in its own network namespace behind a
             1 Gbit/s tbf cap (`cluster up --netns --nic-rate 1gbit`); one client
             reads a 64 x 1 MiB chain with one parallel batch get (over the wire:
             the fast path would bypass the NICs). Throughput ratio >= 2.4.
- hotblock:  3 capped nodes, 6 reader processes reading one hot 1 MiB block in a
             loop, spreading over owner and copies (READONLY) when replication has
             made them: aggregate throughput with copies / without >= 2.4, in the
             steady state (after a warm-up: the copies exist after one 1 s heat
             window and readers find them at their next once-a-second poll; the
             warm-up's own throughput is printed in a note).
- failover:  3 nodes (2 s node timeout), a steady writer on one slot; kill -9 the
             slot's owner: seconds until writes to that slot succeed again
             <= node timeout + 2 s; every value read back verifies (0 wrong bytes).
- match:     KV.MATCH of a 256-key chain over 3 nodes on loopback through
             KVClusterClient.match_prefix: p50 <= 1 ms, one command per node.
- prefix:    3 nodes of 64 MB; chains of 32 blocks written up to 4x the cluster's
             memory with a trace-like reuse pattern (a match, then a read of the
             matched prefix): >= 99 % of chains keep a prefix of their blocks,
             counted once the nodes' eviction cascades have settled.
- cost:      a 1-node cluster vs a standalone node, redis-py SET/GET of 1 MiB:
             ratio >= 0.95 (short passes taking turns, eight a repeat: one slow
             spell of this shared host moves one sample, not a column).
- rebalance: a 4th node joins a 3-node cluster under a uniform read load over a
             working set that fits: hit ratio over the next 30 s / before >= 0.9.

The host's load average at start is printed with the table: on a busy 2-core
host every figure is noisier. Rows whose machinery is missing (no network namespaces here)
say so instead of a number.
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import redis

from client import KVClusterClient
from client.errors import KVError
from kvstore.cluster.netns import netns_available
from loadtest.cluster_up import ClusterUp
from loadtest.procs import ProcessGroup, free_port, start_kvstore
from loadtest.report import Table, Target, log, machine_info
from loadtest.sealed import seal, verify

MIB = 1 << 20
COST_VALUES = 64          # 1 MiB values per SET/GET pass of the cost figure ...
COST_TURNS = 8            # ... and passes of each server a repeat, taking turns
FIGURES = ("striped", "match", "prefix", "cost", "failover", "hotblock", "rebalance")
SUBJECT, REFERENCE = "kvstore", "reference"      # each row names what the two are
ERRORS = (OSError, KVError, redis.RedisError, RuntimeError)


@dataclass(frozen=True)
class Settings:
    repeats: int = 5
    chain_blocks: int = 64
    match_calls: int = 300
    prefix_memory_factor: float = 4.0
    readers: int = 6
    reader_seconds: float = 4.0
    reader_warmup_seconds: float = 2.5
    rebalance_seconds: float = 30.0

    @classmethod
    def quick(cls) -> "Settings":
        return cls(repeats=1, chain_blocks=32, match_calls=100, prefix_memory_factor=2.0, reader_seconds=2.0,
                   rebalance_seconds=10.0)


def _client(up: ClusterUp, **options) -> KVClusterClient:
    return KVClusterClient([f"{h}:{p}" for h, p in up.addrs], **options)


# ---------------------------------------------------------------------- striped


def capped_row(table: Table, name: str):
    """A GB/s row of a figure that needs hosts with capped NICs; None (and the reason in the
    row) where network namespaces cannot be made."""
    row = table.row(name, "GB/s", Target(2.4))
    ok, why = netns_available()
    if not ok:
        row.fail(SUBJECT, why)
        return None
    return row


def striped(table: Table, s: Settings) -> None:
    row = capped_row(table, f"striped fetch {s.chain_blocks} x 1 MiB, 1gbit NICs: 3 nodes / 1 node")
    if row is None:
        return
    for column, nodes in ((SUBJECT, 3), (REFERENCE, 1)):
        with ClusterUp(nodes=nodes, dram_size="256mb", extra=("--netns", "--nic-rate", "1gbit")) as up, \
                _client(up, fast_path="off", timeout=60) as kv:
            keys = [b"stripe-%04d" % i for i in range(s.chain_blocks)]
            kv.batch_put([(k, os.urandom(MIB)) for k in keys])
            buffers = [bytearray(MIB) for _ in keys]
            kv.batch_get_into(keys, buffers)                   # connections and first touch
            for _ in range(s.repeats):
                started = time.perf_counter()
                kv.batch_get_into(keys, buffers)
                row.add(column, len(keys) * MIB / (time.perf_counter() - started) / 1e9)
            log(f"  striped {column}: {row.median(column):.3f} GB/s")


# ---------------------------------------------------------------------- match


def match(table: Table, s: Settings) -> None:
    row = table.row("KV.MATCH 256-key chain over 3 nodes, p50", "ms", Target(1.0, on="value"))
    commands = table.row("KV.MATCH commands per node per match", "cmds", Target(1.0, on="value"))
    with ClusterUp(nodes=3) as up, _client(up) as kv:
        keys = [b"match-%04d" % i for i in range(256)]
        kv.batch_put([(k, b"x" * 64) for k in keys], parents=[None] + keys[:-1])
        probes = [redis.Redis(*addr) for addr in up.addrs]
        cascades_settled(probes)                               # the links' notes (KV.UPLINK) are sent
        idle = _served(probes, twice=True)                     # what asking costs
        before = _served(probes)
        times = []
        for _ in range(s.match_calls):
            started = time.perf_counter()
            assert kv.match_prefix(keys) == 256
            times.append((time.perf_counter() - started) * 1000)
        after = _served(probes)
        row.add(SUBJECT, statistics.median(times))
        commands.add(SUBJECT, max(a - b - i for a, b, i in zip(after, before, idle)) / s.match_calls)


def _served(probes: list[redis.Redis], twice: bool = False) -> list[int]:
    """Commands each node has served (INFO itself counts: ``twice`` measures that cost)."""
    counts = [p.info("stats")["total_commands_processed"] for p in probes]
    if not twice:
        return counts
    return [p.info("stats")["total_commands_processed"] - c for p, c in zip(probes, counts)]


# ---------------------------------------------------------------------- prefix


def prefix_closed(table: Table, s: Settings) -> None:
    row = table.row("chains whose cached blocks are not a prefix", "%", Target(1.0, on="value"))
    rng = np.random.default_rng(7)
    block, per_chain, node_mb = 64 * 1024, 32, 64
    chains_needed = int(s.prefix_memory_factor * 3 * node_mb * MIB / (block * per_chain))
    with ClusterUp(nodes=3, dram_size=f"{node_mb}mb") as up, _client(up, fast_path="off") as kv:
        chains: list[list[bytes]] = []
        payload = os.urandom(block)
        for c in range(chains_needed):
            keys = [b"chain%05d-%02d" % (c, i) for i in range(per_chain)]
            kv.batch_put([(k, payload) for k in keys], parents=[None] + keys[:-1])
            chains.append(keys)
            for _ in range(2):                                  # trace-like reuse: recent chains more often
                old = chains[int(len(chains) * (1 - rng.random() ** 3)) - 1]
                hit = kv.match_prefix(old)
                if hit:
                    kv.batch_get(old[:hit])
        probes = [redis.Redis(*addr) for addr in up.addrs]
        settle_s = cascades_settled(probes)
        holes = 0
        for keys in chains:
            cached = [loc is not None for loc in kv.locate(keys)]
            first_gap = cached.index(False) if False in cached else len(cached)
            holes += any(cached[first_gap:])
        row.add(SUBJECT, 100.0 * holes / len(chains))
        cascade = [sum(p.info("cluster")[f"cluster_cascade_{name}"] for p in probes)
                   for name in ("dropped", "sent", "send_failures", "cut_short")]
        table.notes.append(f"prefix: {len(chains)} chains of {per_chain} x 64 KiB written into 3 x {node_mb} MB; "
                           f"cascades: {cascade[0]} blocks dropped, {cascade[1]} sent between nodes, "
                           f"{cascade[2]} lost, {cascade[3]} cut short; settled {settle_s:.2f} s after the last write")


def cascades_settled(probes: list[redis.Redis], limit_s: float = 10.0) -> float:
    """Seconds until the nodes' eviction cascades are over (at most ``limit_s``): no node has a drop
    or a send waiting, and no counter moved, in two polls in a row (a cascade in flight between two
    polls shows in the second)."""
    started, last = time.monotonic(), None
    while time.monotonic() - started < limit_s:
        fields = [p.info("cluster") for p in probes]
        now = [(f["cluster_cascade_pending"], f["cluster_cascade_dropped"], f["cluster_cascade_sent"]) for f in fields]
        if now == last and not any(pending for pending, _, _ in now):
            break
        last = now
        time.sleep(0.05)
    return time.monotonic() - started


# ---------------------------------------------------------------------- cost


def cluster_cost(table: Table, s: Settings) -> None:
    rows = {op: table.row(f"redis-py {op} 1 MiB: 1-node cluster / standalone", "GB/s", Target(0.95))
            for op in ("SET", "GET")}
    value = os.urandom(MIB)
    with ClusterUp(nodes=1, dram_size="1gb") as up, ProcessGroup() as group:
        standalone = start_kvstore(group, "1gb")
        clients = {SUBJECT: redis.Redis(*up.addrs[0]), REFERENCE: redis.Redis(standalone.host, standalone.port)}
        for turn in range(s.repeats * COST_TURNS):
            order = list(clients.items())
            for column, client in order if turn % 2 == 0 else order[::-1]:      # neither always goes first
                for op, seconds in _set_get(client, value, COST_VALUES).items():
                    rows[op].add(column, COST_VALUES * MIB / seconds / 1e9)


def _set_get(client: redis.Redis, value: bytes, count: int) -> dict[str, float]:
    keys = [f"{{cost}}{i}" for i in range(count)]
    client.set(keys[0], value)
    started = time.perf_counter()
    for key in keys:
        client.set(key, value)
    middle = time.perf_counter()
    for key in keys:
        client.get(key)
    return {"SET": middle - started, "GET": time.perf_counter() - middle}


# ---------------------------------------------------------------------- failover


def failover(table: Table, s: Settings) -> None:
    timeout = 2.0
    row = table.row(f"writes to a dead owner's slot succeed again (node timeout {timeout:g} s)", "s",
                    Target(timeout + 2.0, on="value"))
    wrong = table.row("wrong bytes served during failover", "bytes", Target(0.0, on="value"))
    for _ in range(max(1, s.repeats // 2)):
        with ClusterUp(nodes=3, extra=("--node-timeout", str(timeout))) as up, \
                _client(up, fast_path="off", timeout=1, retries=0) as kv:
            tag = b"{victim}"
            victim = kv.node_of(tag)
            pid = next(n["pid"] for n in up.info["nodes"] if n["addr"] == victim)
            recovered, bad = _write_through_kill(kv, tag, pid)
            row.add(SUBJECT, recovered)
            wrong.add(SUBJECT, bad)


def _write_through_kill(kv: KVClusterClient, tag: bytes, pid: int) -> tuple[float, int]:
    """Write and read back keys of one slot; kill the owner; seconds until a write lands again."""
    killed_at, bad = None, 0
    for i in range(100_000):
        key = tag + b"%d" % i
        value = seal(key, os.urandom(1024))
        if i == 50:
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
        try:
            kv.put(key, value, overwrite=True)
            got = kv.get(key)
        except KVError:
            time.sleep(0.05)
            with contextlib.suppress(KVError):
                kv.refresh()
            continue
        if not verify(key, got):
            bad += len(value)
        if killed_at is not None:
            return time.monotonic() - killed_at, bad      # the first write that lands after the kill
        if killed_at is not None and time.monotonic() - killed_at > 30:
            break
    return float("inf"), bad


# ---------------------------------------------------------------------- hot block


def hot_block(table: Table, s: Settings) -> None:
    row = capped_row(table, f"{s.readers} readers of one hot 1 MiB block, 1gbit NICs: copies / none")
    if row is None:
        return
    warm = {}
    windows = [s.reader_warmup_seconds] + [s.reader_seconds] * s.repeats
    for column, flags in ((SUBJECT, ("--", "--hot-reads", "20")), (REFERENCE, ("--", "--hot-reads", "0"))):
        with ClusterUp(nodes=3, dram_size="256mb", extra=("--netns", "--nic-rate", "1gbit", *flags)) as up:
            addrs = [f"{h}:{p}" for h, p in up.addrs]
            with KVClusterClient(addrs, fast_path="off") as kv:
                kv.put(b"hot", os.urandom(MIB), overwrite=True)
            with multiprocessing.Pool(s.readers) as pool:
                moved = np.sum(pool.starmap(_read_hot, [(addrs, windows)] * s.readers), axis=0)
            warm[column] = moved[0] / windows[0] / 1e9
            for nbytes, seconds in zip(moved[1:], windows[1:]):
                row.add(column, nbytes / seconds / 1e9)
    table.notes.append(f"hotblock: the first {s.reader_warmup_seconds:g} s of reading (not counted): "
                       f"{warm[SUBJECT]:.3f} GB/s with copies, {warm[REFERENCE]:.3f} GB/s without")


def _read_hot(addrs: list[str], windows: list[float]) -> list[int]:
    """Bytes read in each of the back-to-back ``windows`` (seconds), into one buffer reused."""
    with KVClusterClient(addrs, fast_path="off", timeout=10) as kv:
        buf, moved = bytearray(MIB), []
        for seconds in windows:
            deadline, nbytes = time.monotonic() + seconds, 0
            while time.monotonic() < deadline:
                nbytes += kv.get_into(b"hot", buf) or 0
            moved.append(nbytes)
        return moved


# ---------------------------------------------------------------------- rebalance


def rebalance(table: Table, s: Settings) -> None:
    """Hit ratio of a uniform read load over a working set that fits, before and after a 4th
    node joins (its slots arrive with their hottest values first)."""
    window = s.rebalance_seconds
    row = table.row(f"hit ratio over {window:g} s after a 4th node joins: after / before", "ratio", Target(0.9))
    with ClusterUp(nodes=3, dram_size="128mb") as up, ProcessGroup() as group, \
            _client(up, fast_path="off") as kv:
        keys = [b"ws-%05d" % i for i in range(2000)]
        for start in range(0, len(keys), 200):
            kv.batch_put([(k, seal(k, os.urandom(16 * 1024))) for k in keys[start:start + 200]])
        before = _hit_ratio(kv, keys, window / 3)
        port = free_port()
        group.start("node-4", [sys.executable, "-m", "kvstore", "serve", "--port", str(port), "--dram-size",
                               "128mb", "--cluster", up.etcd_url])
        after = _hit_ratio(kv, keys, window)
        kv.refresh()
        row.add(SUBJECT, after)
        row.add(REFERENCE, before)
        table.notes.append(f"rebalance: hit ratio {before:.3f} before the join, {after:.3f} over {window:g} s after; "
                           f"{len(kv.nodes)} nodes own slots at the end")


def _hit_ratio(kv: KVClusterClient, keys: list[bytes], seconds: float) -> float:
    """Random batched reads for ``seconds``: the share that hit (a wrong value counts as a miss
    and is reported)."""
    rng, hits, reads = np.random.default_rng(3), 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        batch = [keys[i] for i in rng.integers(0, len(keys), 32)]
        try:
            values = kv.batch_get(batch)
        except KVError:
            reads += len(batch)
            with contextlib.suppress(KVError):
                kv.refresh()
            continue
        reads += len(batch)
        hits += sum(v is not None and verify(k, v) for k, v in zip(batch, values))
        if any(v is not None and not verify(k, v) for k, v in zip(batch, values)):
            log("  rebalance: a wrong value was served")
    return hits / max(1, reads)


# ---------------------------------------------------------------------- main


RUNNERS = {"striped": striped, "match": match, "prefix": prefix_closed, "cost": cluster_cost,
           "failover": failover, "hotblock": hot_block, "rebalance": rebalance}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one run of each figure with less data")
    parser.add_argument("--repeats", type=int, help="runs of each figure (default 5, quick 1)")
    parser.add_argument("--only", action="append", choices=FIGURES, metavar="NAME", help="run only these figures")
    args = parser.parse_args(argv)
    s = Settings.quick() if args.quick else Settings()
    if args.repeats:
        s = Settings(**{**s.__dict__, "repeats": args.repeats})
    table = Table("kvstore cluster", SUBJECT, REFERENCE)
    for name in args.only or FIGURES:
        log(f"{name} ...")
        try:
            RUNNERS[name](table, s)
        except ERRORS as exc:
            table.notes.append(f"{name}: not measured: {exc}")
    print(table.render_text(machine_info()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
