"""A cluster that speaks TLS (`--tls-cluster yes`): nodes announce their TLS port and move slot values
to each other over TLS; redis-py's RedisCluster reaches them with ssl=True. Real nodes, real etcd."""
from __future__ import annotations

import redis
from redis.cluster import RedisCluster

from loadtest.certs import make_certificates
from tests.conftest import free_port, wait_until


def _node(kvstore_factory, certs, etcd_url: str):
    tls_port = free_port()
    daemon = kvstore_factory("--tls-port", str(tls_port), *certs.server_flags("optional"),
                             "--tls-cluster", "yes", "--cluster", etcd_url, "--cluster-node-timeout", "2")
    return daemon, tls_port


def _slots(daemon) -> list:
    """CLUSTER SLOTS; empty while the node is still joining (it serves before etcd has answered)."""
    try:
        return redis.Redis(daemon.host, daemon.port).execute_command("CLUSTER", "SLOTS")
    except redis.ResponseError:
        return []


def test_nodes_announce_their_tls_port_and_move_values_over_tls(tmp_path, etcd, kvstore_factory):
    certs = make_certificates(tmp_path / "certs")
    url = f"etcd://127.0.0.1:{etcd.client_port}/tls"
    first, first_tls = _node(kvstore_factory, certs, url)
    wait_until(lambda: len(_slots(first)) == 1, what="the first node to own every slot")
    assert _slots(first)[0][2][1] == first_tls
    tls = dict(ssl=True, ssl_ca_certs=certs.ca, ssl_certfile=certs.client_cert, ssl_keyfile=certs.client_key)
    client = RedisCluster(host="127.0.0.1", port=first_tls, **tls)
    for i in range(200):
        client.set(f"k{i}", f"v{i}")
    second, second_tls = _node(kvstore_factory, certs, url)
    wait_until(lambda: {entry[2][1] for entry in _slots(first)} == {first_tls, second_tls}, timeout=30,
               what="the second node to take its slots")
    wait_until(lambda: redis.Redis(first.host, first.port).info("cluster").get("cluster_moved_keys", 0) > 0,
               timeout=30, what="values to move to the second node")
    client = RedisCluster(host="127.0.0.1", port=second_tls, **tls)
    assert [client.get(f"k{i}") for i in range(200)] == [f"v{i}".encode() for i in range(200)]
