"""Transports: the I/O shells that drive the sans-I/O core, one blocking and one asyncio.

A client hands each operation to its transport, which runs the core's
generator (`core.Core.run`) and takes the steps it yields (`steps`): round
trips on a connection borrowed from its pool (TCP or Unix socket), local
copies (on a worker thread in the asyncio transport when they are large),
and pauses between retries. What to send, which path to take, what a reply
means and when to retry are the core's; a transport only moves bytes and
waits, so the two differ in little more than ``await``.

A connection goes back to its pool when the procedure that borrowed it ends,
even by raising (the core raises only between round trips, with every reply
read); an error from the I/O itself, or a cancelled task, closes it.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import AbstractContextManager
from typing import Any

from client.aio_connection import AsyncConnection
from client.connection import Connection
from client.core import Core
from client.fastpath import FastPath
from client.retry import RetryPolicy
from client.errors import ConnectionError
from client.pool import AsyncConnectionPool, ConnectionPool
from client.sockets import Endpoint
from client.steps import Borrow, Broken, Ended, Local, Pause, RoundTrip, Step, Steps, advance


class Transport:
    """Blocking: steps taken in the calling thread, over a thread-safe connection pool."""

    def __init__(self, endpoint: Endpoint, fast: FastPath, retry: RetryPolicy, *, password: str | None,
                 timeout: float | None, pool_size: int):
        self.endpoint = endpoint
        self.core = Core(fast, retry, offloading=False)
        self._pool: ConnectionPool[Connection] = ConnectionPool(
            lambda: Connection(endpoint, timeout, password), pool_size, timeout)

    def execute(self, op: Any) -> Any:
        return self._drive(self.core.run(op)).result()

    def connection(self) -> AbstractContextManager[Connection]:
        """Borrow a pooled connection (a context manager): for a caller that sends on several
        connections before it reads from any (a cluster's one-round prefix match)."""
        return self._pool.connection()

    def _drive(self, steps: Steps, conn: Connection | None = None) -> Ended:
        outcome = None
        while not isinstance(step := advance(steps, outcome), Ended):
            outcome = self._take(step, conn)
        return step

    def _take(self, step: Step, conn: Connection | None) -> Any:
        if isinstance(step, RoundTrip):
            return conn.round_trip(step.requests, step.sinks)
        if isinstance(step, Local):
            return step.run()
        if isinstance(step, Borrow):
            return self._borrow(step)
        assert isinstance(step, Pause)
        time.sleep(step.seconds)

    def _borrow(self, step: Borrow) -> Ended | Broken:
        sent = False
        try:
            with self._pool.connection() as conn:
                sent = True
                return self._drive(step.start(conn), conn)
        except ConnectionError as exc:
            return Broken(exc, sent)

    def close(self) -> None:
        self._pool.close()
        self.core.fast.close()


class AsyncTransport:
    """asyncio: steps taken on the event loop (large copies on a worker thread), over a
    connection pool bound to one loop."""

    def __init__(self, endpoint: Endpoint, fast: FastPath, retry: RetryPolicy, *, password: str | None,
                 timeout: float | None, pool_size: int):
        self.endpoint = endpoint
        self.core = Core(fast, retry, offloading=True)
        self._pool: AsyncConnectionPool[AsyncConnection] = AsyncConnectionPool(
            lambda: AsyncConnection.open(endpoint, timeout, password), pool_size, timeout)

    async def execute(self, op: Any) -> Any:
        return (await self._drive(self.core.run(op))).result()

    async def _drive(self, steps: Steps, conn: AsyncConnection | None = None) -> Ended:
        outcome = None
        while not isinstance(step := advance(steps, outcome), Ended):
            outcome = await self._take(step, conn)
        return step

    async def _take(self, step: Step, conn: AsyncConnection | None) -> Any:
        if isinstance(step, RoundTrip):
            return await conn.round_trip(step.requests, step.sinks)
        if isinstance(step, Local):
            return await asyncio.to_thread(step.run)
        if isinstance(step, Borrow):
            return await self._borrow(step)
        assert isinstance(step, Pause)
        await asyncio.sleep(step.seconds)

    async def _borrow(self, step: Borrow) -> Ended | Broken:
        sent = False
        try:
            async with self._pool.connection() as conn:
                sent = True
                return await self._drive(step.start(conn), conn)
        except ConnectionError as exc:
            return Broken(exc, sent)

    def close(self) -> None:
        self._pool.close()
        self.core.fast.close()
