"""One blocking connection to a store node: send a pipeline, read its replies.

A round trip writes every request with `sendmsg` of the buffers laid out by
`resp.pack` (large values go out from the caller's memory; over TLS one
buffer at a time, client/tls.py), then drives the
sans-I/O `ReplyReader` once per request, answering each memoryview it yields
with one `recv_into`. The socket's timeout bounds every wait; a timeout or a
socket error leaves the connection in an unknown state, so the pool closes it.
"""
from __future__ import annotations

import socket
import ssl
from array import array
from typing import Any, Sequence

from client import resp
from client.errors import ConnectionError
from client.sockets import (Endpoint, SocketConnection, check_handshake, handshake, kernel_timeouts, socket_errors,
                            tune)
from client.tls import send_blocking, wrap_blocking

MAX_FDS = 4             # file descriptors accepted with one reply


class Connection(SocketConnection):
    """A connected, authenticated socket and its receive buffer."""

    def __init__(self, endpoint: Endpoint, timeout: float | None, password: str | None = None):
        with socket_errors(f"connecting to {endpoint}"):
            super().__init__(endpoint, _connect(endpoint, timeout))
        self._over_tls = isinstance(self._sock, ssl.SSLSocket)
        try:
            check_handshake(self.round_trip(handshake(password, endpoint.username, endpoint.readonly)))
        except BaseException:
            self.close()
            raise

    def round_trip(self, requests: Sequence[Sequence[Any]],
                   sinks: Sequence[resp.Sink] | None = None) -> list[Any]:
        """Send all requests at once, then read one reply per request."""
        if not requests:
            return []
        self.send(requests)
        return self.receive(sinks or [None] * len(requests))

    def send(self, requests: Sequence[Sequence[Any]]) -> None:
        """The first half of a round trip: send requests whose replies `receive` reads later
        (several connections' requests can then be in flight at once)."""
        with socket_errors(f"request to {self.endpoint}"):
            self._send(resp.pack(requests))

    def receive(self, sinks: Sequence[resp.Sink]) -> list[Any]:
        """The second half: one reply per sink, for requests already sent."""
        with socket_errors(f"request to {self.endpoint}"):
            return [self._drive(self._reader.read(sink)) for sink in sinks]

    def round_trip_fds(self, requests: Sequence[Sequence[Any]]) -> tuple[list[Any], list[int]]:
        """A round trip whose replies may carry file descriptors (SCM_RIGHTS, Unix socket only)."""
        fds: list[int] = []
        passing = None if self._over_tls else fds          # TLS passes no descriptors
        with socket_errors(f"request to {self.endpoint}"):
            self._send(resp.pack(requests))
            return [self._drive(self._reader.read(None), passing) for _ in requests], fds

    def _send(self, buffers: list) -> None:
        if self._over_tls:
            send_blocking(self._sock, buffers)
            return
        while buffers:
            sent = self._sock.sendmsg(buffers[:resp.IOV_MAX])
            buffers = resp.drop_sent(buffers, sent)

    def _drive(self, parse: resp.Receive, fds: list[int] | None = None) -> Any:
        try:
            view = next(parse)
            while True:
                received = self._sock.recv_into(view) if fds is None else self._recv_fds(view, fds)
                if not received:
                    raise ConnectionError(f"{self.endpoint} closed the connection")
                view = parse.send(received)
        except StopIteration as done:
            return done.value

    def _recv_fds(self, view: memoryview, fds: list[int]) -> int:
        received, ancillary, _, _ = self._sock.recvmsg_into([view], socket.CMSG_SPACE(MAX_FDS * 4))
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array("i", data[:len(data) - len(data) % 4]))
        return received


def _connect(endpoint: Endpoint, timeout: float | None) -> socket.socket:
    if not endpoint.unix_socket:
        sock = socket.create_connection((endpoint.host, endpoint.port), timeout)
        if endpoint.tls:
            sock = wrap_blocking(sock, endpoint.tls, endpoint.host)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(endpoint.unix_socket)
        except BaseException:
            sock.close()
            raise
    tune(sock)
    if not endpoint.tls:
        kernel_timeouts(sock, timeout)
    return sock
