"""LMCache's remote connectors against a kvstore node: right bytes under eviction, and throughput.

    python -m loadtest.bench_lmcache [--quick] [--repeats N] [--chunks N] [--markdown] [--json FILE]

Everything runs through LMCache 0.5.6's own code: a `LocalCPUBackend` over a
`PinMemoryAllocator` (CPU memory here) hands out the chunks (`MemoryObj`), and
`CreateConnector` builds each connector from its URL, on an event loop in its
own thread, as LMCache's remote backend does. The `kvstore://` connector
(`client.connectors.lmcache_kvstore`) is loaded through LMCache's remote
storage plugin framework (`plugin://kvstore` with `remote_storage_plugins`).

1. Eviction: a node whose DRAM holds a fraction of the chunks put takes
   batched puts of them all, then lookups and reads of random chunks while
   more chunks are put (eviction goes on under the reads). Every read is a
   miss or the exact bytes put (xxh64 of every chunk compared); a wrong byte
   is counted, and the run fails on any. `redis://` (LMCache's RedisConnector,
   two keys per chunk) and `kvstore://`; `resp://` is left out of this table
   because LMCache 0.5.6's native RESP client never returns from a GET of a
   missing key (the same against Redis 7), so a chunk evicted between lookup
   and read hangs the reader.
2. Throughput, 4 MiB chunks (bfloat16, 8 layers x 256 tokens x 512): batched
   puts of `--chunks` chunks, then batched gets of all of them, on one node
   large enough to hold them; the `kvstore://` connector vs `redis://` on the
   same node, taking turns within each repeat (order alternating); GB/s of
   chunk bytes, medians of the repeats and the median of the per-repeat
   ratios. Target: kvstore:// >= 2x redis://. `resp://` is printed beside
   them (its native client, on the same node). Each connector's first turn
   runs before the repeats and is reported apart ("first turn"): the first
   write to a page of the node's arena, of the client's mapping of it and of
   LMCache's buffer faults the page in, which a running engine pays once.

The host's load is printed with the figures (loadtest/report.py): on a
2-core machine the node, the client and LMCache's loop share the CPUs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_allocators.pin_memory_allocator import PinMemoryAllocator
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend import LocalCPUBackend
from lmcache.v1.storage_backend.connector import CreateConnector

KIB, MIB, GB = 1 << 10, 1 << 20, 1e9
MODEL = "kvstore-bench"
PLUGIN_MODULE = "client.connectors.lmcache_kvstore"


def kvstore_plugin_config(address: str, name: str = "kvstore", **options: Any) -> dict:
    """The `extra_config` entries that register the `kvstore` plugin with LMCache and give its address."""
    extra = {f"remote_storage_plugin.{name}.module_path": PLUGIN_MODULE,
             f"remote_storage_plugin.{name}.class_name": "KVStoreConnectorAdapter"}
    if address is not None:
        extra[f"remote_storage_plugin.{name}.url"] = address
    for option, value in options.items():
        extra[f"remote_storage_plugin.{name}.{option}"] = value
    return extra


@dataclass
class Rig:
    """LMCache's pieces for one engine shape: metadata, a CPU backend, connectors on a loop thread.

    A chunk is ``layers`` x 2 (K and V) x ``tokens`` x ``hidden`` values of ``dtype``; chunk i's bytes
    are a pure function of i, so any reader can check them (`digest`).
    """

    layers: int = 4
    tokens: int = 256
    hidden: int = 128
    dtype: torch.dtype = torch.bfloat16
    cpu_bytes: int = 256 * MIB
    loop: asyncio.AbstractEventLoop = field(init=False)
    backends: list = field(default_factory=list, init=False)
    _digests: dict = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="lmcache-loop", daemon=True)
        self._thread.start()
        heads = 2 if self.hidden % 2 == 0 else 1
        self.metadata = LMCacheMetadata(
            model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=self.dtype, kv_shape=(self.layers, 2, self.tokens, heads, self.hidden // heads),
            chunk_size=self.tokens)

    @property
    def chunk_bytes(self) -> int:
        return 2 * self.layers * self.tokens * self.hidden * self.dtype.itemsize

    def config(self, remote_url: str | None = None, extra: dict | None = None,
               plugins: list[str] | None = None) -> LMCacheEngineConfig:
        config = LMCacheEngineConfig.from_defaults(chunk_size=self.tokens, local_cpu=True,
                                                   max_local_cpu_size=self.cpu_bytes / (1 << 30),
                                                   remote_url=remote_url, extra_config=extra or {})
        if plugins:
            config.remote_storage_plugins = plugins
        return config

    def backend(self, config: LMCacheEngineConfig) -> LocalCPUBackend:
        backend = LocalCPUBackend(config=config, metadata=self.metadata,
                                  memory_allocator=PinMemoryAllocator(self.cpu_bytes))
        self.backends.append(backend)
        return backend

    def connector(self, url: str, extra: dict | None = None, plugins: list[str] | None = None,
                  plugin_name: str | None = None) -> tuple[Any, LocalCPUBackend]:
        """LMCache's `CreateConnector(url, loop, local_cpu_backend, config)`, and that backend."""
        config = self.config(None if url.startswith("plugin://") else url, extra, plugins)
        backend = self.backend(config)
        return CreateConnector(url, self.loop, backend, config, self.metadata, plugin_name=plugin_name), backend

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def key(self, i: int) -> CacheEngineKey:
        return CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0, chunk_hash=i, dtype=self.dtype)

    def chunk(self, backend: LocalCPUBackend, i: int, tokens: int | None = None) -> MemoryObj:
        """A chunk from ``backend`` filled with chunk i's bytes (``tokens`` fewer for a partial one)."""
        shape = torch.Size([2, self.layers, tokens or self.tokens, self.hidden])
        memory_obj = backend.allocate(shape, self.dtype)
        assert memory_obj is not None, "LMCache's CPU buffer is full"
        memory_obj.raw_data.view(torch.uint8).view(-1).copy_(self.pattern(i, memory_obj.get_size()))
        return memory_obj

    @staticmethod
    def pattern(i: int, nbytes: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(i)
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)

    def digest(self, i: int, nbytes: int | None = None) -> int:
        nbytes = nbytes or self.chunk_bytes
        if (i, nbytes) not in self._digests:
            self._digests[(i, nbytes)] = xxhash.xxh64_intdigest(self.pattern(i, nbytes).numpy())
        return self._digests[(i, nbytes)]

    def right(self, i: int, memory_obj: MemoryObj) -> bool:
        """Whether ``memory_obj`` holds exactly chunk i's bytes (full, or as many tokens as it says)."""
        data = memory_obj.byte_array
        return len(data) > 0 and xxhash.xxh64_intdigest(data) == self.digest(i, len(data))

    def close(self) -> None:
        for backend in self.backends:
            try:
                backend.close()
            except Exception:       # LMCache's own clean-up; nothing of ours to keep
                pass
        try:
            self.run(_cancel_tasks(), timeout=10)       # LMCache's executor workers wait on queues forever
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


async def _cancel_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# --------------------------------------------------------------------------- the benchmark

CONNECTORS = ("kvstore://", "redis://", "resp://")
BATCH = 8                 # chunks per batched put or get: a 2,048-token prompt at 256 tokens a chunk
IN_FLIGHT = 4             # batches at once on LMCache's loop (several requests storing or loading)


@dataclass
class Bench:
    """The connectors of one rig on one node, built as LMCache builds them."""

    rig: Rig
    host: str
    port: int
    connectors: dict = field(default_factory=dict)

    def connector(self, scheme: str) -> tuple[Any, LocalCPUBackend]:
        if scheme not in self.connectors:
            address = f"{self.host}:{self.port}"
            if scheme == "kvstore://":
                self.connectors[scheme] = self.rig.connector("plugin://kvstore", kvstore_plugin_config(
                    f"kvstore://{address}"), ["kvstore"], "kvstore")
            elif scheme == "resp://":
                self.connectors[scheme] = self.rig.connector(f"resp://{address}",
                                                             {"save_chunk_meta": False, "resp_num_threads": 4})
            else:
                self.connectors[scheme] = self.rig.connector(f"{scheme}{address}")
        return self.connectors[scheme]


async def _in_batches(work, ids: list[int]) -> list:
    """``work(batch)`` for batches of `BATCH` ids, `IN_FLIGHT` batches at a time; results in order."""
    batches = [ids[i:i + BATCH] for i in range(0, len(ids), BATCH)]
    limit = asyncio.Semaphore(IN_FLIGHT)

    async def one(batch: list[int]) -> Any:
        async with limit:
            return await work(batch)

    return [r for rs in await asyncio.gather(*(one(b) for b in batches)) for r in rs]


async def put_chunks(rig: Rig, connector: Any, chunks: dict[int, MemoryObj]) -> None:
    async def work(batch: list[int]) -> list:
        await connector.batched_put([rig.key(i) for i in batch], [chunks[i] for i in batch])
        return []
    await _in_batches(work, list(chunks))


async def get_chunks(rig: Rig, connector: Any, ids: list[int]) -> list[MemoryObj | None]:
    """As LMCache's remote backend reads: one batched get where the connector has it, else a get per chunk."""
    async def work(batch: list[int]) -> list:
        keys = [rig.key(i) for i in batch]
        if connector.support_batched_get():
            return await connector.batched_get(keys)
        return list(await asyncio.gather(*(connector.get(k) for k in keys)))
    return await _in_batches(work, ids)


def release(memory_objs) -> None:
    for memory_obj in memory_objs:
        if memory_obj is not None:
            memory_obj.ref_count_down()


def fill(rig: Rig, backend: LocalCPUBackend, ids: list[int], sources: dict[int, torch.Tensor]) -> dict:
    """Chunks for ``ids`` from ``backend``, copied from patterns made once (not timed)."""
    chunks = {}
    for i in ids:
        memory_obj = backend.allocate(torch.Size([2, rig.layers, rig.tokens, rig.hidden]), rig.dtype)
        assert memory_obj is not None, "LMCache's CPU buffer is full"
        if i not in sources:
            sources[i] = rig.pattern(i, rig.chunk_bytes)
        memory_obj.raw_data.view(torch.uint8).view(-1).copy_(sources[i])
        chunks[i] = memory_obj
    return chunks


def flush(host: str, port: int) -> None:
    from client import KVClient
    with KVClient(host, port, fast_path="off") as kv:
        kv.execute("FLUSHALL")


def throughput_turn(bench: Bench, scheme: str, count: int, base: int, sources: dict) -> tuple[float, float]:
    """GB/s of batched puts of ``count`` chunks, then of batched gets of them all (every byte checked
    after the clock stops)."""
    rig = bench.rig
    connector, backend = bench.connector(scheme)
    ids = list(range(base, base + count))
    chunks = fill(rig, backend, ids, sources)
    start = time.perf_counter()
    rig.run(put_chunks(rig, connector, chunks), timeout=600)
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    got = rig.run(get_chunks(rig, connector, ids), timeout=600)
    get_s = time.perf_counter() - start
    wrong = sum(1 for i, m in zip(ids, got) if m is None or not rig.right(i, m))
    release(got)
    flush(bench.host, bench.port)
    if wrong:
        raise RuntimeError(f"{scheme}: {wrong} of {count} chunks read back missing or wrong")
    nbytes = count * rig.chunk_bytes
    return nbytes / put_s / GB, nbytes / get_s / GB


def eviction_run(rig: Rig, bench: Bench, scheme: str, stored: int, rounds: int) -> dict:
    """Batched puts of ``stored`` chunks into a node that holds a fraction of them, then rounds of
    concurrent reads of random chunks beside puts of new ones: hits, misses and wrong reads."""
    connector, backend = bench.connector(scheme)
    sources: dict = {}
    tally = {"hits": 0, "misses": 0, "wrong": 0}
    rig.run(put_chunks(rig, connector, fill(rig, backend, list(range(stored)), sources)), timeout=600)
    rng = random.Random(11)

    async def read(i: int) -> None:
        got = await connector.get(rig.key(i))
        tally["misses" if got is None else "hits" if rig.right(i, got) else "wrong"] += 1
        release([got])

    async def rounds_of_reads() -> None:
        new = stored
        for _ in range(rounds):
            fresh = fill(rig, backend, list(range(new, new + 4)), sources)
            await asyncio.gather(*(read(rng.randrange(new)) for _ in range(12)),
                                 connector.batched_put([rig.key(i) for i in fresh], list(fresh.values())))
            new += 4
    rig.run(rounds_of_reads(), timeout=600)
    return tally


def main(argv: list[str] | None = None) -> int:
    from loadtest.procs import ProcessGroup, start_kvstore
    from loadtest.report import Table, Target, log, machine_info, record, turns

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer chunks and repeats (a smoke run)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=48, help="4 MiB chunks put and read per turn")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.chunks = 2, 16
    logging.getLogger("lmcache").setLevel(logging.WARNING)
    machine = machine_info()
    failed = False

    with ProcessGroup() as group:
        # 1. eviction: 512 KiB chunks into a 32 MiB node
        small = Rig(layers=4, tokens=256, hidden=128, cpu_bytes=192 * MIB)
        stored, rounds = (96, 10) if args.quick else (192, 30)
        lines = []
        for scheme in ("redis://", "kvstore://"):
            node = start_kvstore(group, "32mb", name=f"evict-{scheme[:-3]}")
            tally = eviction_run(small, Bench(small, node.host, node.port), scheme, stored, rounds)
            group.stop(node.process)
            failed |= tally["wrong"] > 0
            lines.append(f"{scheme} under eviction: {sum(tally.values())} reads, {tally['hits']} hits, "
                         f"{tally['misses']} misses, {tally['wrong']} with wrong bytes")
            log("  " + lines[-1])
        small.close()

        # 2. throughput: 4 MiB chunks, a node that holds them all
        rig = Rig(layers=8, tokens=256, hidden=512, cpu_bytes=(2 * args.chunks + 8) * 4 * MIB)
        node = start_kvstore(group, f"{max(256, 3 * args.chunks * 4)}mb", name="kvstore")
        bench = Bench(rig, node.host, node.port)
        table = Table(f"LMCache 0.5.6 connectors on one kvstore node, {rig.chunk_bytes // MIB} MiB chunks "
                      f"({args.chunks} per turn, batches of {BATCH}, {IN_FLIGHT} in flight)",
                      "kvstore://", "redis://", extras=("resp://",))
        rows = [table.row("put", "GB/s", Target(2.0)), table.row("get", "GB/s", Target(2.0))]
        cold = [table.row("put, first turn (cold pages)", "GB/s"), table.row("get, first turn (cold pages)", "GB/s")]
        sources: dict = {}
        for n, scheme in enumerate(CONNECTORS):     # one turn each first, apart: first touch of every page
            record(cold, scheme, lambda: list(throughput_turn(bench, scheme, args.chunks, n * args.chunks, sources)),
                   (RuntimeError, OSError, TimeoutError))
        for n, (scheme, _) in enumerate(turns({s: s for s in CONNECTORS}, args.repeats)):
            base = (n % len(CONNECTORS)) * args.chunks
            record(rows, scheme, lambda: list(throughput_turn(bench, scheme, args.chunks, base, sources)),
                   (RuntimeError, OSError, TimeoutError))
        table.notes.append(f"Eviction: {small.chunk_bytes // KIB} KiB chunks into a node with 32 MiB of DRAM, "
                           f"{stored} put, then {rounds} rounds of 12 reads of random chunks beside a batched put "
                           f"of 4 new ones.")
        table.notes += lines
        table.notes.append("First turn: each connector's first turn, before the repeats (one sample).")
        table.notes.append("load average at end: %.1f" % os.getloadavg()[0])
        print(table.render_markdown(machine) if args.markdown else table.render_text(machine))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(table.to_json(machine), f, indent=1)
        rig.close()
    if failed:
        print("FAILED: a read returned wrong bytes under eviction", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
