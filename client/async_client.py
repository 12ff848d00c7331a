"""AsyncKVClient: the asyncio form of KVClient, with the same arguments and methods.

It runs the same `Call`s from `operations` (so both clients send the same
commands and interpret replies the same way) over an asyncio connection pool.
Each method borrows one connection for its round trip, so concurrent tasks
proceed on separate connections, up to `pool_size` at once. A cancelled call
closes its connection rather than return it with unread replies.
"""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

from client import operations as ops
from client.aio_connection import AsyncConnection
from client.buffers import Key
from client.errors import ConnectionError
from client.hashing import BlockHasher
from client.operations import Items, Location, Value
from client.pool import AsyncConnectionPool
from client.retry import RetryPolicy
from client.sockets import Endpoint
from proto.wire import DEFAULT_HOST, DEFAULT_PORT


class AsyncKVClient:
    """An asyncio client of one store node; see KVClient for each method's meaning."""

    def __init__(self, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *,
                 password: str | None = None, unix_socket: str | None = None,
                 timeout: float | None = 5.0, retries: int = 3, pool_size: int = 8):
        self.endpoint = Endpoint(host, port, unix_socket)
        self._retry = RetryPolicy(retries)
        self._pool: AsyncConnectionPool[AsyncConnection] = AsyncConnectionPool(
            lambda: AsyncConnection.open(self.endpoint, timeout, password), pool_size, timeout)

    async def put(self, key: Key, value: Value, *, parent: Key | None = None,
                  overwrite: bool = False) -> bool:
        return await self._execute(ops.put(key, value, parent, overwrite))

    async def get(self, key: Key) -> bytearray | None:
        return await self._execute(ops.get(key))

    async def get_into(self, key: Key, buffer: Any) -> int | None:
        return await self._execute(ops.get_into(key, buffer))

    async def exists(self, *keys: Key) -> int:
        return await self._execute(ops.exists(keys))

    async def delete(self, *keys: Key) -> int:
        return await self._execute(ops.delete(keys))

    async def batch_put(self, items: Items, *, parents: Sequence[Key | None] | None = None,
                        overwrite: bool = False) -> list[bool]:
        return await self._execute(ops.batch_put(items, parents, overwrite))

    async def batch_get(self, keys: Sequence[Key]) -> list[bytearray | None]:
        return await self._execute(ops.batch_get(keys))

    async def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int | None]:
        return await self._execute(ops.batch_get_into(keys, buffers))

    async def match_prefix(self, keys: Sequence[Key]) -> int:
        return await self._execute(ops.match_prefix(keys))

    async def match_tokens(self, hasher: BlockHasher, token_ids: Any) -> int:
        return await self._execute(ops.match_tokens(hasher, token_ids))

    async def locate(self, keys: Sequence[Key]) -> list[Location | None]:
        return await self._execute(ops.locate(keys))

    async def stats(self) -> dict[str, int]:
        return await self._execute(ops.stats())

    async def ping(self) -> bool:
        return await self._execute(ops.ping())

    async def execute(self, *args: Any) -> Any:
        return await self._execute(ops.execute(args))

    async def close(self) -> None:
        self._pool.close()

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncKVClient({self.endpoint})"

    async def _execute(self, call: ops.Call) -> Any:
        if not call.requests:
            return call.finish([])
        attempt = 0
        while True:
            sent = False
            try:
                async with self._pool.connection() as conn:
                    sent = True
                    replies = await conn.round_trip(call.requests, call.sinks)
                return call.finish(replies)
            except ConnectionError:
                if not self._retry.should_retry(attempt, sent, call.idempotent):
                    raise
            await asyncio.sleep(self._retry.delay(attempt))
            attempt += 1
