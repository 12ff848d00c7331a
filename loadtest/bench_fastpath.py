"""Fast-path figures: each one a ratio against a reference measured in the same run.

    python -m loadtest.bench_fastpath [--runs 5] [--quick] [--shmem-hugepages advise]

The reference is what moving the bytes costs at best: a numpy copy of the same
size from a source that is *not* in the CPU cache (slices of a pool eight times
the last-level cache, taken in turn), which is what a block read once costs.
Each sample of a figure is paired with a reference copy taken right before it,
so a slow spell on this shared host hits both; a figure is the median of the
pairs' ratios in a run, then the median over runs (with the spread over runs).

- first get: ``get_into`` of a key this client has never read (keys put
  beforehand over the whole pool, each read once, so its bytes are cold too):
  through the node's shared index, no round trip (targets: >= 0.6x the cold
  copy at 1 MiB, >= 0.8x at 4 MiB); the same over KV.LEASE for comparison;
  the copy out of the arena alone, with no SDK around it (the floor: the
  arena's 4 KiB shared-memory pages cost more TLB misses than the numpy
  pool's transparent huge pages);
  and against Mooncake Store's get of the same size through its CPU wheel
  (master + holder process, TCP: >= 5x), when the wheel is installed. Its
  client runs in a process of its own after the other figures (its library's
  threads would otherwise share this process's two cores with the gets);
- warm get: a repeated get of one key vs a copy from a source in cache
  (>= 0.7x, as before the shared index);
- put of one fresh key from a cold source (>= 0.5x the cold copy at 1 MiB),
  beside its floor, the put's copy alone into extents reserved beforehand
  (fresh memory no cache holds, where the reference's destination stays in
  cache), and ``batch_put`` of 256 x 1 MiB (time within 1.5x of 256 cold
  copies, whose destinations are not in cache either);
- ``batch_get_into`` of 256 x 1 MiB vs 256 cold copies (time within 1.5x);
- layer-wise: a writer process puts 32 layers while this process reads them
  one by one: time to the first layer vs time to the whole block.

The host's load average is printed first. The store gets a Unix socket and a
1 GiB arena; ``--quick`` runs once with fewer samples (under a minute).
``--shmem-hugepages MODE`` (root) sets the host's shmem huge-page setting
(``/sys/kernel/mm/transparent_hugepage/shmem_enabled``) for the run and puts
the old one back afterwards, however the run ends; the node's INFO
``arena_hugepages`` / ``arena_page_size`` are printed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from client import KVClient
from loadtest.procs import ProcessGroup, start_kvstore, start_mooncake
from loadtest.report import one_line
from proto import fastpath as fp
from proto import hugepages

MIB = 1 << 20
LAYERS = 32
BATCH = 256
ROOT = str(Path(__file__).resolve().parents[1])

MOONCAKE_GETS = """
import os, statistics, sys, time
from loadtest.bench_vs_redis import MooncakeClient
master, metadata, log, size, count = sys.argv[1:4] + [int(a) for a in sys.argv[4:6]]
client = MooncakeClient(master, metadata, log)
value = os.urandom(size)
keys = [f"first-{size}-{i}" for i in range(count)]
for key in keys:
    client.store.put(key, value)
times = []
for key in keys:
    start = time.perf_counter()
    got = client.store.get(key)
    times.append(time.perf_counter() - start)
    assert len(got) == size, len(got)
client.store.remove_all()
client.close()
print(statistics.median(times), flush=True)
"""

WRITER = """
import sys, time, numpy as np
from client import KVClient
kv = KVClient(unix_socket=sys.argv[1])
layer = np.ones({size}, np.uint8)
kv.fast_path.arena()                      # map the arena before the clock starts
print("ready", flush=True)
sys.stdin.readline()
for i in range({layers}):
    kv.put_layer(sys.argv[2], i, layer, n_layers={layers})
"""

TARGETS = {"get_into 1MiB first get vs cold copy": (">=", 0.6),
           "get_into 4MiB first get vs cold copy": (">=", 0.8),
           "get_into 1MiB first get vs Mooncake get": (">=", 5.0),
           "get_into 4MiB first get vs Mooncake get": (">=", 5.0),
           "get_into 1MiB warm vs in-cache copy": (">=", 0.7),
           "get_into 4MiB warm vs in-cache copy": (">=", 0.7),
           "put 1MiB vs cold copy": (">=", 0.5),
           f"batch_put {BATCH}x1MiB time / {BATCH} cold copies": ("<=", 1.5),
           f"batch_get_into {BATCH}x1MiB time / {BATCH} cold copies": ("<=", 1.5)}


def last_level_cache() -> int:
    """The largest CPU cache in bytes (32 MiB when the system does not say)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": MIB}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * scale)
    return max(sizes, default=32 * MIB)


class ColdPool:
    """Slices of a buffer far larger than the last-level cache, handed out in turn: a slice
    comes back only after the whole pool has been read, so it is never in cache."""

    def __init__(self, nbytes: int):
        self.data = np.arange(nbytes // 8, dtype=np.uint64).view(np.uint8)
        self._next = 0

    def take(self, size: int) -> np.ndarray:
        if self._next + size > self.data.nbytes:
            self._next = 0
        piece = self.data[self._next:self._next + size]
        self._next += size
        return piece

    def slices(self, size: int) -> int:
        return self.data.nbytes // size


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paired(pool: ColdPool, size: int, count: int, dst: np.ndarray, step) -> tuple[list[float], list[float]]:
    """``count`` pairs: a cold copy of ``size`` into ``dst``, then ``step(i, source)`` with
    another cold slice; the two lists of seconds."""
    copies, steps = [], []
    for i in range(count):
        copies.append(timed(lambda: np.copyto(dst, pool.take(size))))
        source = pool.take(size)
        steps.append(timed(lambda: step(i, source)))
    return copies, steps


def ratio(reference: list[float], measured: list[float]) -> float:
    """Median of the pairs' ratios reference / measured (above 1: faster than the reference)."""
    return statistics.median(r / m for r, m in zip(reference, measured))


def first_gets(kv: KVClient, leasing: KVClient, pool: ColdPool, size: int, run: int,
               samples: int) -> dict[str, float]:
    """Gets of keys never read before, through the shared index and over KV.LEASE."""
    name, out = f"{size // MIB}MiB", {}
    dst = np.empty(size, np.uint8)
    keys = [f"first-{run}-{size}-{i}" for i in range(samples)]
    for key in keys:
        kv.put(key, pool.take(size))
    arena, view = kv.fast_path.arena(), memoryview(dst)
    places = [arena.index.find(key.encode())[2] for key in keys]
    sides = {"first get": lambda i, _: kv.get_into(keys[i], dst),
             "first get over KV.LEASE": lambda i, _: leasing.get_into(keys[i], dst),
             "arena memcpy alone": lambda i, _: arena.read_into(places[i], size, view)}
    for side, step in sides.items():
        copies, gets = paired(pool, size, samples, dst, step)
        out[f"get_into {name} {side} vs cold copy"] = ratio(copies, gets)
        out[f"get_into {name} {side} us"] = statistics.median(gets) * 1e6
        out.setdefault(f"cold copy {name} us", statistics.median(copies) * 1e6)
    kv.delete(*keys)
    return out


def warm_get(kv: KVClient, size: int, samples: int) -> dict[str, float]:
    """A repeated get of one key vs a copy whose source is in cache (both sides warm)."""
    name = f"{size // MIB}MiB"
    src, dst = np.ones(size, np.uint8), np.empty(size, np.uint8)
    kv.put(f"warm{size}", src, overwrite=True)
    kv.get_into(f"warm{size}", dst)
    copies, gets = [], []
    for _ in range(samples):
        copies.append(timed(lambda: np.copyto(dst, src)))
        gets.append(timed(lambda: kv.get_into(f"warm{size}", dst)))
    return {f"get_into {name} warm vs in-cache copy": ratio(copies, gets),
            f"get_into {name} warm us": statistics.median(gets) * 1e6}


def puts(kv: KVClient, pool: ColdPool, size: int, run: int, samples: int) -> dict[str, float]:
    """Puts of fresh keys (each a new block) from cold sources, and a put's copy alone: into
    extents reserved beforehand, with no SDK and no round trip (the floor: a put writes into
    memory no cache holds, the reference into a destination it holds)."""
    name, dst = f"{size // MIB}MiB", np.empty(size, np.uint8)
    keys = [f"put-{run}-{size}-{i}" for i in range(samples)]
    copies, stores = paired(pool, size, samples, dst, lambda i, source: kv.put(keys[i], source))
    kv.delete(*keys)
    arena = kv.fast_path.arena()
    extents = kv.execute(fp.KV_RESERVE, arena.token, 60_000, *[size] * samples)
    alone = paired(pool, size, samples, dst, lambda i, source: arena.write(extents[i][1], source))
    kv.execute(fp.KV_UNRESERVE, *(reservation for reservation, _ in extents))
    return {f"put {name} vs cold copy": ratio(copies, stores), f"put {name} us": statistics.median(stores) * 1e6,
            f"put {name} copy into a fresh extent alone vs cold copy": ratio(*alone),
            f"put {name} copy into a fresh extent alone us": statistics.median(alone[1]) * 1e6}


def batches(kv: KVClient, pool: ColdPool, run: int, repeats: int) -> dict[str, float]:
    """batch_put and batch_get_into of BATCH x 1 MiB vs BATCH cold copies into one array."""
    rows = np.ones((BATCH, MIB), np.uint8)
    into = list(rows)

    def copies() -> float:
        return timed(lambda: [np.copyto(row, pool.take(MIB)) for row in into])
    put_pairs, get_pairs = [], []
    for repeat in range(repeats):
        keys = [f"batch-{run}-{repeat}-{i}" for i in range(BATCH)]
        sources = [pool.take(MIB) for _ in range(BATCH)]
        put_pairs.append((copies(), timed(lambda: kv.batch_put(zip(keys, sources)))))
        get_pairs.append((copies(), timed(lambda: kv.batch_get_into(keys, into))))
        kv.delete(*keys)
    return {f"batch_put {BATCH}x1MiB time / {BATCH} cold copies": statistics.median(p / c for c, p in put_pairs),
            f"batch_get_into {BATCH}x1MiB time / {BATCH} cold copies":
                statistics.median(g / c for c, g in get_pairs)}


def layerwise(kv: KVClient, sock: str, run: int) -> dict[str, float]:
    key = f"layered-{run}"
    writer = subprocess.Popen([sys.executable, "-c", WRITER.format(size=MIB, layers=LAYERS), sock, key],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    writer.stdout.readline()
    into = np.empty((LAYERS, MIB), np.uint8)
    start = time.perf_counter()
    writer.stdin.write("go\n")
    writer.stdin.flush()
    kv.get_layers(key, 0, 1, into=into[0], wait=4)
    first = time.perf_counter() - start
    for layer in range(1, LAYERS):
        kv.get_layers(key, layer, layer + 1, into=into[layer], wait=4)
    whole = time.perf_counter() - start
    writer.wait(30)
    return {"layer-wise first layer ms": first * 1e3, "layer-wise whole block ms": whole * 1e3,
            "layer-wise first / whole": first / whole}


def mooncake_gets(group: ProcessGroup, runs: list[dict[str, float]], quick: bool) -> list[str]:
    """Mooncake Store's get of 1 MiB and 4 MiB (median, its own process) against the median
    first get of the runs, added to every run; notes on what was not measured."""
    try:
        import mooncake.store  # noqa: F401  (fails fast when the wheel or libibverbs1 is missing)
        cluster = start_mooncake(group, 1 << 30)
        for size in (MIB, 4 * MIB):
            name, count = f"{size // MIB}MiB", (16 if quick else 48) // (size // MIB) + 4
            argv = [cluster.master_address, cluster.metadata_url, str(group.log_dir / "mooncake.log"),
                    str(size), str(count)]
            done = subprocess.run([sys.executable, "-c", MOONCAKE_GETS, *argv], cwd=ROOT, capture_output=True,
                                  text=True, timeout=300, check=True)
            theirs = float(done.stdout.split()[-1]) * 1e6
            ours = statistics.median(r[f"get_into {name} first get us"] for r in runs)
            for run in runs:
                run[f"Mooncake get {name} us"] = theirs
                run[f"get_into {name} first get vs Mooncake get"] = theirs / ours
        return []
    except (ImportError, OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return [f"Mooncake Store not measured: {one_line(exc, 200)}"]


def one_run(kv: KVClient, leasing: KVClient, pool: ColdPool, sock: str, run: int, quick: bool) -> dict[str, float]:
    out = {}
    for size in (MIB, 4 * MIB):
        samples = min(pool.slices(size) // 2, 48 if quick else 128)
        out.update(first_gets(kv, leasing, pool, size, run, samples))
        out.update(warm_get(kv, size, 50 if quick else 200))
        out.update(puts(kv, pool, size, run, samples))
    out.update(batches(kv, pool, run, 3 if quick else 5))
    out.update(layerwise(kv, sock, run))
    return out


def verdict(name: str, value: float) -> str:
    op, bound = TARGETS.get(name, ("", None))
    if bound is None:
        return ""
    met = value >= bound if op == ">=" else value <= bound
    return f"{op} {bound:<4}  " + ("met" if met else "MISSED")


def report(runs: list[dict[str, float]], notes: list[str]) -> None:
    print(f"{'figure':52} {'median':>9} {'runs min-max':>15}  target")
    for name in runs[0]:
        values = [r[name] for r in runs if name in r]
        spread = f"{min(values):.2f}-{max(values):.2f}"
        value = statistics.median(values)
        print(f"{name:52} {value:9.2f} {spread:>15}  {verdict(name, value)}")
    for note in notes:
        print(note)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one run, fewer samples: under a minute")
    parser.add_argument("--shmem-hugepages", choices=["never", "advise", "within_size", "always"],
                        help="the host's shmem THP setting for this run (root; restored afterwards)")
    args = parser.parse_args(argv)
    if args.shmem_hugepages is None:
        return bench(args)
    before = hugepages.shmem_mode()
    Path(hugepages.SHMEM_ENABLED).write_text(args.shmem_hugepages)
    try:
        print(f"shmem huge pages: {before} -> {hugepages.shmem_mode()} for this run", flush=True)
        return bench(args)
    finally:
        Path(hugepages.SHMEM_ENABLED).write_text(before)
        print(f"shmem huge pages restored: {hugepages.shmem_mode()}")


def bench(args: argparse.Namespace) -> int:
    runs = 1 if args.quick else args.runs
    print("load average at start: %.2f %.2f %.2f (%d CPUs)" % (*os.getloadavg(), os.cpu_count()), flush=True)
    pool = ColdPool(8 * last_level_cache())
    notes = [f"cold copies rotate over {pool.data.nbytes // MIB} MiB (8x the last-level cache)"]
    with ProcessGroup() as group:
        sock = str(group.log_dir / "kv.sock")
        start_kvstore(group, "1gb", "{python} -m kvstore serve --port {port} --dram-size {memory} "
                      f"--unixsocket {sock}")
        kv = KVClient(unix_socket=sock, fast_path="required", timeout=30)
        leasing = KVClient(unix_socket=sock, fast_path="required", timeout=30)
        leasing.fast_path.index_reads = False             # every first get asks the node (KV.LEASE)
        leasing.fast_path.cache_entries = 0               # and keeps no lease
        info = bytes(kv.execute("INFO", "kvcache")).decode()
        notes += [line.strip() for line in info.splitlines() if line.startswith("arena_")]
        notes.append(f"client mapping: hugepages {kv.fast_path.arena().hugepages}")
        try:
            results = [one_run(kv, leasing, pool, sock, run, args.quick) for run in range(runs)]
        finally:
            kv.close()
            leasing.close()
        notes += mooncake_gets(group, results, args.quick)
    report(results, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
