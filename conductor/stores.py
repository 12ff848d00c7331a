"""Opening the store a conductor or a worker talks to: one node, or a cluster found through etcd.

`--store HOST:PORT` names one node (a `KVClient`). `--cluster
etcd://HOST:PORT/NAME` names a cluster by where its membership lives: the
live nodes are read once from etcd (the keys `kvstore cluster status`
reads) and handed to `KVClusterClient` as seeds; from then on that client
follows the slot map itself (CLUSTER SLOTS, MOVED, ASK), so etcd is never
on the data path and a node that joins later is learned from the map.

Both clients have the methods the conductor (`match_prefix`, `locate`) and
the workers' connector (`match_prefix`, `put_layer`, `get_layers`) call, so
nothing above this module knows which one it holds. Reading etcd uses the
store's own cluster code as a library (imported only for `--cluster`), as
the simulator uses the store's eviction policies.
"""
from __future__ import annotations

import asyncio
from typing import Union

from client import KVClient, KVClusterClient, KVError

Store = Union[KVClient, KVClusterClient]


class StoreError(Exception):
    """The store cannot be reached or found; the message says which and why."""


def cluster_nodes(url: str) -> list[str]:
    """"host:port" of the live nodes of the cluster at ``url`` (etcd://HOST:PORT/NAME)."""
    from kvstore.cluster.subcommand import read_snapshot
    from kvstore.cluster.kv import Unavailable
    from kvstore.cluster.membership import ClusterError
    from kvstore.cluster.runner import ClusterURL

    try:
        where = ClusterURL.parse(url)
    except ClusterError as exc:
        raise StoreError(str(exc)) from None
    try:
        snapshot = asyncio.run(read_snapshot(where))
    except Unavailable as exc:
        raise StoreError(f"cannot read cluster {where.name} from etcd at {where.etcd}: {exc}") from None
    if not snapshot.nodes:
        raise StoreError(f"cluster {where.name} at etcd {where.etcd} has no live node")
    return sorted(snapshot.nodes.values())


def open_store(node: tuple[str, int] | None = None, cluster: str | None = None, *,
               unix_socket: str | None = None, password: str | None = None) -> Store:
    """A connected client of one node or of the cluster at ``cluster``; StoreError when unreachable."""
    if (node is None) == (cluster is None):
        raise ValueError("name one node or one cluster")
    where = cluster or f"{node[0]}:{node[1]}"
    try:
        if cluster is not None:
            store: Store = KVClusterClient(cluster_nodes(cluster), password=password)
        else:
            store = KVClient(*node, unix_socket=unix_socket, password=password)
    except (KVError, OSError) as exc:
        raise StoreError(f"cannot reach the store at {where}: {exc}") from None
    try:
        store.ping()
    except (KVError, OSError) as exc:
        store.close()
        raise StoreError(f"cannot reach the store at {where}: {exc}") from None
    return store
