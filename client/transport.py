"""Transports: how a `Call` reaches the node and its replies come back.

The clients describe every operation as a `Call` (see `operations`) and hand
it to a transport; they never touch sockets. `WireTransport` and
`AsyncWireTransport` run Calls as RESP round trips on pooled connections
(TCP or Unix socket) and retry connection failures where `RetryPolicy`
allows. They are the only transports today; a local fast path (the node's
shared-memory arena) fits in as another transport with the same `execute`
and `close`, which moves the bytes of the calls it can serve itself and
passes the others to the wire transport it wraps.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from client.aio_connection import AsyncConnection
from client.connection import Connection
from client.errors import ConnectionError
from client.operations import Call
from client.pool import AsyncConnectionPool, ConnectionPool
from client.retry import RetryPolicy
from client.sockets import Endpoint


class WireTransport:
    """Blocking RESP round trips over a thread-safe connection pool."""

    def __init__(self, endpoint: Endpoint, *, password: str | None, timeout: float | None,
                 retries: int, pool_size: int):
        self.endpoint = endpoint
        self._retry = RetryPolicy(retries)
        self._pool: ConnectionPool[Connection] = ConnectionPool(
            lambda: Connection(endpoint, timeout, password), pool_size, timeout)

    def execute(self, call: Call) -> Any:
        if not call.requests:
            return call.finish([])
        attempt = 0
        while True:
            sent = False
            try:
                with self._pool.connection() as conn:
                    sent = True
                    replies = conn.round_trip(call.requests, call.sinks)
                return call.finish(replies)
            except ConnectionError:
                if not self._retry.should_retry(attempt, sent, call.idempotent):
                    raise
            time.sleep(self._retry.delay(attempt))
            attempt += 1

    def close(self) -> None:
        self._pool.close()


class AsyncWireTransport:
    """asyncio RESP round trips over a connection pool bound to one event loop."""

    def __init__(self, endpoint: Endpoint, *, password: str | None, timeout: float | None,
                 retries: int, pool_size: int):
        self.endpoint = endpoint
        self._retry = RetryPolicy(retries)
        self._pool: AsyncConnectionPool[AsyncConnection] = AsyncConnectionPool(
            lambda: AsyncConnection.open(endpoint, timeout, password), pool_size, timeout)

    async def execute(self, call: Call) -> Any:
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

    def close(self) -> None:
        self._pool.close()
