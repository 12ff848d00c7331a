"""Partial blocks: a block's value written layer by layer while readers wait.

A prefill worker computes a block's KV one layer at a time; a decode worker
wants layer 0 before layer 31 exists. So a block can be *opened* before its
bytes exist: its whole extent (a 128-byte header, then ``n_layers`` equal
slots) is reserved once, and each layer is marked in a bitmap when written
(over the wire, or by the client straight into the arena). Readers ask for a
range of layers and, if it is not complete yet, wait on a future that the
writer's progress resolves. Metadata stays per block: one header, one key.

The block enters the engine's index only when its last layer is in, so
KV.MATCH and GET never see a half-written block. A writer that dies leaves
an open block with no progress; the cron drops it after its timeout (its
waiters get an error). A reader holding a lease on some layers keeps the
extent alive: an abandoned block is freed when its last reader lets go, and
a block committed under readers holds one engine lease until they are done.
"""
from __future__ import annotations

import asyncio
import struct
import time
from dataclasses import dataclass, field

from kvstore.store.arena import Extent
from proto import fastpath as fp


class LayerError(Exception):
    """Bad layer-wise input (out of range, written twice, wrong size): a clear error to the client."""


@dataclass
class Geometry:
    n_layers: int
    layer_bytes: int

    @property
    def value_bytes(self) -> int:
        return fp.HEADER_SIZE + self.n_layers * self.layer_bytes

    def slot_offset(self, layer: int) -> int:
        return fp.HEADER_SIZE + layer * self.layer_bytes

    def resolve(self, start: int, stop: int) -> tuple[int, int]:
        """The range with stop -1 read as "to the last layer"; LayerError when out of range."""
        stop = self.n_layers if stop == -1 else stop
        if not 0 <= start < stop <= self.n_layers:
            raise LayerError(f"layer range [{start}, {stop}) is out of range for a block of "
                               f"{self.n_layers} layers")
        return start, stop


def parse_header(header: bytes | memoryview) -> Geometry:
    """The geometry a value's header declares (LayerError when it is not a block header)."""
    if len(header) < fp.HEADER_SIZE:
        raise LayerError(f"a block header is {fp.HEADER_SIZE} bytes, got {len(header)}")
    magic, n_layers, layer_bytes = struct.unpack_from("<4sIQ", header)
    if magic != fp.HEADER_MAGIC:
        raise LayerError("the value is not a tensor block (bad header magic)")
    if n_layers < 1 or layer_bytes < 1:
        raise LayerError("a block needs at least one layer of at least one byte")
    return Geometry(n_layers, layer_bytes)


@dataclass(eq=False)
class PartialBlock:
    key: bytes
    geometry: Geometry
    header: bytes
    extent: Extent
    parent: bytes | None
    timeout_s: float
    written: bytearray
    count: int = 0
    last_progress: float = field(default_factory=time.monotonic)
    readers: int = 0
    state: str = "open"                      # open | committed | abandoned
    engine_lease: tuple | None = None        # held while readers outlive the commit

    def has(self, start: int, stop: int) -> bool:
        return all(self.written[start:stop])


@dataclass
class BlockStats:
    partial_blocks_opened: int = 0
    partial_blocks_committed: int = 0
    partial_blocks_abandoned: int = 0
    layers_written: int = 0
    layer_waits: int = 0
    layer_wait_timeouts: int = 0


class BlockTable:
    """The open blocks of one node and the readers waiting on them."""

    def __init__(self, engine):
        self.engine = engine
        self.blocks: dict[bytes, PartialBlock] = {}
        self.waiters: dict[bytes, list[asyncio.Future]] = {}
        self.stats = BlockStats()

    # ------------------------------------------------------------ writers

    def open(self, key: bytes, header: bytes, parent: bytes | None, timeout_ms: int) -> PartialBlock | None:
        """The open block of ``key``, made if needed; None when the key is already cached."""
        block = self.blocks.get(key)
        if block is not None:
            if block.header != header:
                raise LayerError("the block is being written with another header (dtype, shape or layers)")
            return block
        if self.engine.lookup(key) is not None:
            return None
        geometry = parse_header(header)
        extent = self.engine.reserve(geometry.value_bytes)
        extent.view[:fp.HEADER_SIZE] = header
        block = PartialBlock(key, geometry, bytes(header), extent, parent, timeout_ms / 1000,
                             bytearray(geometry.n_layers))
        self.blocks[key] = block
        self.stats.partial_blocks_opened += 1
        self._wake(key)
        return block

    def open_block(self, key: bytes) -> PartialBlock:
        block = self.blocks.get(key)
        if block is None:
            raise LayerError("no block is open under this key (send KV.BLOCK first)")
        return block

    def write(self, key: bytes, layer: int, data) -> int:
        """Copy one layer over the wire; returns how many layers are in."""
        block = self.open_block(key)
        self._check_layer(block, layer)
        size = len(data)
        if size != block.geometry.layer_bytes:
            raise LayerError(f"layer data is {size} bytes, the block's layers are "
                               f"{block.geometry.layer_bytes} bytes")
        start = block.geometry.slot_offset(layer)
        block.extent.view[start:start + size] = data
        return self.mark(key, layer)

    def mark(self, key: bytes, layer: int) -> int:
        """Record a written layer; the last one commits the block."""
        block = self.open_block(key)
        self._check_layer(block, layer)
        block.written[layer] = 1
        block.count += 1
        block.last_progress = time.monotonic()
        self.stats.layers_written += 1
        if block.count == block.geometry.n_layers:
            self._commit(block)
        self._wake(key)
        return block.count

    def _check_layer(self, block: PartialBlock, layer: int) -> None:
        n = block.geometry.n_layers
        if not 0 <= layer < n:
            raise LayerError(f"layer index {layer} is out of range for a block of {n} layers")
        if block.written[layer]:
            raise LayerError(f"layer {layer} of this block is already written")

    def _commit(self, block: PartialBlock) -> None:
        del self.blocks[block.key]
        block.state = "committed"
        self.engine.commit(block.key, block.extent, block.parent)
        if block.readers:
            entry = self.engine.index[block.key]
            block.engine_lease = (self.engine.holds.hold(entry), entry, block.key)
        self.stats.partial_blocks_committed += 1

    # ------------------------------------------------------------ readers

    def pin(self, block: PartialBlock):
        """Keep a partial block's extent while a reader copies from it; returns the unpin."""
        block.readers += 1

        def unpin() -> None:
            block.readers -= 1
            if block.readers:
                return
            if block.state == "abandoned":
                self.engine.release(block.extent)
            elif block.engine_lease is not None:
                self.engine.holds.release(block.engine_lease[0])
                block.engine_lease = None
        return unpin

    async def wait(self, key: bytes, ready, timeout_s: float) -> bool:
        """Wait until ``ready()`` holds for ``key`` (re-checked at each change); False on timeout."""
        self.stats.layer_waits += 1
        deadline = time.monotonic() + timeout_s
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                self.stats.layer_wait_timeouts += 1
                return False
            future = asyncio.get_running_loop().create_future()
            self.waiters.setdefault(key, []).append(future)
            try:
                await asyncio.wait_for(future, left)
            except asyncio.TimeoutError:
                pass
        return True

    def _wake(self, key: bytes) -> None:
        for future in self.waiters.pop(key, ()):
            if not future.done():
                future.set_result(None)

    # ------------------------------------------------------------ reclamation

    def reclaim(self) -> None:
        """Cron: drop open blocks whose writer made no progress within their timeout."""
        now = time.monotonic()
        for block in [b for b in self.blocks.values() if now - b.last_progress > b.timeout_s]:
            del self.blocks[block.key]
            block.state = "abandoned"
            if not block.readers:
                self.engine.release(block.extent)
            self.stats.partial_blocks_abandoned += 1
            self._wake(block.key)

    def info(self) -> dict[str, int]:
        return {"partial_blocks": len(self.blocks),
                "partial_block_bytes": sum(b.extent.size for b in self.blocks.values()),
                **vars(self.stats)}
