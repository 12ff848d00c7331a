"""`kvstore cluster up --netns --nic-rate`: each node a host of its own (network namespace,
veth on a bridge, tc tbf cap). Runs where `ip netns` is permitted; says why when it skips."""
from __future__ import annotations

import subprocess

import pytest
import redis

from kvstore.cluster.netns import netns_available

AVAILABLE, WHY_NOT = netns_available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"network namespaces unavailable here: {WHY_NOT}")


def test_nodes_live_in_their_own_namespaces_behind_capped_links(cluster_factory):
    up = cluster_factory(nodes=2, extra=("--netns", "--nic-rate", "200mbit"))
    namespaces = up.info["netns"]
    assert len(namespaces) == 2 and up.info["nic_rate"] == "200mbit"
    assert all(not host.startswith("127.") for host, _ in up.addrs)
    for (host, port), ns in zip(up.addrs, namespaces):
        client = redis.Redis(host, port)
        assert client.ping()
        assert client.info("cluster")["cluster_enabled"] == 1
        qdiscs = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show"],
                                capture_output=True, text=True).stdout
        assert "tbf" in qdiscs and "rate 200Mbit" in qdiscs
    cluster_factory.stop(up)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces), "namespaces are removed when the cluster stops"
