"""Chain links travel with moved values (kvstore/cluster/moved_links.py): 3 real node processes over a
real etcd (tests/cluster_procs.py), a 4th joins, and dropping a chain's first block still drops the
rest of it, on every node, the newcomer included."""
from __future__ import annotations

import redis

from client import KVClusterClient
from tests.conftest import wait_until
from tests.test_cluster_migration import joined


def _cached(kv: KVClusterClient, keys: list[bytes]) -> list[bool]:
    return [loc is not None for loc in kv.locate(keys)]


def _cluster_info(addr: str) -> dict:
    return redis.Redis(*addr.rsplit(":", 1)).info("cluster")


def _links_delivered(addrs: list[str]) -> bool:
    """Every source sent what it noted (and sent some): the links are at their new owners."""
    infos = [_cluster_info(addr) for addr in addrs]
    return sum(i["cluster_moved_links"] for i in infos) > 0 and not any(i["cluster_moved_links_pending"] for i in infos)


def test_after_a_join_dropping_a_chains_first_block_still_drops_the_rest_everywhere(cluster_factory):
    up = cluster_factory(3, extra=("--node-timeout", "2", "--", "--hot-reads", "0"))
    addrs = [f"{h}:{p}" for h, p in up.addrs]
    chains = [[b"moved-%02d-%03d" % (c, i) for i in range(32)] for c in range(8)]
    with KVClusterClient(addrs, fast_path="off") as kv:
        for keys in chains:
            kv.batch_put([(k, bytes(1000)) for k in keys], parents=[None] + keys[:-1])
    joiner = cluster_factory.join(up, "--cluster-node-timeout", "2", "--hot-reads", "0")
    addr = f"127.0.0.1:{joiner.port}"
    wait_until(lambda: joined(addr, 4), what="the join")
    with KVClusterClient([addr, *addrs], fast_path="off") as kv:
        on_joiner = [k for keys in chains for k in keys if kv.node_of(k) == addr]
        wait_until(lambda: _cluster_info(addr)["cluster_imported_keys"] >= len(on_joiner),
                   what="the joiner's blocks to arrive (each source notes their links as they leave)")
        wait_until(lambda: _links_delivered(addrs), what="the moved links to reach their new owners")
        assert len(on_joiner) > 20 and all(_cached(kv, keys) == [True] * 32 for keys in chains)
        for keys in chains:
            kv.delete(keys[0])
        wait_until(lambda: not any(any(_cached(kv, keys)) for keys in chains),
                   what="every chain to go, its moved blocks included")
