"""Eviction through a real daemon: `python -m kvstore serve --dram-size 8mb`, no SSD tier.

Chain links come from clients. A key named as its own parent (`KV.PUT a x
PARENT a`) or a parent cycle built by re-puts must leave eviction working:
after enough writes to evict them the node still answers PING. A long chain
under write pressure loses its blocks from the tail: what stays of it is
always a prefix (KV.MATCH counts exactly the blocks that EXISTS finds).
"""
from __future__ import annotations

import numpy as np
import pytest
import redis

from proto import wire

KIB, MIB = 1 << 10, 1 << 20


@pytest.fixture
def r(kvstore_factory) -> redis.Redis:
    """A redis-py client of a node with an 8 MiB arena (the node is stopped at teardown)."""
    node = kvstore_factory("--dram-size", "8mb")
    return redis.Redis(node.host, node.port, socket_timeout=10)


def value_of(number: int, size: int) -> bytes:
    return np.random.default_rng(number).bytes(size)


def fill_past_the_arena(r: redis.Redis) -> None:
    """10 MiB of plain SETs through an 8 MiB arena: the oldest keys are evicted."""
    for n in range(40):
        assert r.set(b"filler-%d" % n, value_of(n, 256 * KIB))


def test_a_key_that_is_its_own_parent_does_not_hang_the_node(r):
    assert r.execute_command(wire.KV_PUT, b"a", value_of(1, 64 * KIB), "PARENT", b"a") == 1
    fill_past_the_arena(r)
    assert r.ping()
    assert r.exists(b"a") == 0 and r.info("stats")["evicted_keys"] > 0


def test_a_parent_cycle_through_several_keys_does_not_hang_the_node(r):
    keys = [b"a", b"b", b"c"]
    for i, key in enumerate(keys):
        parent = ["PARENT", keys[i - 1]] if i else []
        assert r.execute_command(wire.KV_PUT, key, value_of(i, 64 * KIB), *parent) == 1
    # a re-put under its own descendant: were a's children to follow it, a -> c -> b -> a.
    assert r.execute_command(wire.KV_PUT, b"a", value_of(9, 128 * KIB), "PARENT", b"c") == 1
    fill_past_the_arena(r)
    assert r.ping()
    assert r.exists(*keys) == 0


def test_a_long_chain_loses_its_tail_first(r):
    """1,500 blocks of 4 KiB (6 MiB), then 4 MiB of newer values: what stays is a prefix."""
    chain = [b"block-%05d" % i for i in range(1500)]
    pipe = r.pipeline(transaction=False)
    for i, key in enumerate(chain):
        pipe.execute_command(wire.KV_PUT, key, value_of(i, 4 * KIB), *(["PARENT", chain[i - 1]] if i else []))
    assert all(pipe.execute())
    for n in range(4):
        assert r.set(b"newer-%d" % n, value_of(n, MIB))
    cached = r.execute_command(wire.KV_MATCH, *chain)
    assert 0 < cached < len(chain)
    assert r.exists(*chain) == cached, "every cached block is in the matched prefix"
