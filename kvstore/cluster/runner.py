"""Cluster mode from a server's point of view: parse ``--cluster``, join, and leave.

A server started with ``--cluster etcd://HOST:PORT/NAME`` calls `start_cluster`
once it listens (so it knows its port), keeps the returned `ClusterState` as
``server.cluster``, and calls ``await server.cluster.stop()`` when it shuts
down: a clean stop revokes the node's lease, so the leader moves its slots at
once instead of after the node timeout.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from kvstore.cluster.etcd_kv import EtcdKV
from kvstore.cluster.membership import ClusterError, EtcdMembership
from kvstore.cluster.node import ClusterState, new_node_id
from kvstore.cluster.slots import SlotMapError, check_address

DEFAULT_NODE_TIMEOUT = 5.0
DEFAULT_CONNECT_TIMEOUT = 10.0
_URL = re.compile(r"(?P<scheme>etcd|http)://(?P<host>\[[0-9A-Fa-f:.]+\]|[^:/\s\[\]]+):(?P<port>\d{1,5})"
                  r"(?:/(?P<name>[A-Za-z0-9_.-]{1,64}))?/?")
DEFAULT_NAME = "kvstore"
_WILDCARDS = ("0.0.0.0", "::", "*", "")


@dataclass(frozen=True)
class ClusterURL:
    """Where a cluster's membership lives: an etcd endpoint and the cluster's name in it."""

    host: str
    port: int
    name: str

    @classmethod
    def parse(cls, text: str, name: str | None = None) -> "ClusterURL":
        """``etcd://HOST:PORT/NAME``; etcd's own ``http://HOST:PORT`` is taken too (a user pastes either),
        with ``name`` (else the default cluster name) when the URL carries none."""
        match = _URL.fullmatch(text)
        if match is None or not 0 < int(match["port"]) < 65536:
            raise ClusterError(f"bad cluster URL {text!r}: want etcd://HOST:PORT/NAME (or http://HOST:PORT), "
                               f"NAME of letters, digits, '.', '_' or '-'")
        return cls(match["host"].strip("[]"), int(match["port"]), match["name"] or name or DEFAULT_NAME)

    @property
    def etcd(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"etcd://{host}:{self.port}/{self.name}"


def announce_address(bind: str, port: int, announce: str | None = None) -> str:
    """The ``host:port`` other nodes and clients reach this node at.

    ``announce`` when given, else the first bound address with the listening
    port; a wildcard bind cannot be announced and needs ``--announce``.
    """
    if announce is None:
        host = bind.split()[0] if bind.split() else ""
        if host in _WILDCARDS:
            raise ClusterError(f"cannot announce the wildcard address {host!r}: give --announce HOST:PORT")
        announce = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        check_address(announce)
    except SlotMapError as e:
        raise ClusterError(str(e)) from None
    return announce


async def start_cluster(url: str, announce: str, node_timeout: float = DEFAULT_NODE_TIMEOUT,
                        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT) -> ClusterState:
    """Join the cluster at ``url`` as ``announce``; ClusterError (with the reason) when that fails."""
    where = ClusterURL.parse(url)
    kv = EtcdKV(where.host, where.port, timeout=max(0.5, min(2.0, node_timeout / 3)))
    membership = EtcdMembership(kv, where.name, node_timeout, connect_timeout=connect_timeout,
                                where=f"etcd at {where.etcd}")
    state = ClusterState(new_node_id(), announce, membership)
    try:
        await state.start()
    except BaseException:
        await kv.close()
        raise
    return state
