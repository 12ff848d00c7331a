"""AsyncKVClient: the asyncio form of KVClient, with the same arguments and methods.

It hands the same `Call`s from `operations` to an asyncio transport (so both
clients send the same commands and interpret replies the same way).
Each method borrows one connection for its round trip, so concurrent tasks
proceed on separate connections, up to `pool_size` at once; `batch_get_into`
splits a long batch into chunks that proceed that way too. A cancelled call
closes its connection rather than return it with unread replies.
"""
from __future__ import annotations

import asyncio
import functools
from typing import Any, Sequence

from client import operations as ops
from client.buffers import Key
from client.hashing import BlockHasher
from client.fastpath import AsyncFastTransport, FastPath
from client.operations import Items, Location, Value
from client.sockets import Endpoint
from client.sync_client import KVClient
from client.transport import AsyncWireTransport
from proto.fastpath import LEASE_TTL_MS
from proto.wire import DEFAULT_HOST, DEFAULT_PORT

PIPELINE_CHUNK = 32        # blocks per round trip in batch_get_into


class AsyncKVClient:
    """An asyncio client of one store node; see KVClient for each method's meaning."""

    def __init__(self, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *,
                 password: str | None = None, unix_socket: str | None = None,
                 timeout: float | None = 5.0, retries: int = 3, pool_size: int = 8,
                 fast_path: str = "auto", lease_ttl_ms: int = LEASE_TTL_MS):
        self.endpoint = Endpoint(host, port, unix_socket)
        self.fast_path = FastPath(self.endpoint, password, timeout, fast_path, lease_ttl_ms)
        wire = AsyncWireTransport(self.endpoint, password=password, timeout=timeout,
                                  retries=retries, pool_size=pool_size)
        self._transport = wire if fast_path == "off" else AsyncFastTransport(wire, self.fast_path)
        self._blocking = functools.partial(KVClient, host, port, password=password, unix_socket=unix_socket,
                                           timeout=timeout, retries=retries, pool_size=pool_size,
                                           fast_path=fast_path, lease_ttl_ms=lease_ttl_ms)
        self._twin: KVClient | None = None

    async def put(self, key: Key, value: Value, *, parent: Key | None = None,
                  overwrite: bool = False) -> bool:
        return await self._transport.execute(ops.put(key, value, parent, overwrite))

    async def get(self, key: Key) -> bytearray | None:
        return await self._transport.execute(ops.get(key))

    async def get_into(self, key: Key, buffer: Any) -> int | None:
        return await self._transport.execute(ops.get_into(key, buffer))

    async def exists(self, *keys: Key) -> int:
        return await self._transport.execute(ops.exists(keys))

    async def delete(self, *keys: Key) -> int:
        return await self._transport.execute(ops.delete(keys))

    async def batch_put(self, items: Items, *, parents: Sequence[Key | None] | None = None,
                        overwrite: bool = False) -> list[bool]:
        return await self._transport.execute(ops.batch_put(items, parents, overwrite))

    async def batch_get(self, keys: Sequence[Key]) -> list[bytearray | None]:
        return await self._transport.execute(ops.batch_get(keys))

    async def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int | None]:
        """Pipelined: chunks of `PIPELINE_CHUNK` blocks run at once on the pooled connections,
        so one chunk's round trip overlaps another's copy (a 256-block prefix is one call)."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        chunks = [(keys[i:i + PIPELINE_CHUNK], buffers[i:i + PIPELINE_CHUNK])
                  for i in range(0, len(keys), PIPELINE_CHUNK)]
        results = await asyncio.gather(*(self._transport.execute(ops.batch_get_into(k, b)) for k, b in chunks))
        return [length for chunk in results for length in chunk]

    # Tensors and layers: KVClient's implementation, run on a worker thread (its copies
    # release the GIL, so the loop keeps serving other tasks meanwhile).

    async def _on_thread(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._twin is None:
            self._twin = self._blocking()
        return await asyncio.to_thread(getattr(self._twin, method), *args, **kwargs)

    async def put_tensor(self, key: Key, tensor: Any, *, parent: Key | None = None) -> bool:
        return await self._on_thread("put_tensor", key, tensor, parent=parent)

    async def get_tensor(self, key: Key, *, framework: str = "numpy") -> Any:
        return await self._on_thread("get_tensor", key, framework=framework)

    async def get_tensor_into(self, key: Key, tensor: Any) -> bool:
        return await self._on_thread("get_tensor_into", key, tensor)

    async def put_layer(self, key: Key, layer: int, data: Any, *, n_layers: int, parent: Key | None = None,
                        timeout_ms: int | None = None) -> bool:
        return await self._on_thread("put_layer", key, layer, data, n_layers=n_layers, parent=parent,
                                     timeout_ms=timeout_ms)

    async def get_layers(self, key: Key, start: int = 0, stop: int | None = None, *, into: Any = None,
                         wait: float | None = None, framework: str = "numpy") -> Any:
        return await self._on_thread("get_layers", key, start, stop, into=into, wait=wait, framework=framework)

    async def match_prefix(self, keys: Sequence[Key]) -> int:
        return await self._transport.execute(ops.match_prefix(keys))

    async def match_tokens(self, hasher: BlockHasher, token_ids: Any) -> int:
        return await self._transport.execute(ops.match_tokens(hasher, token_ids))

    async def locate(self, keys: Sequence[Key]) -> list[Location | None]:
        return await self._transport.execute(ops.locate(keys))

    async def stats(self) -> dict[str, int]:
        return await self._transport.execute(ops.stats())

    async def ping(self) -> bool:
        return await self._transport.execute(ops.ping())

    async def execute(self, *args: Any) -> Any:
        return await self._transport.execute(ops.execute(args))

    async def close(self) -> None:
        self._transport.close()
        if self._twin is not None:
            self._twin.close()

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncKVClient({self.endpoint})"
