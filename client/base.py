"""What both clients share: their arguments, and the core and transport they build from them.

`KVClient` and `AsyncKVClient` take the same arguments and differ only in
their transport (blocking or asyncio); each method builds an operation
(`operations`, `layers`) and hands it to the transport, which runs it
through the one sans-I/O `core`.
"""
from __future__ import annotations

import ssl
from typing import Any

from client.connection import Connection
from client.fastpath import FastPath
from client.put_pipeline import PutPipeline
from client.retry import RetryPolicy
from client.sockets import Endpoint
from client.tls import context_for
from proto.fastpath import LEASE_TTL_MS
from proto.wire import DEFAULT_HOST, DEFAULT_PORT


class BaseClient:
    """A client of one store node, over TCP or a Unix socket (the socket wins when both are given).

    ``fast_path``: "auto" moves gets, puts, tensors and layers through the node's
    shared-memory arena when the node is on this host, "required" raises
    FastPathUnavailable when it is not, "off" always uses the socket. A node that
    refuses the arena to the user (an ACL user restricted to some keys) means the
    socket in "auto" mode.

    ``username``/``password``: the ACL user to log in as (the default user when no
    username). ``tls``: True (the system's trusted CAs) or an `ssl.SSLContext` (your
    CA, a client certificate) for a node's --tls-port; TCP only. ``readonly``: send
    READONLY on every connection (a cluster node then serves its copies of hot blocks).
    """

    transport_class: Any = None

    def __init__(self, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *,
                 password: str | None = None, unix_socket: str | None = None,
                 timeout: float | None = 5.0, retries: int = 3, pool_size: int = 8,
                 fast_path: str = "auto", lease_ttl_ms: int = LEASE_TTL_MS,
                 username: str | None = None, tls: bool | ssl.SSLContext | None = None,
                 readonly: bool = False):
        self.endpoint = Endpoint(host, port, unix_socket, context_for(tls), username, readonly)
        self.fast_path = FastPath(self.endpoint, password, timeout, fast_path, lease_ttl_ms)
        self._transport = self.transport_class(self.endpoint, self.fast_path, RetryPolicy(retries),
                                               password=password, timeout=timeout, pool_size=pool_size)
        endpoint = self.endpoint
        self._puts = PutPipeline(lambda: Connection(endpoint, timeout, password), self.fast_path,
                                 self.fast_path.reservation_ttl_ms)

    def _settled(self, keys: Any) -> None:
        """Read-your-writes: wait for the pending commits (put_nowait) of any of ``keys``."""
        if self._puts.pending():
            self._puts.settle(keys)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.endpoint})"
