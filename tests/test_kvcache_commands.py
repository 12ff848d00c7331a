"""KV.PUT, KV.MATCH, KV.LOCATE, KV.STATS and the kvcache INFO section, against the real daemon.

Starts `kvstore serve` processes (a shared one with a 64 MiB arena, and small
4 MiB ones for eviction and noeviction) and talks to them with redis-py's
`execute_command` and with raw sockets where the exact reply bytes matter.
What is checked: the KV commands' replies (RESP2 and RESP3), that KV.MATCH is
one request and one reply whatever the chain length, that a full arena under
allkeys-lru stays within its size and keeps recently used chains while older
chains lose their leaves first, and that a full noeviction arena answers
Redis's -OOM error and keeps serving.
"""
from __future__ import annotations

import time

import pytest
import redis

from conftest import Daemon
from proto.wire import KV_LOCATE, KV_MATCH, KV_PUT, KV_STATS, TIER_DRAM
from test_redis_compat import RespConnection, decode, encode_command

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 64 * KiB
OOM_REPLY = b"-OOM command not allowed when used memory > 'maxmemory'.\r\n"
STATS_FIELDS = ["hits", "misses", "keys", "evictions", "bytes_gpu", "bytes_dram", "bytes_ssd"]


@pytest.fixture(scope="module")
def node(kvstore_module_factory) -> Daemon:
    return kvstore_module_factory()


@pytest.fixture
def client(node) -> redis.Redis:
    with redis.Redis(host=node.host, port=node.port) as client:
        client.flushall()
        yield client


def block_keys(name: str, n: int) -> list[str]:
    """Keys shaped like BlockHasher's: 32 hex characters."""
    return [f"{name}-{i}".encode().hex()[:32].ljust(32, "0") for i in range(n)]


def block(seed: int, size: int = BLOCK) -> bytes:
    """A value whose bytes say which block it is."""
    return bytes([seed % 251]) * size


def put_chain(client: redis.Redis, keys: list[str], size: int = 100, seed: int = 1) -> None:
    pipe = client.pipeline(transaction=False)
    for i, key in enumerate(keys):
        if i:
            pipe.execute_command(KV_PUT, key, block(seed + i, size), "PARENT", keys[i - 1])
        else:
            pipe.execute_command(KV_PUT, key, block(seed + i, size))
    assert pipe.execute() == [1] * len(keys)


def stats(client: redis.Redis) -> dict[str, int]:
    """KV.STATS as a dict (redis-py may already have made the flat array one)."""
    reply = client.execute_command(KV_STATS)
    pairs = reply.items() if isinstance(reply, dict) else zip(reply[0::2], reply[1::2])
    return {k.decode(): v for k, v in pairs}


# ----------------------------------------------------------------- KV.PUT

def test_kv_put_stores(client):
    assert client.execute_command(KV_PUT, "k", "v1") == 1
    assert client.get("k") == b"v1"
    assert client.execute_command(KV_PUT, "k", "v2") == 1          # overwrites without NX
    assert client.get("k") == b"v2"


def test_kv_put_nx(client):
    assert client.execute_command(KV_PUT, "k", "first", "NX") == 1
    assert client.execute_command(KV_PUT, "k", "second", "NX") == 0
    assert client.execute_command(KV_PUT, "k", "third", "nx", "PARENT", "p") == 0
    assert client.get("k") == b"first"


def test_kv_put_nx_with_a_big_value_gives_the_memory_back(client):
    assert client.execute_command(KV_PUT, "k", block(3, MiB)) == 1
    used = client.info("kvcache")["dram_used"]
    for _ in range(5):
        assert client.execute_command(KV_PUT, "k", block(4, MiB), "NX") == 0
    assert client.info("kvcache")["dram_used"] == used
    assert client.get("k") == block(3, MiB)


def test_kv_put_parent(client):
    keys = block_keys("parent", 3)
    put_chain(client, keys)
    assert client.execute_command(KV_PUT, "child", "v", "parent", keys[-1]) == 1
    assert client.execute_command(KV_PUT, "orphan", "v", "PARENT", "no-such-parent") == 1
    assert client.execute_command(KV_MATCH, *keys, "child") == 4


@pytest.mark.parametrize("args", [
    ("k", "v", "BOGUS"),
    ("k", "v", "PARENT"),
    ("k", "v", "NX", "EX", "10"),
    ("k", "v", "PARENT", "p", "NX", "extra"),
])
def test_kv_put_syntax_errors_store_nothing(node, args):
    with RespConnection(node) as conn:
        conn.call("FLUSHALL")
        assert conn.call(KV_PUT, *args) == b"-ERR syntax error\r\n"
        assert conn.call("EXISTS", "k") == b":0\r\n"


def test_kv_put_syntax_error_with_a_big_value_gives_the_memory_back(client):
    for _ in range(5):
        with pytest.raises(redis.ResponseError, match="^syntax error$"):
            client.execute_command(KV_PUT, "k", block(5, MiB), "PARENT")
    assert client.exists("k") == 0
    assert client.info("kvcache")["dram_used"] == 0


@pytest.mark.parametrize("args", [(), ("k",)])
def test_kv_put_arity(node, args):
    with RespConnection(node) as conn:
        assert conn.call(KV_PUT, *args) == b"-ERR wrong number of arguments for 'kv.put' command\r\n"


# ----------------------------------------------------------------- KV.MATCH

def test_kv_match_counts_leading_present_keys(client):
    keys = block_keys("match", 10)
    put_chain(client, keys)
    assert client.execute_command(KV_MATCH, *keys) == 10
    assert client.execute_command(KV_MATCH, *keys, "absent") == 10
    client.delete(keys[4])
    assert client.execute_command(KV_MATCH, *keys) == 4              # a gap stops the prefix
    assert client.execute_command(KV_MATCH, "absent", *keys) == 0
    assert client.execute_command(KV_MATCH, keys[0]) == 1
    assert client.execute_command(KV_MATCH, keys[0], keys[0], keys[1]) == 3


def test_kv_match_of_an_empty_chain(node):
    with RespConnection(node) as conn:
        assert conn.call(KV_MATCH) == b"-ERR wrong number of arguments for 'kv.match' command\r\n"
        assert conn.call(KV_MATCH, "nothing-here") == b":0\r\n"


def test_kv_match_of_a_256_key_chain_is_one_request_and_one_reply(node, client):
    keys = block_keys("long", 256)
    put_chain(client, keys)
    with RespConnection(node) as conn:
        before = int(conn.call("INFO", "stats").split(b"total_commands_processed:")[1].split(b"\r\n")[0])
        conn.send(encode_command(KV_MATCH, *keys))
        assert conn.read_reply() == b":256\r\n"
        assert conn.read_available(64, quiet=0.3) == b"", "exactly one reply"
        after = int(conn.call("INFO", "stats").split(b"total_commands_processed:")[1].split(b"\r\n")[0])
    assert after - before == 2, "the first INFO and the KV.MATCH: one command for 256 keys"
    client.delete(keys[200])
    assert client.execute_command(KV_MATCH, *keys) == 200


def test_kv_match_skips_expired_keys(client):
    keys = block_keys("ttl", 3)
    put_chain(client, keys)
    client.pexpire(keys[1], 1)
    time.sleep(0.02)
    assert client.execute_command(KV_MATCH, *keys) == 1


# ----------------------------------------------------------------- KV.LOCATE

def test_kv_locate_raw_reply(node):
    with RespConnection(node) as conn:
        conn.call("FLUSHALL")
        conn.call(KV_PUT, "a", "hello")
        conn.call(KV_PUT, "b", block(1, BLOCK))
        tier = TIER_DRAM.encode()
        assert conn.call(KV_LOCATE, "a", "missing", "b") == (
            b"*3\r\n*2\r\n$%d\r\n%s\r\n:5\r\n$-1\r\n*2\r\n$%d\r\n%s\r\n:%d\r\n"
            % (len(tier), tier, len(tier), tier, BLOCK))
        assert conn.call(KV_LOCATE, "missing") == b"*1\r\n$-1\r\n"
        assert conn.call(KV_LOCATE) == b"-ERR wrong number of arguments for 'kv.locate' command\r\n"


def test_kv_locate_in_resp3(node):
    with RespConnection(node) as conn:
        conn.call("HELLO", "3")
        conn.call(KV_PUT, "a", "hello")
        conn.call("DEL", "missing")
        assert conn.call(KV_LOCATE, "missing", "a") == b"*2\r\n_\r\n*2\r\n$4\r\ndram\r\n:5\r\n"


def test_kv_locate_with_redis_py(client):
    client.execute_command(KV_PUT, "x", b"\x00" * 1000)
    assert client.execute_command(KV_LOCATE, "x", "y") == [[TIER_DRAM.encode(), 1000], None]


# ----------------------------------------------------------------- KV.STATS

def test_kv_stats_fields_and_counts(client):
    before = stats(client)
    assert list(before) == STATS_FIELDS
    assert all(isinstance(v, int) for v in before.values())
    client.execute_command(KV_PUT, "a", "12345")
    client.execute_command(KV_PUT, "b", block(2, BLOCK))
    client.get("a")
    client.get("a")
    client.get("missing")
    after = stats(client)
    assert after["hits"] - before["hits"] == 2
    assert after["misses"] - before["misses"] == 1
    assert after["keys"] == 2
    assert after["bytes_dram"] == 5 + BLOCK
    assert after["bytes_gpu"] == after["bytes_ssd"] == 0


def test_kv_stats_is_a_flat_array_in_resp2_and_a_map_in_resp3(node):
    with RespConnection(node) as conn:
        reply = conn.call(KV_STATS)
        assert reply.startswith(b"*14\r\n")
        assert [k.decode() for k in decode(reply)[0::2]] == STATS_FIELDS
        conn.call("HELLO", "3")
        reply = conn.call(KV_STATS)
        assert reply.startswith(b"%7\r\n")
        assert [k.decode() for k, _ in decode(reply)] == STATS_FIELDS
        assert conn.call(KV_STATS, "extra") == \
            b"-ERR wrong number of arguments for 'kv.stats' command\r\n"


# ----------------------------------------------------------------- INFO

def test_info_kvcache_section(node, client):
    client.execute_command(KV_PUT, "a", "x" * 100)
    info = client.info("kvcache")
    for field in ("metadata_bytes_per_key", "dram_internal_fragmentation", "dram_external_fragmentation",
                  "dram_capacity", "dram_used", "kv_hits", "kv_misses"):
        assert field in info, field
    assert float(info["dram_internal_fragmentation"]) == pytest.approx(1 - 100 / 128, abs=1e-4)
    assert 0.0 <= float(info["dram_external_fragmentation"]) < 1.0
    assert info["dram_capacity"] == 64 * MiB and info["dram_used"] == 128
    with RespConnection(node) as conn:
        text = decode(conn.call("INFO")).decode()
    assert "# KVCache" in text.splitlines(), "INFO with no section includes kvcache"


def test_info_metadata_bytes_per_key_under_200(client):
    pipe = client.pipeline(transaction=False)
    for i in range(20_000):
        pipe.execute_command(KV_PUT, "%032x" % (i * 2654435761), "v")
    pipe.execute()
    figure = float(client.info("kvcache")["metadata_bytes_per_key"])
    print(f"\nINFO metadata_bytes_per_key with 20,000 keys: {figure}")
    assert 50 < figure < 200


# ----------------------------------------------------------------- a small arena

@pytest.fixture
def small_client(kvstore_factory) -> redis.Redis:
    """A fresh daemon per test: eviction depends on the whole history of the arena."""
    daemon = kvstore_factory("--dram-size", "4mb")
    with redis.Redis(host=daemon.host, port=daemon.port) as client:
        yield client


def cached_blocks(client: redis.Redis, keys: list[str]) -> int:
    return sum(entry is not None for entry in client.execute_command(KV_LOCATE, *keys))


def test_full_arena_stays_within_its_size_and_keeps_values_intact(small_client):
    client = small_client
    chains = [block_keys(f"chain{c}", 16) for c in range(12)]   # 12 x 1 MiB through 4 MiB
    for c, keys in enumerate(chains):
        put_chain(client, keys, BLOCK, seed=c * 16)
        info = client.info("kvcache")
        assert info["dram_used"] <= info["dram_capacity"] == 4 * MiB
    assert client.info("stats")["evicted_keys"] >= 12 * 16 - 64
    for c, keys in enumerate(chains):
        for i, value in enumerate(client.mget(keys)):
            assert value is None or value == block(c * 16 + i, BLOCK), (c, i)


def test_recent_chains_stay_whole(small_client):
    """A chain read after every other put, and the chain just put, keep all 16 blocks."""
    client = small_client
    used_chain = block_keys("used", 16)
    put_chain(client, used_chain, BLOCK, seed=7)
    matches = []
    for c in range(12):
        newest = block_keys(f"chain{c}", 16)
        put_chain(client, newest, BLOCK, seed=c)
        matches.append((client.execute_command(KV_MATCH, *used_chain),
                        client.execute_command(KV_MATCH, *newest)))
    assert matches == [(16, 16)] * 12, "(KV.MATCH of the used chain, of the newest chain)"


def test_older_chains_lose_their_leaves_first(small_client):
    """After every chain put, each chain's cached blocks are exactly its KV.MATCH prefix."""
    client = small_client
    chains = [block_keys(f"old{c}", 16) for c in range(12)]
    holes = []
    for c, keys in enumerate(chains):
        put_chain(client, keys, BLOCK, seed=c)
        for older in chains[:c + 1]:
            matched, cached = client.execute_command(KV_MATCH, *older), cached_blocks(client, older)
            if matched != cached:
                holes.append((c, chains.index(older), matched, cached))
    assert holes == [], "(after chain, chain, KV.MATCH, blocks cached)"


def test_memory_stays_bounded_under_many_small_chains(small_client):
    client = small_client
    for c in range(40):
        put_chain(client, block_keys(f"small{c}", 32), 4 * KiB, seed=c)
    info = client.info("kvcache")
    assert info["dram_used"] <= 4 * MiB
    assert client.execute_command(KV_MATCH, *block_keys("small39", 32)) == 32


# ----------------------------------------------------------------- noeviction

@pytest.mark.parametrize("size", [4000, BLOCK])
def test_noeviction_answers_oom_and_keeps_serving(kvstore_factory, size):
    daemon = kvstore_factory("--dram-size", "4mb", "--maxmemory-policy", "noeviction")
    with RespConnection(daemon) as conn:
        stored, reply = 0, b""
        while reply != OOM_REPLY:
            reply = conn.call(KV_PUT, f"k{stored}", block(stored, size))
            assert reply in (b":1\r\n", OOM_REPLY)
            stored += reply == b":1\r\n"
        assert stored * buddy_block(size) >= 3 * MiB
        assert conn.call("PING") == b"+PONG\r\n"
        assert conn.call("GET", "k0") == b"$%d\r\n" % size + block(0, size) + b"\r\n"
        assert conn.call(KV_MATCH, "k0", "k1") == b":2\r\n"
        assert conn.call("SET", "another", block(9, size)) == OOM_REPLY
        assert conn.call("DEL", "k0") == b":1\r\n"
        assert conn.call(KV_PUT, "after-delete", block(1, size)) == b":1\r\n"
    with redis.Redis(port=daemon.port) as client:
        assert client.info("stats")["evicted_keys"] == 0
        assert client.info("kvcache")["dram_used"] <= 4 * MiB
    assert daemon.stop() == 0


def buddy_block(size: int) -> int:
    """Bytes the buddy allocator gives a value of ``size`` bytes."""
    return max(64, 1 << (size - 1).bit_length())
