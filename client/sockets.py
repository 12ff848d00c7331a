"""Where a connection goes and what both connection kinds do to their sockets.

A connection is a plain socket (TCP or Unix) and a `ReplyReader`. The sync
and async connections differ only in how they wait; the endpoint, the socket
options, the handshake and the check for a dead idle connection live here.

The staleness check is what lets a server restart go unnoticed: an idle
pooled connection has nothing to read, so if poll() says it is readable the
peer closed it (or sent something unasked) and the pool replaces it before a
request is written on it. That matters most for puts, which are not retried
once sent. `PeerWatch` asks only whether the node closed its end (it died
or restarted), from any thread: a lease taken on a connection is trusted only
while the node that granted it is alive.
"""
from __future__ import annotations

import builtins
import select
import socket
import ssl
import struct
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from client import resp
from client.errors import AuthenticationError, ConnectionError, KVError, ResponseError, TimeoutError


@dataclass(frozen=True)
class Endpoint:
    """A server address (a Unix socket path when given, else host and TCP port), and how a
    session on it opens: TLS over TCP when ``tls`` is a context, as ``username`` (an ACL
    user; the default user when None), and with READONLY when ``readonly`` (a cluster
    node then serves the copies it holds of other nodes' hot blocks)."""

    host: str
    port: int
    unix_socket: str | None = None
    tls: ssl.SSLContext | None = None
    username: str | None = None
    readonly: bool = False

    def __str__(self) -> str:
        return f"unix:{self.unix_socket}" if self.unix_socket else f"{self.host}:{self.port}"


def tune(sock: socket.socket) -> None:
    """Socket options for request/reply traffic: no Nagle delay on small commands."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def kernel_timeouts(sock: socket.socket, timeout: float | None) -> None:
    """Bound a blocking socket's waits in the kernel (SO_RCVTIMEO, SO_SNDTIMEO) instead of
    with Python's socket timeout.

    With a Python timeout every wait is a failed non-blocking call, a poll() and the call
    again: about 30 us more a round trip on a Unix socket on these machines (measured with
    a bare PING loop), which is a tenth of a 1 MiB put. A wait that runs out raises
    BlockingIOError, which `socket_errors` reports as the SDK's TimeoutError.
    """
    sock.settimeout(None)
    seconds = 0.0 if timeout is None else max(timeout, 1e-6)
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


class PeerWatch:
    """Whether the node has closed its end of a socket (it died or restarted).

    Safe from any thread while another uses the socket: it polls with a fresh
    registration, not the connection's own, and sees the peer's close even
    behind unread data. A poll is a system call and a held lease asks before
    every copy it vouches for, so an answer "open" stands for `RECHECK_S`: far
    less than any node takes to start again on the same address (a new process,
    a new arena), so nothing a restarted node says is ever contradicted by a
    dead one's bytes.
    """

    RECHECK_S = 0.001

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._open_until = 0.0

    def closed(self) -> bool:
        now = time.monotonic()
        if now < self._open_until:
            return False
        if self._sock.fileno() < 0:
            return True
        poller = select.poll()
        poller.register(self._sock, select.POLLRDHUP)
        if poller.poll(0):
            return True
        self._open_until = now + self.RECHECK_S
        return False


class SocketConnection:
    """What both connection kinds keep and answer alike: the socket, its receive buffer,
    and whether it is fit to reuse or was closed by the node."""

    def __init__(self, endpoint: Endpoint, sock: socket.socket):
        self.endpoint = endpoint
        self._sock = sock
        self._reader = resp.ReplyReader()
        self._poller = select.poll()         # made once: `is_stale` runs on every borrow
        self._poller.register(sock, select.POLLIN | select.POLLPRI)
        self.peer = PeerWatch(sock)

    def is_stale(self) -> bool:
        """True when an idle connection is readable (closed by the peer, or out of step)
        or holds unread bytes."""
        return self._reader.buffered > 0 or bool(self._poller.poll(0))

    def close(self) -> None:
        self._sock.close()


def handshake(password: str | None, username: str | None = None,
              readonly: bool = False) -> list[tuple[str, ...]]:
    """The commands a fresh connection sends before any request."""
    if username is not None:
        commands = [("AUTH", username, password or "")]
    else:
        commands = [("AUTH", password)] if password is not None else []
    return commands + [("READONLY",)] if readonly else commands


def check_handshake(replies: list[Any]) -> None:
    """Raise when the server refused the handshake."""
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise AuthenticationError(reply.message)


@contextmanager
def socket_errors(doing: str) -> Iterator[None]:
    """Turn the socket layer's exceptions into the SDK's, naming what was being done."""
    try:
        yield
    except KVError:
        raise
    except (builtins.TimeoutError, BlockingIOError) as exc:
        raise TimeoutError(f"{doing}: no answer in time") from exc
    except OSError as exc:
        raise ConnectionError(f"{doing}: {exc}") from exc
