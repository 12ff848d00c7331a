"""Unchanged cluster-aware Redis clients against `kvstore cluster up` (3 real nodes, real etcd):
redis-py RedisCluster (sync and asyncio), redis-cli -c, and the redirection replies byte for byte."""
from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess

import pytest
import redis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

from kvstore.cluster.slots import keyslot


@pytest.fixture(scope="module")
def cluster(cluster_module_factory):
    return cluster_module_factory(nodes=3)


def _raw(addr: tuple[str, int], *args) -> bytes:
    out = b"*%d\r\n" % len(args)
    for arg in args:
        arg = arg if isinstance(arg, bytes) else str(arg).encode()
        out += b"$%d\r\n%s\r\n" % (len(arg), arg)
    with socket.create_connection(addr, timeout=5) as sock:
        sock.sendall(out)
        return sock.recv(1 << 16)


def _owner_of(cluster, key: str) -> tuple[str, int]:
    client = redis.Redis(*cluster.addrs[0])
    slot = keyslot(key.encode())
    for start, end, (host, port, *_), *_ in client.execute_command("CLUSTER", "SLOTS"):
        if start <= slot <= end:
            return host.decode() if isinstance(host, bytes) else host, port
    raise AssertionError(f"slot {slot} not covered")


def test_moved_crossslot_and_cluster_info_are_redis_replies(cluster):
    key = "user:1000"
    owner = _owner_of(cluster, key)
    other = next(a for a in cluster.addrs if a != owner)
    slot = keyslot(key.encode())
    assert _raw(other, "GET", key) == b"-MOVED %d %s:%d\r\n" % (slot, owner[0].encode(), owner[1])
    assert _raw(owner, "MSET", "a", "1", "b", "2") == b"-CROSSSLOT Keys in request don't hash to the same slot\r\n"
    assert _raw(_owner_of(cluster, "{t}a"), "MSET", "{t}a", "1", "{t}b", "2") == b"+OK\r\n"
    info = redis.Redis(*owner).info("cluster")
    assert info["cluster_enabled"] == 1
    text = redis.Redis(*owner).execute_command("CLUSTER", "INFO").decode()
    assert "cluster_state:ok" in text and "cluster_slots_assigned:16384" in text and "cluster_known_nodes:3" in text


def test_redis_py_cluster_client_sets_and_gets_across_nodes(cluster):
    host, port = cluster.addrs[0]
    client = RedisCluster(host=host, port=port)
    values = {f"key:{i}": f"value:{i}".encode() * 10 for i in range(300)}
    for key, value in values.items():
        client.set(key, value)
    assert all(client.get(key) == value for key, value in values.items())
    assert client.delete("key:0") == 1 and client.get("key:0") is None
    per_node = [len(redis.Redis(*addr).keys("key:*")) for addr in cluster.addrs]
    assert sum(per_node) == 299 and all(n > 50 for n in per_node)      # spread over every node


def test_redis_py_asyncio_cluster_client(cluster):
    async def scenario():
        host, port = cluster.addrs[1]
        client = AsyncRedisCluster(host=host, port=port)
        try:
            for i in range(100):
                await client.set(f"async:{i}", i)
            return [await client.get(f"async:{i}") for i in range(100)]
        finally:
            await client.aclose()
    assert asyncio.run(scenario()) == [str(i).encode() for i in range(100)]


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed (make test installs it)")
def test_redis_cli_follows_moved(cluster):
    host, port = cluster.addrs[2]
    for i in range(10):
        done = subprocess.run(["redis-cli", "-c", "-h", host, "-p", str(port), "SET", f"cli:{i}", f"v{i}"],
                              capture_output=True, text=True, timeout=10)
        assert done.stdout.strip() == "OK", done.stdout + done.stderr
    host, port = cluster.addrs[0]
    for i in range(10):
        done = subprocess.run(["redis-cli", "-c", "-h", host, "-p", str(port), "GET", f"cli:{i}"],
                              capture_output=True, text=True, timeout=10)
        assert done.stdout.strip() == f"v{i}"


def test_kv_match_spans_the_slots_of_one_node_and_redirects_a_foreign_key(cluster):
    """KV.MATCH may name keys of many slots when this node serves them all."""
    addr = cluster.addrs[0]
    client = redis.Redis(*addr)
    mine = [k for k in (f"blk:{i}".encode() for i in range(200)) if _owner_of(cluster, k.decode()) == addr][:5]
    assert len({keyslot(k) for k in mine}) > 1
    for key in mine:
        client.execute_command("KV.PUT", key, b"x" * 100)
    assert client.execute_command("KV.MATCH", *mine) == len(mine)
    foreign = next(k for k in (f"blk:{i}".encode() for i in range(200)) if _owner_of(cluster, k.decode()) != addr)
    reply = _raw(addr, "KV.MATCH", mine[0], foreign)
    assert reply.startswith(b"-MOVED %d " % keyslot(foreign))


def test_a_pipelined_batch_of_plain_gets_and_sets_is_routed_per_key(cluster):
    """Plain GETs and SETs skip dispatch's generic checks on a cluster node too (the slot at
    rest here): in one pipelined write, each key still gets its own answer, a foreign key
    MOVED between two served here, and a big value (received into the arena) as well."""
    owner = _owner_of(cluster, "{p}a")
    foreign = next(f"{{p{i}}}x" for i in range(1000) if _owner_of(cluster, f"{{p{i}}}x") != owner)
    big = b"v" * (300 * 1024)
    commands = [("SET", "{p}a", "1"), ("SET", foreign, "2"), ("GET", "{p}a"), ("GET", foreign),
                ("SET", "{p}b", big), ("GET", "{p}b"), ("GET", "{p}missing")]
    payload = b"".join(b"*%d\r\n" % len(c) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in
                                                     (x if isinstance(x, bytes) else x.encode() for x in c))
                       for c in commands)
    host, port = _owner_of(cluster, foreign)
    moved = b"-MOVED %d %s:%d\r\n" % (keyslot(foreign.encode()), host.encode(), port)
    expected = b"+OK\r\n" + moved + b"$1\r\n1\r\n" + moved + b"+OK\r\n" + b"$%d\r\n%s\r\n" % (len(big), big) + b"$-1\r\n"
    with socket.create_connection(owner, timeout=10) as sock:
        sock.sendall(payload)
        got = b""
        while len(got) < len(expected):
            chunk = sock.recv(1 << 20)
            assert chunk, got
            got += chunk
    assert got == expected
    assert redis.Redis(*owner).get("{p}a") == b"1"
