"""INFO's figures (kvstore/admin/info.py), checked on real processes.

A `kvstore serve` daemon and, as the reference for what a field means, a real
redis-server: the keyspace line's avg_ttl is the mean time to live in
milliseconds of the keys that have one, and keys without an expiry do not
count.
"""
from __future__ import annotations

import pytest
import redis

from conftest import eventually


def avg_ttl(client: redis.Redis) -> int:
    return client.info("keyspace")["db0"]["avg_ttl"]      # redis-py splits the db0 line


@pytest.mark.parametrize("name", ["redis", "kvstore"])
def test_avg_ttl_is_the_mean_ttl_in_ms_of_keys_with_an_expiry(request, name):
    daemon = request.getfixturevalue("redis_server" if name == "redis" else "server")
    client = redis.Redis(daemon.host, daemon.port, socket_timeout=10)
    client.set("forever", "x")
    assert avg_ttl(client) == 0
    client.set("short", "x", ex=100)
    client.set("long", "x", px=200_000)
    client.set("also-forever", "x")
    # Redis estimates it from its expiry cycle's samples: wait for the estimate to settle.
    assert eventually(lambda: 140_000 <= avg_ttl(client) <= 150_000), avg_ttl(client)
    client.persist("short")
    client.persist("long")
    if name == "kvstore":
        assert avg_ttl(client) == 0
