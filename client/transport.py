"""Transports: how a `Call` reaches the node and its replies come back.

The clients describe every operation as a `Call` (see `operations`) and hand
it to a transport; they never touch sockets. `WireTransport` and
`AsyncWireTransport` run Calls as RESP round trips on pooled connections
(TCP or Unix socket) and retry connection failures where `RetryPolicy`
allows. The local fast path (`fastpath`) is another transport with the same
`execute` and `close`: it moves the bytes of the calls it can serve itself
through the node's shared-memory arena, running its control round trips on
the wire transport's pooled connections through `run`, and passes the other
calls to the wire transport it wraps.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, TypeVar

from client.aio_connection import AsyncConnection
from client.connection import Connection
from client.errors import ConnectionError
from client.operations import Call
from client.pool import AsyncConnectionPool, ConnectionPool
from client.retry import RetryPolicy
from client.sockets import Endpoint

T = TypeVar("T")


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
        return self.run(lambda conn: _finisher(call, conn.round_trip(call.requests, call.sinks)),
                        call.idempotent)

    def run(self, work: Callable[[Connection], Callable[[], T]], idempotent: bool) -> T:
        """Run ``work`` on a pooled connection, retried where allowed; then call what it returns.

        ``work`` returns a thunk that makes the result (raising server errors),
        so an error reply never costs the pooled connection.
        """
        attempt = 0
        while True:
            sent = False
            try:
                with self._pool.connection() as conn:
                    sent = True
                    done = work(conn)
                return done()
            except ConnectionError:
                if not self._retry.should_retry(attempt, sent, idempotent):
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

        async def work(conn: AsyncConnection) -> Callable[[], Any]:
            return _finisher(call, await conn.round_trip(call.requests, call.sinks))
        return await self.run(work, call.idempotent)

    async def run(self, work: Callable[[AsyncConnection], Awaitable[Callable[[], T]]], idempotent: bool) -> T:
        """The asyncio form of `WireTransport.run`."""
        attempt = 0
        while True:
            sent = False
            try:
                async with self._pool.connection() as conn:
                    sent = True
                    done = await work(conn)
                return done()
            except ConnectionError:
                if not self._retry.should_retry(attempt, sent, idempotent):
                    raise
            await asyncio.sleep(self._retry.delay(attempt))
            attempt += 1

    def close(self) -> None:
        self._pool.close()


def _finisher(call: Call, replies: list[Any]) -> Callable[[], Any]:
    return lambda: call.finish(replies)
