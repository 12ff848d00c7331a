"""Memory that holds any mix of value sizes: kvstore next to redis-server in the same run.

    python -m loadtest.bench_memory [--quick] [--repeat 3] [--only burst,chain,mixed,tenants,lmcache]

Each scenario runs on a fresh kvstore node and a fresh redis-server (maxmemory,
allkeys-lru), one after the other, while a separate process PINGs the server
under test every 10 ms (its round trips are the loop's stalls as a client sees them):

- burst: 200,000 values of 100 bytes, then 100 SETs of 1 MiB into 64 MB. Small
  values left, against what exact LRU over the whole budget would keep (values'
  rounded sizes, newest first, until the budget is full).
- chain: a 200,000-block chain (KV.PUT ... PARENT; plain SETs on redis) of 100-byte
  blocks, then 1 MiB SETs until the chain has drained (kvstore) or as many (redis).
- mixed: a cache-aside stream over keys whose values are 70 % 64 B-4 KiB and 30 %
  256 KiB-4 MiB (sizes log-uniform), 4x more data than the budget; reads Zipf(0.9), a
  miss SETs the value. Hit ratio after warm-up and live bytes / budget (value bytes
  and, for kvstore, bytes handed out) at the end.
- tenants: two ACL users with equal shares (a third of the budget each), one quiet
  (writes 90 % of its share of 16 KiB values, then nothing), one bursting (10x its
  share). Share of the quiet tenant's values left: on redis (no quotas), on kvstore
  without quotas and on kvstore with ``quota-dram`` set (kvstore/store/quotas.py);
  the last must keep at least 95 %.
- lmcache: LMCache's own RedisConnector (0.5.6, a `kv_bytes` and a `metadata` key a chunk,
  512 KiB chunks) puts 4x the budget in chunks, then gets every one back: chunks whole,
  `metadata` keys left without their `kv_bytes` (a lookup that finds a chunk that is not
  there) and the reverse, counted before the reads; every chunk read must be a miss or
  exactly its bytes (kvstore/store/companions.py).

Each scenario runs ``--repeat`` times per server, the servers taking turns; every
figure printed is the median over the repeats (a PING max is one sample of a
hundred or so: it moves by 2x between runs on a shared host). Prints PING max
and p99 per server and kvstore's over redis's.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import redis

from loadtest.procs import ProcessGroup, start_kvstore, start_redis
from loadtest.report import describe_machine, machine_info
from proto import wire

MIB = 1 << 20
PING_EVERY_S = 0.010


def _pinger(host: str, port: int, ready, stop, out) -> None:
    client = redis.Redis(host, port, socket_timeout=30)
    client.ping()
    ready.set()
    times = []
    while not stop.is_set():
        start = time.perf_counter()
        client.ping()
        times.append((time.perf_counter() - start) * 1000)
        time.sleep(max(0.0, PING_EVERY_S - (time.perf_counter() - start)))
    out.put(times)


class Pinger:
    """A separate process that PINGs the server every 10 ms while the block runs."""

    def __init__(self, host: str, port: int):
        ctx = multiprocessing.get_context("spawn")
        self.ready, self.stop, self.out = ctx.Event(), ctx.Event(), ctx.Queue()
        self.proc = ctx.Process(target=_pinger, args=(host, port, self.ready, self.stop, self.out), daemon=True)
        self.times: list[float] = []

    def __enter__(self) -> Pinger:
        self.proc.start()
        if not self.ready.wait(60):
            raise RuntimeError("the PING process did not start")
        time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.times = self.out.get(timeout=60)
        self.proc.join(10)

    def summary(self) -> tuple[float, float, int]:
        t = np.array(self.times or [0.0])
        return float(t.max()), float(np.percentile(t, 99)), len(t)


def median_result(results: list[Result]) -> Result:
    """Per figure, the median over repeated runs (flags and texts: the last run's)."""
    def median(values):
        return float(np.median(values)) if all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               for v in values) else values[-1]
    extra = {}
    for key, last in results[-1].extra.items():
        if isinstance(last, dict):
            extra[key] = {k: median([r.extra[key][k] for r in results]) for k in last}
        else:
            extra[key] = median([r.extra[key] for r in results])
    return Result(median([r.ping_max for r in results]), median([r.ping_p99 for r in results]),
                  sum(r.pings for r in results), extra)


def chunk(size: int) -> int:
    """kvstore's rounded size of a value (power of two, at least 64 bytes)."""
    return max(64, 1 << (size - 1).bit_length())


def lru_keeps(sizes: list[int], small: list[bool], budget: int) -> int:
    """How many small values exact LRU by rounded bytes keeps after writes in this order."""
    total, kept = 0, 0
    for size, is_small in zip(reversed(sizes), reversed(small)):
        total += chunk(size)
        if total > budget:
            break
        kept += is_small
    return kept


def pipelined(client: redis.Redis, commands, batch: int = 1000) -> None:
    pipe = client.pipeline(transaction=False)
    for n, args in enumerate(commands, 1):
        pipe.execute_command(*args)
        if n % batch == 0:
            pipe.execute()
    pipe.execute()


def count_present(client: redis.Redis, keys: list[bytes], batch: int = 2000) -> int:
    return sum(client.exists(*keys[i:i + batch]) for i in range(0, len(keys), batch))


@dataclass
class Result:
    ping_max: float = 0.0
    ping_p99: float = 0.0
    pings: int = 0
    extra: dict = field(default_factory=dict)


def burst(client: redis.Redis, host: str, port: int, settings) -> Result:
    n, big = settings.small, settings.big
    keys = [b"s%07d" % i for i in range(n)]
    pipelined(client, ((b"SET", key, b"x" * 100) for key in keys))
    value = os.urandom(MIB)
    with Pinger(host, port) as pinger:
        for i in range(big):
            client.set(b"big%03d" % i, value)
    left = count_present(client, keys)
    lru = lru_keeps([100] * n + [MIB] * big, [True] * n + [False] * big, settings.budget)
    return Result(*pinger.summary(), extra={"small_left": left, "lru_small_left": lru, **eviction_figures(client)})


def chain(client: redis.Redis, host: str, port: int, settings, kvstore: bool) -> Result:
    n = settings.small
    keys = [b"c%07d" % i for i in range(n)]
    if kvstore:
        pipelined(client, ((wire.KV_PUT, key, b"x" * 100, "PARENT", keys[i - 1]) if i else (wire.KV_PUT, key, b"x" * 100)
                           for i, key in enumerate(keys)))
    else:
        pipelined(client, ((b"SET", key, b"x" * 100) for key in keys))
    value = os.urandom(MIB)
    writes = settings.big
    with Pinger(host, port) as pinger:
        for i in range(writes):
            client.set(b"big%03d" % i, value)
    present = [bool(x) for x in pipeline_exists(client, keys)]
    kept = sum(present)
    prefix = present == [True] * kept + [False] * (n - kept)
    return Result(*pinger.summary(), extra={"chain_left": kept, "prefix": prefix, **eviction_figures(client)})


def eviction_figures(client: redis.Redis) -> dict:
    """kvstore's own account of eviction: the longest turn it spent evicting, deferrals."""
    info = client.info("memory")
    if "eviction_max_turn_ms" not in info:
        return {}
    return {"max_eviction_turn_ms": info["eviction_max_turn_ms"], "deferrals": info["eviction_deferrals"],
            "eviction_s": info["eviction_seconds"]}


def pipeline_exists(client: redis.Redis, keys: list[bytes], batch: int = 2000) -> list[int]:
    out = []
    for i in range(0, len(keys), batch):
        pipe = client.pipeline(transaction=False)
        for key in keys[i:i + batch]:
            pipe.exists(key)
        out.extend(pipe.execute())
    return out


def mixed(client: redis.Redis, host: str, port: int, settings) -> Result:
    rng = np.random.default_rng(11)
    budget = settings.budget
    sizes = []
    while sum(sizes) < 4 * budget:
        if rng.random() < 0.7:
            sizes.append(int(np.exp(rng.uniform(np.log(64), np.log(4096)))))
        else:
            sizes.append(int(np.exp(rng.uniform(np.log(256 * 1024), np.log(4 * MIB)))))
    keys = len(sizes)
    weights = 1.0 / np.arange(1, keys + 1) ** 0.9
    order = rng.permutation(keys)                       # popularity independent of size
    picks = order[rng.choice(keys, size=settings.ops, p=weights / weights.sum())]
    blob = os.urandom(4 * MIB)
    hits = gets = 0
    warm = settings.ops // 3
    with Pinger(host, port) as pinger:
        for n, k in enumerate(picks):
            key = b"m%06d" % k
            got = client.get(key) is not None
            if n >= warm:
                gets += 1
                hits += got
            if not got:
                client.set(key, blob[:sizes[k]])
    info = client.info("memory")
    dataset = info.get("used_memory_dataset", 0)
    extra = {"hit_ratio": hits / gets, "live_value_bytes_over_budget": dataset / budget, "keys": keys}
    if "mem_footprint" in info:
        extra["handed_out_over_budget"] = info["used_memory"] / budget
        extra["evictions_by_cause"] = {c: info.get(f"evicted_keys_{c}") for c in ("for_small", "for_big",
                                                                                  "beyond_region", "other")}
        extra.update(eviction_figures(client))
    return Result(*pinger.summary(), extra=extra)


@dataclass
class Settings:
    small: int = 200_000
    big: int = 100
    budget: int = 64 * MIB
    ops: int = 3000


TENANT_VALUE = 16 * 1024
LMCACHE_DATA = 4                # chunk bytes put, in budgets


def tenants(client: redis.Redis, host: str, port: int, settings, quotas: bool) -> Result:
    share = settings.budget // 3
    for user in ("quiet", "burst"):
        client.execute_command("ACL", "SETUSER", user, "on", f">{user}", f"~{user}:*", "+@all")
        if quotas:
            client.execute_command("ACL", "SETUSER", user, f"quota-dram={share}")
    quiet = redis.Redis(host, port, username="quiet", password="quiet", socket_timeout=120)
    burst = redis.Redis(host, port, username="burst", password="burst", socket_timeout=120)
    value = os.urandom(TENANT_VALUE)
    keys = [b"quiet:%07d" % i for i in range(share * 9 // 10 // TENANT_VALUE)]
    pipelined(quiet, ((b"SET", key, value) for key in keys), batch=200)
    with Pinger(host, port) as pinger:
        pipelined(burst, ((b"SET", b"burst:%07d" % i, value) for i in range(10 * share // TENANT_VALUE)), batch=200)
    kept = count_present(quiet, keys)
    quiet.close()
    burst.close()
    return Result(*pinger.summary(), extra={"quiet_kept": kept, "quiet_written": len(keys),
                                            "quiet_kept_share": round(kept / len(keys), 4)})


def orphans(client: redis.Redis) -> tuple[int, int, int]:
    """LMCache chunks in the store: (whole, `metadata` keys without their `kv_bytes`, `kv_bytes`
    without their `metadata`)."""
    metadata = {k[:-len(b"metadata")] for k in client.scan_iter(match=b"*metadata", count=1000)}
    kv_bytes = {k[:-len(b"kv_bytes")] for k in client.scan_iter(match=b"*kv_bytes", count=1000)}
    return len(metadata & kv_bytes), len(metadata - kv_bytes), len(kv_bytes - metadata)


def lmcache(client: redis.Redis, host: str, port: int, settings) -> Result:
    import torch

    from loadtest.bench_lmcache import Rig      # LMCache and torch: only this scenario pays their import
    torch.set_num_threads(1)                    # the client makes its chunks on one core: two are the host's
    rig = Rig(layers=4, tokens=256, hidden=128, cpu_bytes=48 * MIB)       # 512 KiB chunks
    try:
        connector, backend = rig.connector(f"redis://{host}:{port}")
        count = LMCACHE_DATA * settings.budget // rig.chunk_bytes
        with Pinger(host, port) as pinger:
            for start in range(0, count, 8):
                ids = range(start, min(count, start + 8))
                rig.run(connector.batched_put([rig.key(i) for i in ids], [rig.chunk(backend, i) for i in ids]))
        whole, lone_metadata, lone_kv = orphans(client)
        eviction = eviction_figures(client)
        hits = wrong = 0
        for i in range(count):
            got = rig.run(connector.get(rig.key(i)))
            if got is not None:
                hits += rig.right(i, got)
                wrong += not rig.right(i, got)
                got.ref_count_down()
    finally:
        rig.close()
    return Result(*pinger.summary(), extra={"chunks": count, "whole": whole, "orphaned_metadata": lone_metadata,
                                            "orphaned_kv_bytes": lone_kv, "read_hits": hits, "wrong_chunks": wrong,
                                            **eviction})


def run_one(name: str, scenario: str, settings: Settings, group: ProcessGroup) -> Result:
    memory = f"{settings.budget // MIB}mb"
    server = start_redis(group, memory) if name == "redis" else start_kvstore(group, memory)
    client = redis.Redis(server.host, server.port, socket_timeout=120)
    try:
        if scenario == "burst":
            return burst(client, server.host, server.port, settings)
        if scenario == "chain":
            return chain(client, server.host, server.port, settings, name == "kvstore")
        if scenario == "tenants":
            return tenants(client, server.host, server.port, settings, name == "kvstore+quotas")
        if scenario == "lmcache":
            return lmcache(client, server.host, server.port, settings)
        return mixed(client, server.host, server.port, settings)
    finally:
        client.close()
        group.stop(server.process)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer values and operations")
    parser.add_argument("--only", default="burst,chain,mixed,tenants,lmcache")
    parser.add_argument("--repeat", type=int, help="runs per server and scenario, medians printed (3; --quick 1)")
    args = parser.parse_args(argv)
    settings = Settings(small=50_000, big=40, budget=16 * MIB, ops=1200) if args.quick else Settings()
    repeat = args.repeat or (1 if args.quick else 3)
    print(describe_machine(machine_info()))
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    ok = True
    with ProcessGroup() as group:
        for scenario in args.only.split(","):
            names = ("redis", "kvstore", "kvstore+quotas") if scenario == "tenants" else ("redis", "kvstore")
            runs = {name: [] for name in names}
            for _ in range(repeat):
                for name in names:
                    runs[name].append(run_one(name, scenario, settings, group))
            results = {name: median_result(got) for name, got in runs.items()}
            kv, rd = results["kvstore"], results["redis"]
            print(f"\n[{scenario}] budget {settings.budget // MIB} MiB, load average {os.getloadavg()[0]:.2f}, "
                  f"medians of {repeat} runs")
            for name, r in results.items():
                print(f"  {name:14s} PING max {r.ping_max:8.2f} ms  p99 {r.ping_p99:7.2f} ms  ({r.pings} pings)  {r.extra}")
            print(f"  kvstore/redis  PING max {kv.ping_max / max(rd.ping_max, 1e-9):.2f}x  "
                  f"p99 {kv.ping_p99 / max(rd.ping_p99, 1e-9):.2f}x")
            if scenario == "burst":
                ok &= kv.extra["small_left"] >= kv.extra["lru_small_left"]
            if scenario == "chain":
                ok &= kv.extra["prefix"]
            if scenario == "tenants":
                quota = results["kvstore+quotas"].extra
                print(f"  quiet tenant keeps {quota['quiet_kept_share']:.1%} of its blocks with quotas "
                      f"({kv.extra['quiet_kept_share']:.1%} without, redis {rd.extra['quiet_kept_share']:.1%})")
                ok &= quota["quiet_kept_share"] >= 0.95
            if scenario == "mixed":
                print(f"  hit ratio kvstore/redis {kv.extra['hit_ratio'] / max(rd.extra['hit_ratio'], 1e-9):.2f}x")
            if scenario == "lmcache":
                print(f"  orphaned metadata keys: kvstore {kv.extra['orphaned_metadata']}, redis "
                      f"{rd.extra['orphaned_metadata']} (target: fewer than redis); wrong chunks read: kvstore "
                      f"{kv.extra['wrong_chunks']}, redis {rd.extra['wrong_chunks']} (target 0)")
                ok &= kv.extra["wrong_chunks"] == 0 and kv.extra["orphaned_metadata"] <= rd.extra["orphaned_metadata"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
