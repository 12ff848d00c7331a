"""Where a load run's users connect: one node, a list of cluster nodes, or a cluster named by its etcd.

``--host HOST:PORT`` is one node; ``--host H1:P1,H2:P2`` is a cluster (any of
its nodes is enough: the SDK learns the rest from ``CLUSTER SLOTS``);
``--cluster etcd://HOST:PORT/NAME`` reads the nodes a cluster registered in
etcd. etcd is asked through its JSON gateway (``/v3/kv/range``) with the
standard library: under locust everything runs on gevent, and the gRPC
client the nodes use does not cooperate with it.
"""
from __future__ import annotations

import base64
import json
import urllib.request
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster

from client import KVClient, KVClusterClient
from kvstore.cluster.runner import ClusterURL


@dataclass(frozen=True)
class Target:
    """The nodes to load; ``cluster`` when they are a cluster's (even a list of one)."""

    nodes: tuple[str, ...]
    cluster: bool

    @property
    def first(self) -> tuple[str, int]:
        host, _, port = self.nodes[0].rpartition(":")
        return host.strip("[]"), int(port)


def parse_target(host: str | None, cluster_url: str | None = None) -> Target:
    """The target of ``--host`` (HOST:PORT, or a comma-separated list) or ``--cluster`` (etcd://...)."""
    if cluster_url:
        return Target(tuple(cluster_nodes(cluster_url)), True)
    if not host:
        raise ValueError("name the store: --host HOST:PORT[,HOST:PORT...] or --cluster etcd://HOST:PORT/NAME")
    nodes = tuple(part.strip() for part in host.removeprefix("redis://").split(",") if part.strip())
    for node in nodes:
        _, sep, port = node.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"bad node {node!r} in --host: want HOST:PORT")
    return Target(nodes, len(nodes) > 1)


def cluster_nodes(url: str, timeout: float = 5.0) -> list[str]:
    """The "host:port" of every node registered under a cluster's etcd prefix."""
    parsed = ClusterURL.parse(url)
    prefix = f"/kvstore/{parsed.name}/nodes/".encode()
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    body = json.dumps({"key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(end).decode()})
    request = urllib.request.Request(parsed.etcd + "/v3/kv/range", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        found = json.load(reply).get("kvs", [])
    nodes = sorted(base64.b64decode(kv["value"]).decode() for kv in found)
    if not nodes:
        raise ValueError(f"no node of cluster {parsed.name!r} is registered in etcd at {parsed.etcd}")
    return nodes


def kv_client(target: Target, **options: Any) -> KVClient | KVClusterClient:
    """The SDK's client for the target: one node's, or the cluster's."""
    if target.cluster:
        return KVClusterClient(list(target.nodes), **options)
    host, port = target.first
    return KVClient(host, port, **options)


def redis_client(target: Target, timeout: float) -> redis.Redis | RedisCluster:
    """redis-py's client for the target (`RedisCluster` for a cluster)."""
    if target.cluster:
        nodes = [ClusterNode(h.strip("[]"), int(p)) for h, _, p in (n.rpartition(":") for n in target.nodes)]
        return RedisCluster(startup_nodes=nodes, socket_timeout=timeout)
    host, port = target.first
    return redis.Redis(host, port, socket_timeout=timeout)
