"""Moves between DRAM and the GPU tier (kvstore/tiers/manager.py, kvstore/tiers/moves.py), on any machine.

A fake GPU tier (numpy memory carved by the same buddy allocator, with a gate
that can hold device reads back) stands in for cupy, so these run without a
GPU; tests/test_tier_gpu.py covers the real device. What is checked:
- a GPU demotion holds every value it copies down: one pass picks as many
  distinct values as the watermarks ask for, and none of them is chosen again
  while its copy runs;
- a value deleted while its GPU extent is being read keeps that extent until
  the read is done (nothing else can be written there mid-copy);
- a value that leaves the GPU gives its extent back, and one with an SSD copy
  still knows about it when it comes back to DRAM (so a later delete removes
  the SSD record).
"""
from __future__ import annotations

import asyncio
import threading

import numpy as np

from kvstore.store.allocator import BuddyAllocator
from kvstore.store.engine import Engine
from kvstore.store.entries import GPU, ON_SSD
from kvstore.tiers.manager import TieringConfig, TierManager
from tests.conftest import until

KIB, MIB = 1 << 10, 1 << 20
SIZE = 64 * KIB


class FakeGPU:
    """The GPUTier interface over host memory; ``gate`` holds reads back while clear."""

    device_id = 0

    def __init__(self, capacity: int):
        self.memory = np.zeros(capacity, dtype=np.uint8)
        self.allocator = BuddyAllocator(capacity, 4096)
        self.gate = threading.Event()
        self.gate.set()

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.capacity

    @property
    def used_bytes(self) -> int:
        return self.allocator.used

    def alloc(self, size: int) -> int | None:
        return self.allocator.alloc(size)

    def free(self, offset: int, size: int) -> None:
        self.allocator.free(offset, size)

    def write(self, offset: int, host_buffer) -> int:
        source = np.frombuffer(memoryview(host_buffer).cast("B"), dtype=np.uint8)
        self.memory[offset:offset + len(source)] = source
        return len(source)

    def read_into(self, offset: int, size: int, host_buffer) -> int:
        assert self.gate.wait(10), "the test never opened the gate"
        target = np.frombuffer(memoryview(host_buffer).cast("B"), dtype=np.uint8)
        target[:size] = self.memory[offset:offset + size]
        return size

    def close(self) -> None:
        pass


def value_of(key: bytes) -> bytes:
    return np.random.default_rng(sum(key)).bytes(SIZE)


async def node_with_values_on_gpu(keys: list[bytes], gpu_capacity: int) -> tuple[Engine, TierManager, FakeGPU]:
    """An engine whose ``keys`` were read once each (promote-hits 1), so they moved to the GPU."""
    engine, gpu = Engine(4 * MIB, prefault=False), FakeGPU(gpu_capacity)
    tiers = TierManager(engine, TieringConfig(high_watermark=0.9, low_watermark=0.5, promote_hits=1), gpu=gpu)
    for key in keys:
        engine.put(key, value_of(key))
    for key in keys:
        engine.get_entry(key)
        await until(lambda: engine.tier_code(engine.lookup(key)) == GPU)
    return engine, tiers, gpu


def test_a_gpu_demotion_holds_each_value_while_it_is_copied():
    async def scenario():
        keys = [b"k%d" % i for i in range(4)]
        engine, tiers, gpu = await node_with_values_on_gpu(keys, 4 * SIZE)
        gpu.gate.clear()
        tiers.cron()                         # 100 % full: down to the low watermark, two values
        await asyncio.sleep(0.05)
        moving = [key for key in keys if engine.eviction.is_held(engine.lookup(key))]
        assert len(moving) == 2, "distinct values, each held while it is copied"
        assert engine.coldest(GPU) not in [engine.lookup(key) for key in moving]
        deleted, moved = moving
        engine.delete(deleted)
        assert gpu.used_bytes == 4 * SIZE, "an extent being read is not freed under the copy"
        gpu.gate.set()
        await until(lambda: gpu.used_bytes == 2 * SIZE)
        slot = engine.lookup(moved)
        assert engine.tier_of(slot) == "dram" and engine.value(slot) == value_of(moved)
        assert not engine.eviction.is_held(slot)
        tiers.close()
        engine.close()

    asyncio.run(scenario())


def test_a_value_leaving_the_gpu_gives_its_extent_back_and_keeps_its_ssd_copy():
    async def scenario():
        engine, gpu = Engine(4 * MIB, prefault=False), FakeGPU(SIZE)
        tiers = TierManager(engine, TieringConfig(promote_hits=1), gpu=gpu)
        engine.put(b"k", value_of(b"k"))
        engine.moves.mark_on_ssd(engine.lookup(b"k"))       # as if written through to SSD
        engine.get_entry(b"k")
        await until(lambda: engine.tier_code(engine.lookup(b"k")) == GPU)
        tiers.cron()
        await until(lambda: engine.tier_of(engine.lookup(b"k")) == "dram")
        assert gpu.used_bytes == 0
        assert engine.flags_of(engine.lookup(b"k")) & ON_SSD
        assert engine.value(engine.lookup(b"k")) == value_of(b"k")
        tiers.close()
        engine.close()

    asyncio.run(scenario())
