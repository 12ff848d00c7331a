"""AsyncKVClient: the asyncio form of KVClient, with the same arguments and methods.

It hands the same `Call`s from `operations` to an asyncio transport (so both
clients send the same commands and interpret replies the same way).
Each method borrows one connection for its round trip, so concurrent tasks
proceed on separate connections, up to `pool_size` at once. A cancelled call
closes its connection rather than return it with unread replies.
"""
from __future__ import annotations

from typing import Any, Sequence

from client import operations as ops
from client.buffers import Key
from client.hashing import BlockHasher
from client.fastpath import AsyncFastTransport, FastPath
from client.operations import Items, Location, Value
from client.sockets import Endpoint
from client.transport import AsyncWireTransport
from proto.fastpath import LEASE_TTL_MS
from proto.wire import DEFAULT_HOST, DEFAULT_PORT


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
        return await self._transport.execute(ops.batch_get_into(keys, buffers))

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

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncKVClient({self.endpoint})"
