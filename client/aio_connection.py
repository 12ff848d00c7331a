"""One asyncio connection to a store node: the asyncio counterpart of `connection.py`.

It drives the same sans-I/O `ReplyReader` and sends the same `resp.pack`
buffers; only the waiting differs. The raw non-blocking socket is used
directly (`loop.sock_recv_into`, and `sendmsg` with a writability wait),
not asyncio streams, so large values are still received straight into their
destination with no intermediate buffer (over TLS, through `client.tls.AsyncTLS`).
The timeout is an inactivity timeout, as a blocking socket's is: the deadline
moves forward whenever bytes arrive, so a large batch does not time out while
it is flowing.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Any, Sequence

from client import resp
from client.errors import ConnectionError
from client.sockets import Endpoint, SocketConnection, check_handshake, handshake, socket_errors, tune
from client.tls import AsyncTLS


class AsyncConnection(SocketConnection):
    """A connected, authenticated non-blocking socket and its receive buffer."""

    def __init__(self, endpoint: Endpoint, sock: socket.socket, timeout: float | None):
        super().__init__(endpoint, sock)
        self._timeout = timeout
        self._loop = asyncio.get_running_loop()
        tcp_tls = endpoint.tls is not None and not endpoint.unix_socket
        self._tls = AsyncTLS(sock, endpoint.tls, endpoint.host) if tcp_tls else None

    @classmethod
    async def open(cls, endpoint: Endpoint, timeout: float | None,
                   password: str | None = None) -> AsyncConnection:
        with socket_errors(f"connecting to {endpoint}"):
            async with asyncio.timeout(timeout):
                sock = await _connect(endpoint)
        conn = cls(endpoint, sock, timeout)
        try:
            if conn._tls is not None:
                with socket_errors(f"TLS handshake with {endpoint}"):
                    async with asyncio.timeout(timeout):
                        await conn._tls.handshake()
            check_handshake(await conn.round_trip(handshake(password, endpoint.username, endpoint.readonly)))
        except BaseException:
            conn.close()
            raise
        return conn

    async def round_trip(self, requests: Sequence[Sequence[Any]],
                         sinks: Sequence[resp.Sink] | None = None) -> list[Any]:
        """Send all requests at once, then read one reply per request."""
        if not requests:
            return []
        sinks = sinks or [None] * len(requests)
        with socket_errors(f"request to {self.endpoint}"):
            async with asyncio.timeout(self._timeout) as deadline:
                await self._send(resp.pack(requests), deadline)
                return [await self._drive(self._reader.read(sink), deadline) for sink in sinks]

    async def _send(self, buffers: list, deadline: asyncio.Timeout) -> None:
        if self._tls is not None:
            await self._tls.send(buffers)
            self._progress(deadline)
            return
        while buffers:
            try:
                sent = self._sock.sendmsg(buffers[:resp.IOV_MAX])
            except (BlockingIOError, InterruptedError):
                await self._writable()
                continue
            self._progress(deadline)
            buffers = resp.drop_sent(buffers, sent)

    async def _drive(self, parse: resp.Receive, deadline: asyncio.Timeout) -> Any:
        try:
            view = next(parse)
            while True:
                received = await (self._tls.recv_into(view) if self._tls is not None
                                  else self._loop.sock_recv_into(self._sock, view))
                if not received:
                    raise ConnectionError(f"{self.endpoint} closed the connection")
                self._progress(deadline)
                view = parse.send(received)
        except StopIteration as done:
            return done.value

    def _progress(self, deadline: asyncio.Timeout) -> None:
        if self._timeout is not None:
            deadline.reschedule(self._loop.time() + self._timeout)

    async def _writable(self) -> None:
        ready = self._loop.create_future()
        fd = self._sock.fileno()
        self._loop.add_writer(fd, _wake, ready)
        try:
            await ready
        finally:
            self._loop.remove_writer(fd)


def _wake(ready: asyncio.Future) -> None:
    if not ready.done():
        ready.set_result(None)


async def _connect(endpoint: Endpoint) -> socket.socket:
    loop = asyncio.get_running_loop()
    if endpoint.unix_socket:
        family, address = socket.AF_UNIX, endpoint.unix_socket
    else:
        infos = await loop.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    tune(sock)
    return sock
