"""Put figures: `put_nowait` streams and the synchronous `put` against their own limits.

    python -m loadtest.bench_puts [--runs 3] [--quick] [--size-mib 1] [--profile]

Each figure is a ratio against a reference measured in the same run, sample by
sample (a reference right before each measured step, so a slow spell on this
shared host hits both), median over the pairs, then median over runs:

- ``put_nowait`` stream: fresh keys from cold sources (slices of a pool eight
  times the last-level cache, as in `bench_fastpath`), each call vs a numpy copy
  of the same size from a cold source (target >= 0.5x); the whole stream with
  its final `flush` vs as many cold copies is printed beside it;
- synchronous ``put`` vs its own limit: a copy of the same size from a cold
  source into pre-faulted memory no cache holds (a second rotating pool) plus
  one PING round trip on a connection of the same client (target >= 0.8x).

The host's load average is printed first and last. ``--profile`` prints the
top of a cProfile of synchronous puts instead.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import numpy as np

from client import KVClient
from loadtest.bench_fastpath import ColdPool, last_level_cache, ratio, timed
from loadtest.procs import ProcessGroup, start_kvstore

MIB = 1 << 20
TARGETS = {"put_nowait vs cold copy": 0.5, "put vs (uncached copy + PING)": 0.8}


def load() -> str:
    return "load average %.2f %.2f %.2f (%d CPUs)" % (*os.getloadavg(), os.cpu_count())


def nowait_stream(kv: KVClient, pool: ColdPool, size: int, run: int, samples: int) -> dict[str, float]:
    dst = np.empty(size, np.uint8)
    keys = [f"nowait-{run}-{i}" for i in range(samples)]
    copies, puts = [], []
    started = time.perf_counter()
    for key in keys:
        copies.append(timed(lambda: np.copyto(dst, pool.take(size))))
        source = pool.take(size)
        puts.append(timed(lambda: kv.put_nowait(key, source)))
    kv.flush()
    stream = time.perf_counter() - started - sum(copies)
    kv.delete(*keys)
    return {"put_nowait vs cold copy": ratio(copies, puts), "put_nowait us": statistics.median(puts) * 1e6,
            "cold copy us": statistics.median(copies) * 1e6,
            "stream incl. flush / cold copies (time)": stream / sum(copies)}


def sync_puts(kv: KVClient, pool: ColdPool, sinks: ColdPool, size: int, run: int, samples: int) -> dict[str, float]:
    keys = [f"sync-{run}-{i}" for i in range(samples)]
    limits, copies, pings, puts = [], [], [], []
    with kv._transport.connection() as conn:
        conn.round_trip([("PING",)])
    for key in keys:
        copy = timed(lambda: np.copyto(sinks.take(size), pool.take(size)))
        with kv._transport.connection() as conn:          # the connection the put then borrows
            ping = timed(lambda: conn.round_trip([("PING",)]))
        source = pool.take(size)
        puts.append(timed(lambda: kv.put(key, source)))
        copies.append(copy)
        pings.append(ping)
        limits.append(copy + ping)
    kv.delete(*keys)
    return {"put vs (uncached copy + PING)": ratio(limits, puts), "put us": statistics.median(puts) * 1e6,
            "uncached copy us": statistics.median(copies) * 1e6, "PING us": statistics.median(pings) * 1e6}


def profile(kv: KVClient, pool: ColdPool, size: int, samples: int) -> None:
    keys = [f"prof-{i}" for i in range(samples)]
    sources = [pool.take(size) for _ in keys]
    profiler = cProfile.Profile()
    profiler.enable()
    for key, source in zip(keys, sources):
        kv.put(key, source)
    profiler.disable()
    kv.delete(*keys)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one run, fewer samples")
    parser.add_argument("--size-mib", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    size = args.size_mib * MIB
    runs = 1 if args.quick else args.runs
    samples = 48 if args.quick else 128
    print("at start:", load(), flush=True)
    pool, sinks = ColdPool(8 * last_level_cache()), ColdPool(8 * last_level_cache())
    sinks.data[:] = 1                                       # pre-faulted
    with ProcessGroup() as group:
        sock = str(group.log_dir / "kv.sock")
        start_kvstore(group, "1gb", "{python} -m kvstore serve --port {port} --dram-size {memory} "
                      f"--unixsocket {sock}")
        with KVClient(unix_socket=sock, fast_path="required", timeout=30) as kv:
            for i in range(8):                              # map the arena, spares of this size
                kv.put(f"warmup-{i}", pool.take(size))
            if args.profile:
                profile(kv, pool, size, samples)
                return 0
            results = []
            for run in range(runs):
                out = nowait_stream(kv, pool, size, run, samples)
                out.update(sync_puts(kv, pool, sinks, size, run, samples))
                results.append(out)
    print(f"{'figure (' + str(args.size_mib) + ' MiB values)':44} {'median':>9} {'runs min-max':>15}  target")
    for name in results[0]:
        values = [r[name] for r in results]
        value = statistics.median(values)
        target = TARGETS.get(name)
        verdict = "" if target is None else f">= {target}  " + ("met" if value >= target else "MISSED")
        print(f"{name:44} {value:9.3f} {min(values):7.3f}-{max(values):<7.3f}  {verdict}")
    print("at end:", load())
    return 0


if __name__ == "__main__":
    sys.exit(main())
