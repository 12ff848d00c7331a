"""TLS for the SDK's connections: ``KVClient(..., tls=True)`` or ``tls=ssl_context``.

The blocking connection wraps its socket in an `ssl.SSLSocket`, which reads
and writes like the plain one, except that it has no ``sendmsg`` (buffers go
out one by one) and passes no file descriptors (the fast path maps the arena
through /proc instead). The asyncio connection cannot: asyncio's socket
methods refuse an SSLSocket. It keeps its raw non-blocking socket and runs
TLS in memory (`AsyncTLS`: an `ssl.SSLObject` between two `MemoryBIO`s), so
it still waits with ``sock_recv``/``sock_sendall`` and its inactivity timeout
still covers every wait.
"""
from __future__ import annotations

import asyncio
import socket
import ssl

READ_CHUNK = 256 * 1024


def context_for(tls: bool | ssl.SSLContext | None) -> ssl.SSLContext | None:
    """The context a ``tls=`` argument means: True is the system's default (verified) one."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return ssl.create_default_context()
    if isinstance(tls, ssl.SSLContext):
        return tls
    raise TypeError(f"tls must be True, False, None or an ssl.SSLContext, not {type(tls).__name__}")


def wrap_blocking(sock: socket.socket, context: ssl.SSLContext, host: str) -> ssl.SSLSocket:
    """Handshake on a connected blocking socket (its timeout bounds the handshake)."""
    try:
        return context.wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise


def send_blocking(sock: ssl.SSLSocket, buffers: list) -> None:
    for buf in buffers:
        sock.sendall(buf)


class AsyncTLS:
    """TLS over a connected non-blocking socket, for the asyncio connection."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, host: str):
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_hostname=host)

    async def handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    raise ConnectionResetError("the node closed the connection during the TLS handshake")
        await self._flush()

    async def recv_into(self, view: memoryview) -> int:
        """Decrypted bytes into ``view``; 0 when the node closed the connection."""
        while True:
            try:
                return self._tls.read(len(view), view)
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    return 0
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0

    async def send(self, buffers: list) -> None:
        for buf in buffers:
            self._tls.write(buf)
            await self._flush()

    async def _flush(self) -> None:
        data = self._outgoing.read()
        if data:
            await self._loop.sock_sendall(self._sock, data)

    async def _fill(self) -> bool:
        data = await self._loop.sock_recv(self._sock, READ_CHUNK)
        if not data:
            self._incoming.write_eof()
            return False
        self._incoming.write(data)
        return True
