"""AsyncKVClient: the asyncio form of KVClient, with the same arguments and methods.

It hands the same operations (`operations`, `layers`) to the asyncio
transport, which runs them through the same sans-I/O `core` (so both clients
send the same commands, take the same path and interpret replies the same
way); copies of a megabyte or more, and mapping the arena, run on a worker
thread so the loop keeps other calls moving. Each method borrows one
connection for its round trips, so concurrent tasks proceed on separate
connections, up to `pool_size` at once; `batch_get_into` splits a long batch
into chunks that proceed that way too. A cancelled call closes its
connection rather than return it with unread replies.
"""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

from client import layers
from client import operations as ops
from client.base import BaseClient
from client.buffers import Key
from client.hashing import BlockHasher
from client.operations import Items, Location, Value
from client.transport import AsyncTransport

PIPELINE_CHUNK = 32        # blocks per round trip in batch_get_into


class AsyncKVClient(BaseClient):
    """An asyncio client of one store node; see KVClient for each method's meaning."""

    transport_class = AsyncTransport

    async def _settle(self, keys: Any) -> None:
        """Read-your-writes: wait (off the loop) for the pending commits of any of ``keys``."""
        if self._puts.pending():
            await asyncio.to_thread(self._puts.settle, keys)

    async def put_nowait(self, key: Key, value: Value, *, parent: Key | None = None,
                         overwrite: bool = False) -> None:
        """KVClient.put_nowait; the copy and the send run on a worker thread."""
        await asyncio.to_thread(self._puts.put, key, value, parent, overwrite)

    async def batch_put_nowait(self, items: Items, *, parents: Sequence[Key | None] | None = None,
                               overwrite: bool = False) -> None:
        pairs, links = ops.with_parents(items, parents)
        await asyncio.to_thread(self._puts.batch_put, pairs, links, overwrite)

    async def flush(self) -> int:
        """KVClient.flush: raises PutsFailed naming the keys whose commit failed."""
        return await asyncio.to_thread(self._puts.flush)

    async def put(self, key: Key, value: Value, *, parent: Key | None = None,
                  overwrite: bool = False) -> bool:
        await self._settle((key,))
        return await self._transport.execute(ops.put(key, value, parent, overwrite))

    async def get(self, key: Key) -> bytearray | None:
        await self._settle((key,))
        return await self._transport.execute(ops.get(key))

    async def get_into(self, key: Key, buffer: Any) -> int | None:
        await self._settle((key,))
        return await self._transport.execute(ops.get_into(key, buffer))

    async def exists(self, *keys: Key) -> int:
        await self._settle(keys)
        return await self._transport.execute(ops.exists(keys))

    async def delete(self, *keys: Key) -> int:
        await self._settle(keys)
        return await self._transport.execute(ops.delete(keys))

    async def batch_put(self, items: Items, *, parents: Sequence[Key | None] | None = None,
                        overwrite: bool = False, chain_links: Sequence[tuple[Key, Key]] = ()) -> list[bool]:
        await self._settle(None)
        return await self._transport.execute(ops.batch_put(items, parents, overwrite, chain_links))

    async def batch_get(self, keys: Sequence[Key]) -> list[bytearray | None]:
        await self._settle(keys)
        return await self._transport.execute(ops.batch_get(keys))

    async def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int | None]:
        """Pipelined: chunks of `PIPELINE_CHUNK` blocks run at once on the pooled connections,
        so one chunk's round trip overlaps another's copy (a 256-block prefix is one call)."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        await self._settle(keys)
        chunks = [(keys[i:i + PIPELINE_CHUNK], buffers[i:i + PIPELINE_CHUNK])
                  for i in range(0, len(keys), PIPELINE_CHUNK)]
        results = await asyncio.gather(*(self._transport.execute(ops.batch_get_into(k, b)) for k, b in chunks))
        return [length for chunk in results for length in chunk]

    async def put_tensor(self, key: Key, tensor: Any, *, parent: Key | None = None) -> bool:
        return await self._transport.execute(layers.put_tensor(key, tensor, parent))

    async def get_tensor(self, key: Key, *, framework: str = "numpy") -> Any:
        await self._settle((key,))
        return await self._transport.execute(layers.get_tensor(key, framework))

    async def get_tensor_into(self, key: Key, tensor: Any) -> bool:
        await self._settle((key,))
        return await self._transport.execute(layers.get_tensor_into(key, tensor))

    async def batch_put_tensors(self, items: Items, *, parents: Sequence[Key | None] | None = None) -> list[bool]:
        return await self._transport.execute(layers.batch_put_tensors(items, parents))

    async def batch_get_tensors_into(self, keys: Sequence[Key], tensors: Sequence[Any]) -> list[bool]:
        return await self._transport.execute(layers.batch_get_tensors_into(keys, tensors))

    async def put_layer(self, key: Key, layer: int, data: Any, *, n_layers: int, parent: Key | None = None,
                        timeout_ms: int | None = None) -> bool:
        return await self._transport.execute(layers.put_layer(key, layer, data, n_layers, parent, timeout_ms))

    async def get_layers(self, key: Key, start: int = 0, stop: int | None = None, *, into: Any = None,
                         wait: float | None = None, framework: str = "numpy") -> Any:
        await self._settle((key,))
        return await self._transport.execute(layers.get_layers(key, start, stop, into, wait, framework))

    async def batch_put_layers(self, items: Sequence[tuple[Key, int, Any]], *, n_layers: int,
                               parents: Sequence[Key | None] | None = None,
                               timeout_ms: int | None = None) -> list[bool]:
        return await self._transport.execute(layers.batch_put_layers(items, n_layers, parents, timeout_ms))

    async def batch_get_layers(self, keys: Sequence[Key], start: int = 0, stop: int | None = None, *,
                               into: Sequence[Any] | None = None, wait: float | None = None,
                               framework: str = "numpy") -> list[Any]:
        return await self._transport.execute(layers.batch_get_layers(keys, start, stop, into, wait, framework))

    async def match_prefix(self, keys: Sequence[Key]) -> int:
        await self._settle(keys)
        return await self._transport.execute(ops.match_prefix(keys))

    async def match_tokens(self, hasher: BlockHasher, token_ids: Any) -> int:
        await self._settle(None)
        return await self._transport.execute(ops.match_tokens(hasher, token_ids))

    async def locate(self, keys: Sequence[Key]) -> list[Location | None]:
        await self._settle(keys)
        return await self._transport.execute(ops.locate(keys))

    async def stats(self) -> dict[str, int]:
        return await self._transport.execute(ops.stats())

    async def ping(self) -> bool:
        return await self._transport.execute(ops.ping())

    async def execute(self, *args: Any) -> Any:
        return await self._transport.execute(ops.execute(args))

    async def close(self) -> None:
        await self._settle(None)
        self._puts.close()
        self._transport.close()

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
