"""The segment store (kvstore/tiers/segments.py) next to raw rocksdict and a raw preadv.

    python -m loadtest.bench_segments [--dir DIR] [--mib N] [--repeats N]

For 256 KiB and 1 MiB incompressible values, ``--mib`` MiB per store per
repeat, in fresh directories under ``--dir``:

- put: ``SegmentStore.put`` (pwritev of the payload, one small RocksDB put
  with the WAL on) against ``Rdict[key] = value`` with block compression off;
- get after every store was closed and opened again, every key once in random
  order: ``SegmentStore.get_into`` (index lookup, one ``preadv`` into a
  preallocated buffer, xxh3 over it) against ``Rdict.get`` (a new ``bytes``
  each, RocksDB's checksum off as the tier reads) and against a raw
  ``os.preadv`` of the same bytes from one plain file into the same buffer
  (no lookup, no checksum).

The stores take turns within each repeat; a ratio is the median of the
per-repeat ratios. Reads come from the page cache (the files were just
written), as the tier's reads of recent values do.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time

import numpy as np
from rocksdict import DBCompressionType, Options, Rdict, ReadOptions

from kvstore.tiers.segments import SegmentStore

KIB, MIB = 1024, 1024 * 1024


def rdict_options() -> Options:
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    options.set_compression_type(DBCompressionType.none())
    options.set_write_buffer_size(64 << 20)
    return options


def one_repeat(root: str, size: int, total: int) -> dict[str, float]:
    count = max(total // size, 4)
    rng = np.random.default_rng(size)
    values = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(8)]
    keys = [b"key-%08d" % i for i in range(count)]
    out: dict[str, float] = {}
    seg_dir, rd_dir, raw_path = (os.path.join(root, n) for n in ("seg", "rd", "raw"))

    def put_segments():
        index = Rdict(os.path.join(seg_dir, "index"), rdict_options())
        store = SegmentStore(os.path.join(seg_dir, "segments"), index)
        start = time.perf_counter()
        for i, key in enumerate(keys):
            store.put(key, values[i % 8])
        took = time.perf_counter() - start
        store.close()
        index.close()
        return took

    def put_rdict():
        db = Rdict(rd_dir, rdict_options())
        start = time.perf_counter()
        for i, key in enumerate(keys):
            db[key] = values[i % 8]
        took = time.perf_counter() - start
        db.close()
        return took

    def put_raw():
        fd = os.open(raw_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        for i in range(count):
            os.pwrite(fd, values[i % 8], i * size)
        os.close(fd)

    for name, action in (("put segments", put_segments), ("put rdict", put_rdict)):
        out[name] = count * size / action() / 1e9
    put_raw()
    order = list(range(count))
    random.Random(size).shuffle(order)
    buf = np.empty(size, dtype=np.uint8)

    def get_segments():
        index = Rdict(os.path.join(seg_dir, "index"), rdict_options())
        store = SegmentStore(os.path.join(seg_dir, "segments"), index)
        start = time.perf_counter()
        for i in order:
            assert store.get_into(keys[i], buf) == size
        took = time.perf_counter() - start
        store.close()
        index.close()
        return took

    def get_rdict():
        db = Rdict(rd_dir, rdict_options())
        reads = ReadOptions()
        reads.set_verify_checksums(False)
        start = time.perf_counter()
        for i in order:
            assert len(db.get(keys[i], read_opt=reads)) == size
        took = time.perf_counter() - start
        db.close()
        return took

    def get_raw():
        fd = os.open(raw_path, os.O_RDONLY)
        start = time.perf_counter()
        for i in order:
            assert os.preadv(fd, [buf], i * size) == size
        took = time.perf_counter() - start
        os.close(fd)
        return took

    for name, action in (("get segments", get_segments), ("get rdict", get_rdict), ("get raw preadv", get_raw)):
        out[name] = count * size / action() / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--mib", type=int, default=128, help="MiB written per store per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f}, nproc: {os.cpu_count()}")
    print("| size | put segments GB/s | put rdict GB/s | put seg/rdict | get segments GB/s | get rdict GB/s"
          " | get raw preadv GB/s | get seg/rdict | get seg/raw |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for size in (256 * KIB, MIB):
        runs = []
        for _ in range(args.repeats):
            root = tempfile.mkdtemp(prefix="bench-segments-", dir=args.dir)
            try:
                runs.append(one_repeat(root, size, args.mib * MIB))
            finally:
                shutil.rmtree(root, ignore_errors=True)
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        ratio = lambda a, b: statistics.median(r[a] / r[b] for r in runs)  # noqa: E731
        print(f"| {size // KIB} KiB | {med['put segments']:.3f} | {med['put rdict']:.3f} "
              f"| {ratio('put segments', 'put rdict'):.2f} | {med['get segments']:.2f} "
              f"| {med['get rdict']:.2f} | {med['get raw preadv']:.2f} "
              f"| {ratio('get segments', 'get rdict'):.2f} | {ratio('get segments', 'get raw preadv'):.2f} |")


if __name__ == "__main__":
    main()
