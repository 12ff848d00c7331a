"""Small connection pools: a thread-safe one for KVClient, an asyncio one for AsyncKVClient.

A pool holds at most `size` connections open at once; a caller that finds
them all busy waits up to the client's timeout for one to come back, so a
client never opens more sockets against a node than it was configured for.
Connections are made lazily, reused last-in first-out (the warmest receive
buffer first), and checked for staleness when taken out, so a connection the
server closed while idle is replaced before a request is written on it.

A connection comes back to the pool only when its round trip completed. Any
exception inside the `with` block (a socket error, a timeout, a cancelled
task) may leave replies unread, so that connection is closed instead.
"""
from __future__ import annotations

import asyncio
import builtins
import threading
from contextlib import asynccontextmanager, contextmanager
from typing import AsyncIterator, Awaitable, Callable, Generic, Iterator, Protocol, TypeVar

from client.errors import KVError, TimeoutError


class Pooled(Protocol):
    def is_stale(self) -> bool: ...
    def close(self) -> None: ...


C = TypeVar("C", bound=Pooled)


class IdleConnections(Generic[C]):
    """The idle connections of a pool, newest last; the callers' waiting is the pool's business."""

    def __init__(self) -> None:
        self._idle: list[C] = []
        self.closed = False

    def take(self) -> C | None:
        """The most recently returned connection that is still healthy, or None."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.is_stale():
                return conn
            conn.close()
        return None

    def give(self, conn: C) -> None:
        if self.closed:
            conn.close()
        else:
            self._idle.append(conn)

    def close_all(self) -> None:
        self.closed = True
        while self._idle:
            self._idle.pop().close()


class ConnectionPool(Generic[C]):
    """A thread-safe pool of blocking connections."""

    def __init__(self, connect: Callable[[], C], size: int, timeout: float | None):
        self._connect = connect
        self._size = size
        self._timeout = timeout
        self._borrowed = 0
        self._changed = threading.Condition(threading.Lock())
        self._idle: IdleConnections[C] = IdleConnections()

    @contextmanager
    def connection(self) -> Iterator[C]:
        """Borrow a connection for one round trip."""
        conn = self._borrow()
        try:
            yield conn
        except BaseException:
            conn.close()
            self._give_back(None)
            raise
        self._give_back(conn)

    def close(self) -> None:
        with self._changed:
            self._idle.close_all()

    def _borrow(self) -> C:
        with self._changed:
            if self._idle.closed:
                raise KVError("the client is closed")
            if not self._changed.wait_for(lambda: self._borrowed < self._size, self._timeout):
                raise TimeoutError("no pooled connection became free in time")
            self._borrowed += 1
            conn = self._idle.take()
        if conn is not None:
            return conn
        try:
            return self._connect()
        except BaseException:
            self._give_back(None)
            raise

    def _give_back(self, conn: C | None) -> None:
        with self._changed:
            self._borrowed -= 1
            if conn is not None:
                self._idle.give(conn)
            self._changed.notify()


class AsyncConnectionPool(Generic[C]):
    """A pool of asyncio connections, for use from one event loop."""

    def __init__(self, connect: Callable[[], Awaitable[C]], size: int, timeout: float | None):
        self._connect = connect
        self._slots = asyncio.Semaphore(size)
        self._timeout = timeout
        self._idle: IdleConnections[C] = IdleConnections()

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[C]:
        """Borrow a connection for one round trip."""
        if self._idle.closed:
            raise KVError("the client is closed")
        try:
            async with asyncio.timeout(self._timeout):
                await self._slots.acquire()
        except builtins.TimeoutError as exc:
            raise TimeoutError("no pooled connection became free in time") from exc
        try:
            conn = self._idle.take() or await self._connect()
            try:
                yield conn
            except BaseException:
                conn.close()
                raise
            self._idle.give(conn)
        finally:
            self._slots.release()

    def close(self) -> None:
        self._idle.close_all()
