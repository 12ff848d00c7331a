"""The values a slot move sends, whatever tier they live in.

A value leaves the index as it is taken for sending (from then on its key is
asked for at the target, migration.py explains why), and its bytes are sent
from where they lie: a DRAM value (or a staged DRAM copy) from its extent,
held until the push is done, so nothing is copied for a move.

A value that lives only on SSD or GPU has no bytes in host memory to send.
It is read first, with the tier manager's own read path (kvstore/tiers/manager.py:
`fetch` and `install`): RocksDB's batched reads on the SSD tier's reader
threads, device-to-host copies on the GPU tier's copy threads; the loop only
waits. The move gathers values in its order, a push's worth at a time
(`Gathered`), reads those of the group not in host memory together and takes
the group in order: a slot of cold values costs one batched read per reader
thread per push, not a thread hand-off per key, the order (hottest first) is
kept across tiers, and the memory a move holds stays bounded by a few pushes. A value whose read fails
(its checksum, the disk) is dropped by the tier manager, as a failed read
of a client's would be, and counted as dropped by the move.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from kvstore.store.entries import DRAM, STAGED
from kvstore.store.eviction import NO_PARENT

BATCH_BYTES = 8 * 1024 * 1024       # one KV.IMPORT carries about this much
BATCH_KEYS = 512


class Taken(NamedTuple):
    """A value out of the index, on its way to another node."""
    key: bytes
    parent: bytes                   # its chain parent's key (b"": none)
    tenant: bytes                   # the name of the tenant that wrote it (b"": the shared pool)
    view: memoryview
    hold: int | None                # the engine's hold token, released when the push is done
    size: int
    children: tuple[bytes, ...] = ()    # its chain children, links its new owner holds (moved_links.py)


def in_host_memory(engine, entry: int) -> bool:
    """Whether the value of ``entry`` can be sent as it is: in DRAM, or staged there for a read."""
    return engine.tier_code(entry) == DRAM or bool(engine.flags_of(entry) & STAGED)


def take(engine, key: bytes, entry: int,
         capture: Callable[[bytes, int], tuple[bytes, ...]] | None = None) -> Taken:
    """Take the value of ``key`` (in host memory at ``entry``) out of the index, held for sending;
    ``capture(key, entry)`` first returns its chain children, which travel with it (moved_links.py)."""
    children = capture(key, entry) if capture is not None else ()
    parent_entry = engine.eviction.parent_of(entry)
    parent = engine.key_of(parent_entry) if parent_entry != NO_PARENT else b""
    tenant = engine.quotas.label(engine.owner_of(entry)) or b""
    hold = engine.holds.hold(entry)
    view = engine.view(entry)
    size = engine.size_of(entry)
    engine.delete(key)              # from now on the key is asked for at the target
    return Taken(key, parent, tenant, view, hold, size, children)


def full(count: int, size: int) -> bool:
    """Whether a batch of ``count`` values of ``size`` bytes is one push's worth."""
    return count >= BATCH_KEYS or size >= BATCH_BYTES


class Gathered:
    """Values of a move gathered in the move's order, read into host memory together, taken in order."""

    def __init__(self, engine, tiers, capture: Callable[[bytes, int], tuple[bytes, ...]] | None = None):
        self.engine = engine
        self.tiers = tiers          # the node's TierManager (None: DRAM only)
        self.capture = capture      # a value's chain children, as it is taken
        self.keys: list[bytes] = []
        self.size = 0

    def add(self, key: bytes, size: int) -> bool:
        """Gather ``key``; True when the group is a push's worth and should be taken now."""
        self.keys.append(key)
        self.size += size
        return full(len(self.keys), self.size)

    async def take(self, wanted: Callable[[bytes], bool]) -> tuple[list[Taken], int, int]:
        """Read the gathered values on SSD or GPU into host memory, off the loop, then take, in
        order, those still ``wanted``.

        Returns (taken, keys lost, bytes lost): lost are values whose read
        failed (the tier manager drops them), and values that left host memory
        while the group was read (demoted under DRAM pressure): dropped here,
        as the move drops what it does not send. A key overwritten or deleted
        meanwhile is taken as it now is, or not at all; a value read but no
        longer wanted (its slot stopped moving) stays, its staged copy let go.
        """
        engine, tiers = self.engine, self.tiers
        keys, self.keys, self.size = self.keys, [], 0
        cold = tiers.pending_fetch(keys) if tiers is not None else []
        fetched = await tiers.fetch(cold) if cold else []
        lost = [engine.size_of(entry) for key, entry, _, result in fetched
                if (result is None or isinstance(result, BaseException))
                and engine.index.get(key) == entry and not in_host_memory(engine, entry)]
        staged = set(tiers.install(fetched)) if fetched else set()
        taken = []
        for key in keys:
            entry = engine.lookup(key)
            if entry is None or not wanted(key):
                continue
            if in_host_memory(engine, entry):
                staged.discard(entry)
                taken.append(take(engine, key, entry, self.capture))
            else:
                lost.append(engine.size_of(entry))
                engine.drop(entry)
        if staged:
            tiers.unstage(list(staged))
        return taken, len(lost), sum(lost)


class Outbox:
    """Taken values per target node, pushed a batch at a time."""

    def __init__(self, push: Callable[[str, list[Taken]], Awaitable[None]]):
        self.push = push
        self.batches: dict[str, list[Taken]] = {}
        self.sizes: dict[str, int] = {}

    async def add(self, target: str, item: Taken) -> None:
        batch = self.batches.setdefault(target, [])
        batch.append(item)
        self.sizes[target] = self.sizes.get(target, 0) + item.size
        if full(len(batch), self.sizes[target]):
            del self.batches[target]
            self.sizes[target] = 0
            await self.push(target, batch)

    async def flush(self) -> None:
        """Push what is left for every target, at once."""
        batches, self.batches, self.sizes = self.batches, {}, {}
        await asyncio.gather(*(self.push(target, batch) for target, batch in batches.items()))
