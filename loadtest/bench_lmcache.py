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
   them (its native client, on the same node).

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
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
