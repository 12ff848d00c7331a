"""KVClusterClient against `kvstore cluster up` (3 real nodes, real etcd): batches split per
node and run in parallel, a prefix match in one round (sent to every node before any reply is read),
MOVED followed after the map changes."""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import redis

from client import BlockHasher, KVClusterClient, PutsFailed
from loadtest.bench_cluster import cascades_settled


@pytest.fixture(scope="module")
def cluster(cluster_module_factory):
    return cluster_module_factory(nodes=3, dram_size="128mb")


@pytest.fixture
def client(cluster):
    with KVClusterClient([f"{h}:{p}" for h, p in cluster.addrs[:1]]) as kv:
        yield kv


def _commands_served(cluster) -> list[int]:
    return [redis.Redis(*addr).info("stats")["total_commands_processed"] for addr in cluster.addrs]


def test_the_map_names_every_node_and_keys_spread_over_them(client, cluster):
    assert sorted(client.nodes) == sorted(f"{h}:{p}" for h, p in cluster.addrs)
    owners = {client.node_of(f"k{i}") for i in range(100)}
    assert len(owners) == 3


def test_single_key_methods_and_tensors(client):
    value = os.urandom(300_000)
    assert client.put("one", value, overwrite=True) is True
    assert client.get("one") == value
    buf = bytearray(len(value))
    assert client.get_into("one", buf) == len(value) and bytes(buf) == value
    tensor = np.arange(1000, dtype=np.float32)
    assert client.put_tensor("tensor", tensor)
    assert np.array_equal(client.get_tensor("tensor"), tensor)
    assert client.get("absent") is None


def test_puts_that_do_not_wait_land_on_every_node_and_flush_names_what_failed(client):
    """put_nowait and batch_put_nowait across the nodes: each node's commits are waited for by one
    flush, a chain spread over the nodes is matched whole, and a refused commit is named."""
    chain = [(f"nowait:{i}", os.urandom(4096 + i)) for i in range(48)]
    client.batch_put_nowait(chain[:40], parents=[None] + [k for k, _ in chain[:39]])
    for (key, value), (parent, _) in zip(chain[40:], chain[39:]):
        client.put_nowait(key, value, parent=parent)
    assert len({client.node_of(k) for k, _ in chain}) == 3           # the chain spans every node
    assert client.flush() == 48
    assert client.batch_get([k for k, _ in chain]) == [v for _, v in chain]
    assert client.match_prefix([k for k, _ in chain]) == 48
    client.put_nowait("nowait:fits", b"x" * 100)
    client.put_nowait("nowait:too-big", bytes(200 * 1024 * 1024))   # larger than a node's DRAM
    with pytest.raises(PutsFailed) as failed:
        client.flush()
    assert failed.value.keys == [b"nowait:too-big"] and client.get("nowait:fits") == b"x" * 100
    assert client.flush() == 0                                        # reported once


def test_batches_come_back_in_the_callers_order(client):
    items = [(f"batch:{i}", os.urandom(1000 + i)) for i in range(64)]
    assert client.batch_put(items) == [True] * 64
    keys = [k for k, _ in items]
    assert client.batch_get(keys) == [v for _, v in items]
    buffers = [bytearray(2000) for _ in keys]
    assert client.batch_get_into(keys, buffers) == [len(v) for _, v in items]
    assert [bytes(b[:len(v)]) for b, (_, v) in zip(buffers, items)] == [v for _, v in items]
    assert client.exists(*keys, "nope") == 64
    locations = client.locate([keys[0], "nope"])
    assert locations[0].tier == "dram" and locations[1] is None
    assert client.delete(*keys[:10], "nope") == 10
    assert client.exists(*keys) == 54


def test_prefix_match_over_nodes_is_one_parallel_round(client, cluster):
    hasher = BlockHasher("model-x", block_tokens=4)
    tokens = np.arange(4 * 256, dtype=np.int64)
    keys = hasher.keys(tokens)
    assert len({client.node_of(k) for k in keys}) == 3
    cached = 200
    client.batch_put([(k, b"kv" * 50) for k in keys[:cached]], parents=[None] + keys[:cached - 1])
    cascades_settled([redis.Redis(*addr) for addr in cluster.addrs])    # the links' notes (KV.UPLINK) are sent
    first = _commands_served(cluster)
    before = _commands_served(cluster)              # what asking costs (connection set-up, INFO)
    assert client.match_prefix(keys) == cached
    after = _commands_served(cluster)
    overhead = [b - f for b, f in zip(before, first)]
    assert [a - b - o for a, b, o in zip(after, before, overhead)] == [1, 1, 1]   # one KV.MATCH per node
    assert client.match_tokens(hasher, tokens) == cached * 4
    client.delete(keys[50])
    assert client.match_prefix(keys) == 50
    assert client.match_prefix([]) == 0


def test_a_prefix_match_sends_to_every_node_from_the_callers_thread(client, monkeypatch):
    """Requests out on every node's connection before any reply is read: no thread per node."""
    keys = [b"pipelined:%03d" % i for i in range(64)]
    client.batch_put([(k, b"v") for k in keys[:40]], parents=[None] + keys[:39])
    monkeypatch.setattr(client._pool, "submit", lambda *a, **k: pytest.fail("a thread was used"))
    assert client.match_prefix(keys) == 40


def test_a_prefix_match_over_a_stale_map_follows_moved(client, cluster):
    keys = [b"stale-match:%03d" % i for i in range(30)]
    client.batch_put([(k, b"v") for k in keys], parents=[None] + keys[:-1])
    client._map[1][:] = 0                         # every slot on one node: the others' keys get MOVED
    assert client.match_prefix(keys) == 30
    assert len({client.node_of(k) for k in keys}) == 3


def test_remembered_slots_are_bounded(client, monkeypatch):
    monkeypatch.setattr("client.cluster.SLOT_CACHE_KEYS", 100)
    keys = [b"many:%05d" % i for i in range(1000)]
    assert client.match_prefix(keys) == 0
    assert len(client._slots) <= 100


def test_moved_refreshes_a_stale_map(client, cluster):
    key = "stale:1"
    right = client.node_of(key)
    wrong = next(f"{h}:{p}" for h, p in cluster.addrs if f"{h}:{p}" != right)
    index = client.nodes.index(wrong)
    client._map[1][:] = index                     # a map gone stale: every slot on one node
    assert client.put(key, b"v", overwrite=True) and client.get(key) == b"v"
    assert client.node_of(key) == right
    client._map[1][:] = index
    assert client.batch_get([key, "absent"]) == [b"v", None]


def test_stats_and_ping_cover_every_node(client, cluster):
    assert client.ping()
    one_per_node: dict[str, str] = {}
    for i in range(10_000):
        one_per_node.setdefault(client.node_of(f"stats:{i}"), f"stats:{i}")
        if len(one_per_node) == len(cluster.addrs):
            break
    for key in one_per_node.values():
        assert client.put(key, b"v", overwrite=True)
    per_node = [client._client(addr).stats()["keys"] for addr in client.nodes]
    assert len(per_node) == len(cluster.addrs) and all(keys >= 1 for keys in per_node)
    assert client.stats()["keys"] == sum(per_node)     # every node's count, added up


def test_reads_of_a_hot_block_spread_over_its_copies(cluster_factory):
    """Over the wire (a local client's repeated get is a memcpy under a held lease, no request)."""
    # A low threshold: a block cools after a heat window with less than half of it in reads, and a busy
    # host may read slowly; 2 a second keeps the copies while the test reads.
    up = cluster_factory(nodes=3, extra=("--", "--hot-reads", "2"))
    with KVClusterClient([f"{h}:{p}" for h, p in up.addrs], fast_path="off") as kv:
        value = os.urandom(100_000)
        kv.put("hot", value, overwrite=True)
        owner = kv.node_of("hot")
        deadline = time.monotonic() + 20
        while len(kv._hot.get(b"hot", [])) < 3 and time.monotonic() < deadline:
            assert kv.get("hot") == value
        holders = kv._hot[b"hot"]
        assert holders[0] == owner and len(set(holders)) == 3
        probes = {addr: redis.Redis(*addr.rsplit(":", 1)) for addr in holders}
        # Hits, not commands: the owner's lease renewals reach the holders as commands, one a heat window.
        before = {a: p.info("stats")["keyspace_hits"] for a, p in probes.items()}
        for _ in range(60):
            assert kv.get("hot") == value
        after = {a: p.info("stats")["keyspace_hits"] for a, p in probes.items()}
        served = {a: after[a] - before[a] for a in holders}
        assert all(served[a] > 5 for a in holders if a != owner), served       # copies served reads
        assert max(served.values()) - min(served.values()) <= 3, served         # in turn, not at random
        kv.put("hot", b"new", overwrite=True)          # a write removes the copies first
        assert all(kv.get("hot") == b"new" for _ in range(20))


def test_threads_asking_for_one_node_at_once_share_one_client(monkeypatch):
    """No processes: node clients are stand-ins whose opening is slow, so the threads overlap in it."""
    opened: list[str] = []

    class SlowToOpen:
        def __init__(self, host: str, port: int, **_):
            opened.append(f"{host}:{port}")
            time.sleep(0.05)

        def execute(self, *args):
            return [[0, 16383, [b"127.0.0.1", 7001]]]          # CLUSTER SLOTS: one node owns all

        def close(self) -> None:
            pass

    monkeypatch.setattr("client.cluster.KVClient", SlowToOpen)
    threads = 8
    barrier = threading.Barrier(threads)
    with KVClusterClient(["127.0.0.1:7000"]) as kv:
        def ask(_):
            barrier.wait()
            return kv._client("127.0.0.1:7001")
        with ThreadPoolExecutor(threads) as pool:
            clients = list(pool.map(ask, range(threads)))
    assert len({id(c) for c in clients}) == 1
    assert opened.count("127.0.0.1:7001") == 1


def test_a_hot_read_whose_owner_is_dead_is_answered_by_a_copy_in_the_same_call(monkeypatch):
    """No processes: the owner's stand-in refuses connections, a copy holder's answers. Whatever
    holder's turn it is, one read returns the copy's value (a dead owner costs no error)."""
    from client.errors import ConnectionError as KVConnectionError

    class Holder:
        def __init__(self, host: str, port: int, **_):
            self.addr = f"{host}:{port}"

        def execute(self, *args):
            return [[0, 16383, [b"127.0.0.1", 7001]]]          # CLUSTER SLOTS: 7001 owns all

        def get(self, key):
            if self.addr == "127.0.0.1:7001":
                raise KVConnectionError("connection refused")
            return b"from a copy"

        def close(self) -> None:
            pass

    monkeypatch.setattr("client.cluster.KVClient", Holder)
    with KVClusterClient(["127.0.0.1:7000"]) as kv:
        monkeypatch.setattr(kv, "_poll_hot", lambda: None)
        kv._hot = {b"hot": ["127.0.0.1:7001", "127.0.0.1:7002"]}
        assert [kv.get("hot") for _ in range(4)] == [b"from a copy"] * 4
