"""The SSD tier next to raw rocksdict on the same disk, in the same run.

    python -m loadtest.bench_ssd_raw [--quick] [--dir DIR] [--repeats N] [--no-wal]
                                     [--markdown] [--json FILE]

What it prints (``--repeats`` runs, each in fresh RocksDB directories under
``--dir``; within a run the stores are open side by side and take turns on
chunks of 4 values, so load from other processes on a shared host falls on
all of them alike; a ratio is the median of the per-run ratios):

- put and get throughput (GB/s) of 256 KiB and 1 MiB incompressible values
  through ``SSDTier`` against raw rocksdict (``Rdict[key] = value``) with the
  same WAL setting and RocksDB's block compression off, so the ratio is the
  cost of the tier's own work (header, xxh3, lz4 probe, second column
  family); raw rocksdict with its default options is a third column. Target
  (issue 3): ratio >= 0.8 for reads and writes. Gets read every key once,
  in random order, after every store was closed and opened again (from SST
  files in the page cache, not from the memtable or a block cache).
- the same per CPU-second of the thread doing them (a cost that holds whatever
  else the host runs).
- puts through ``SSDWorker`` with 16 puts in flight (group commit).
- lz4 on bf16-like and fp16-like noise with and without byte-shuffle: the
  size ratio (stored/raw) and the encode and decode speed.
- a warm restart: open plus ``scan_index`` over 100,000 stored values.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
from rocksdict import DBCompressionType, Options, Rdict, WriteOptions

from kvstore.tiers.record import decode, encode
from kvstore.tiers.ssd import SSDTier
from kvstore.tiers.ssd_worker import SSDWorker
from loadtest.report import Table, Target, machine_info

TIER, RAW, RAW_DEFAULTS = "SSDTier", "rocksdict", "rocksdict defaults"
STORES = (TIER, RAW, RAW_DEFAULTS)
CHUNK = 4           # values one store handles before the next takes its turn
KIB, MIB = 1 << 10, 1 << 20
GB = 1e9


@dataclass(frozen=True)
class Settings:
    repeats: int = 5
    sizes: tuple[int, ...] = (256 * KIB, MIB)
    bytes_per_run: int = 384 * MIB
    wal: bool = True
    in_flight: int = 16
    noise_bytes: int = 32 * MIB
    restart_values: int = 100_000
    restart_value_size: int = 4 * KIB

    def quick(self) -> Settings:
        return replace(self, repeats=1, bytes_per_run=32 * MIB, noise_bytes=4 * MIB, restart_values=10_000)


class Store:
    """One side of the comparison: how to open it, put, get, close."""

    def __init__(self, name: str, path: str, wal: bool):
        self.name, self.path, self.wal = name, path, wal
        if name == TIER:
            tier = SSDTier.open(path, 1 << 40, wal=wal)
            self.put, self.get, self.close = tier.put, tier.get, tier.close
            return
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        if name == RAW:
            options.set_compression_type(DBCompressionType.none())
        db = Rdict(path, options)
        write_options = WriteOptions()
        write_options.disable_wal = not wal
        db.set_write_options(write_options)
        self.put, self.get, self.close = db.__setitem__, db.get, db.close

    def reopen(self) -> Store:
        """Close and open again: later reads come from SST files, not the memtable or block cache."""
        self.close()
        return Store(self.name, self.path, self.wal)

    def run(self, op: str, keys: list[bytes], pool: list[bytes]) -> None:
        """Put (value chosen by key number) or get each key."""
        if op == "put":
            for key in keys:
                self.put(key, pool[int(key) % len(pool)])
        else:
            for key in keys:
                self.get(key)


def value_pool(size: int, count: int = 16) -> list[bytes]:
    rng = np.random.default_rng(size)
    return [rng.bytes(size) for _ in range(count)]


def timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def measure_round(root: str, size: int, settings: Settings) -> dict[str, dict[str, float]]:
    """GB/s of puts then gets of ``bytes_per_run`` of ``size``-byte values, per store.

    The stores are open side by side and take turns on chunks of ``CHUNK``
    values (the order rotating each chunk), so a burst of load from other
    processes on this shared host hits all of them alike.
    """
    pool = value_pool(size)
    keys = [b"%016d" % i for i in range(max(settings.bytes_per_run // size, CHUNK))]
    stores = [Store(name, tempfile.mkdtemp(prefix="bench-", dir=root), settings.wal) for name in STORES]
    seconds = {(store.name, op): 0.0 for store in stores for op in ("put", "get")}
    cpu = dict.fromkeys(seconds, 0.0)       # this thread's CPU (RocksDB's background threads not counted)
    order = random.Random(size).sample(keys, len(keys))
    try:
        for op, sequence in (("put", keys), ("get", order)):
            if op == "get":
                stores = [store.reopen() for store in stores]
            for turn, first in enumerate(range(0, len(sequence), CHUNK)):
                chunk = sequence[first:first + CHUNK]
                for store in stores[turn % 3:] + stores[:turn % 3]:
                    started = time.thread_time()
                    seconds[store.name, op] += timed(lambda: store.run(op, chunk, pool))
                    cpu[store.name, op] += time.thread_time() - started
        for store in stores:
            assert store.get(keys[-1]) == pool[(len(keys) - 1) % len(pool)]
    finally:
        for store in stores:
            store.close()
            shutil.rmtree(store.path, ignore_errors=True)
    moved = len(keys) * size
    return {name: {**{op: moved / seconds[name, op] / GB for op in ("put", "get")},
                   **{f"{op} cpu": moved / cpu[name, op] / GB for op in ("put", "get")}} for name in STORES}


def measure_worker(root: str, size: int, settings: Settings) -> float:
    """GB/s of puts through SSDWorker with ``in_flight`` outstanding puts."""
    pool = value_pool(size)
    count = max(settings.bytes_per_run // size, 1)
    path = tempfile.mkdtemp(prefix="bench-", dir=root)
    tier = SSDTier.open(path, 1 << 40, wal=settings.wal)

    async def drive() -> None:
        worker = SSDWorker(tier)
        pending: set[asyncio.Future] = set()
        for i in range(count):
            pending.add(worker.put(b"%016d" % i, pool[i % len(pool)]))
            if len(pending) >= settings.in_flight:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.gather(*pending)
        worker.close()

    try:
        seconds = timed(lambda: asyncio.run(drive()))
    finally:
        tier.close()
        shutil.rmtree(path, ignore_errors=True)
    return count * size / seconds / GB


def throughput_rows(table: Table, root: str, settings: Settings) -> None:
    for size in settings.sizes:
        label = f"{size // KIB} KiB" if size < MIB else f"{size // MIB} MiB"
        rows = {op: table.row(f"{op} {label}", "GB/s", Target(0.8)) for op in ("put", "get")}
        rows.update({f"{op} cpu": table.row(f"{op} {label}, per CPU-second", "GB/CPU-s") for op in ("put", "get")})
        worker_row = table.row(f"put {label} via SSDWorker, {settings.in_flight} in flight", "GB/s")
        for _ in range(settings.repeats):
            figures = measure_round(root, size, settings)
            for op, row in rows.items():
                for name in STORES:
                    row.add(name, figures[name][op])
            worker_row.add(TIER, measure_worker(root, size, settings))


def noise(kind: str, nbytes: int) -> np.ndarray:
    """Normal noise as bf16 (top half of fp32) or fp16, the bytes a KV block holds."""
    floats = np.random.default_rng(0).standard_normal(nbytes // 2).astype(np.float32)
    if kind == "bf16":
        return (floats.view(np.uint32) >> 16).astype(np.uint16)
    return floats.astype(np.float16).view(np.uint16)


def compression_notes(settings: Settings) -> list[str]:
    notes = []
    block = MIB
    for kind in ("bf16", "fp16"):
        tensor = noise(kind, settings.noise_bytes)
        chunks = [tensor[i:i + block // 2] for i in range(0, len(tensor), block // 2)]
        for shuffle in (False, True):
            encoded = []
            encode_s = timed(lambda: encoded.extend(encode(c, shuffle=shuffle) for c in chunks))
            decode_s = timed(lambda: [decode(h, p) for h, p in encoded])
            stored = sum(h.stored_size for h, _ in encoded)
            decoded = (f"decode {tensor.nbytes / decode_s / GB:.2f} GB/s" if stored < tensor.nbytes
                       else "stored raw, nothing to decode")
            notes.append(f"lz4 on {kind} noise, shuffle {'on ' if shuffle else 'off'}: stored/raw "
                         f"{stored / tensor.nbytes:.3f}, encode {tensor.nbytes / encode_s / GB:.2f} GB/s, "
                         f"{decoded} (1 MiB values)")
    return notes


def restart_note(root: str, settings: Settings) -> str:
    """Open + scan_index of ``restart_values`` values stored and closed earlier."""
    path = tempfile.mkdtemp(prefix="bench-", dir=root)
    value = np.random.default_rng(1).bytes(settings.restart_value_size)
    tier = SSDTier.open(path, 1 << 40, wal=settings.wal)
    for start in range(0, settings.restart_values, 1000):
        stop = min(start + 1000, settings.restart_values)
        tier.put_batch([(b"%032x" % i, value, b"%032x" % (i - 1), None) for i in range(start, stop)])
    tier.close()
    try:
        start = time.perf_counter()
        tier = SSDTier.open(path, 1 << 40)
        opened = time.perf_counter() - start
        recovered = sum(1 for _ in tier.scan_index())
        total = time.perf_counter() - start
        tier.accounted.wait()
        accounted = time.perf_counter() - start
        tier.close()
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return (f"warm restart: {recovered:,} values ({settings.restart_value_size // KIB} KiB each) "
            f"indexed in {total:.2f} s ({recovered / total:,.0f} values/s): open {opened:.2f} s, "
            f"scan_index {total - opened:.2f} s; totals summed in the background by {accounted:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small repeat (a smoke run)")
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where the databases go (the disk measured)")
    parser.add_argument("--repeats", type=int, help="runs per figure (median reported)")
    parser.add_argument("--no-wal", action="store_true", help="both sides write without RocksDB's WAL")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--json", metavar="FILE", help="write every sample as JSON")
    args = parser.parse_args()
    settings = Settings().quick() if args.quick else Settings()
    settings = replace(settings, wal=not args.no_wal)
    if args.repeats:
        settings = replace(settings, repeats=args.repeats)

    machine = machine_info()        # the load average at start, beside the figures
    wal = "with WAL" if settings.wal else "without WAL"
    table = Table(f"SSD tier vs raw rocksdict ({wal}, {args.dir})", TIER, RAW, extras=(RAW_DEFAULTS,))
    throughput_rows(table, args.dir, settings)
    table.notes += compression_notes(settings)
    table.notes.append(restart_note(args.dir, settings))
    table.notes.append(f"medians of {settings.repeats} runs of {settings.bytes_per_run // MIB} MiB each; "
                       f"'{RAW}' has RocksDB block compression off like the tier's payloads, "
                       f"'{RAW_DEFAULTS}' is Options(raw_mode=True) untouched")
    print(table.render_markdown(machine) if args.markdown else table.render_text(machine))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table.to_json(machine), f, indent=1)


if __name__ == "__main__":
    main()
