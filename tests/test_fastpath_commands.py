"""kvstore/commands/fastpath.py against a real daemon: lease commands on values
that are not in the shared arena; KV.TOUCH and the shared index KV.ARENA hands out."""
from __future__ import annotations

import os
import socket

import pytest
import redis

from conftest import wait_until
from test_dispatch import _read_until
from test_plain_path import command as _command


def _on_ssd(client: redis.Redis, key: str) -> bool:
    return client.execute_command("KV.LOCATE", key)[0][0] == b"ssd"


def test_lease_of_a_value_staged_on_the_heap_is_refused_and_holds_nothing(kvstore_factory, tmp_path):
    """DRAM full of values that exist only there: a value read up from SSD is staged
    on the heap for one command. KV.LEASE and KV.LEASEGPU answer NOTINARENA (no
    internal error) and leave no lease granted."""
    daemon = kvstore_factory("--dram-size", "8mb", "--ssd-dir", str(tmp_path / "ssd"),
                           "--ssd-size", "256mb")
    client = redis.Redis(daemon.host, daemon.port)
    token = client.execute_command("KV.ARENA")[4]
    big = os.urandom(1 << 20)
    client.set("cold", big)
    for i in range(12):
        client.set(f"pad{i}", big)
    wait_until(lambda: _on_ssd(client, "cold"), what="the value to reach SSD")
    for command in (("KV.LEASE", token), ("KV.LEASEGPU", token, "")):   # "": no GPU tier's generation
        payload = b"".join(_command("SET", f"fill{i}", big) for i in range(12))
        payload += _command(*command, 5000, "cold") + _command("PING")
        with socket.create_connection((daemon.host, daemon.port)) as sock:
            sock.sendall(payload)
            replies = _read_until(sock, b"+PONG\r\n")
        assert replies.startswith(b"+OK\r\n" * 12), replies[:200]
        answer = replies[60:-len(b"+PONG\r\n")]
        assert answer.startswith(b"-NOTINARENA "), answer[:200]
        assert b"internal error" not in replies
        wait_until(lambda: client.info("clients")["connected_clients"] == 1, what="the raw connection to close")
    stats = client.execute_command("KV.LEASES")
    if isinstance(stats, list):
        stats = dict(zip(stats[::2], stats[1::2]))
    assert stats[b"leases_active"] == 0
    assert client.get("cold") == big


def test_touch_counts_reads_served_elsewhere_as_hits_and_arena_passes_the_index(kvstore_factory):
    """KV.TOUCH: the hits a local client's reads from the shared index stand for, and how many
    of the keys exist; KV.ARENA names the shared index (its fd and size), made at the first, and
    the SSD tier's directory when there is one."""
    daemon = kvstore_factory()
    client = redis.Redis(daemon.host, daemon.port)
    client.set("a", b"1")
    client.set("b", b"2")
    before = _fields(client.execute_command("KV.STATS"))
    assert client.execute_command("KV.TOUCH", "a", "b", "absent", "a") == 3
    after = _fields(client.execute_command("KV.STATS"))
    assert (after[b"hits"], after[b"misses"]) == (before[b"hits"] + 3, before[b"misses"] + 1)
    reply = client.execute_command("KV.ARENA")
    assert len(reply) == 11 and reply[9] >= 4096 and reply[9] & (reply[9] - 1) == 0
    assert reply[10] == b""                            # no SSD tier for a local client to read
    assert _fields(client.execute_command("KV.LEASES"))[b"index_buckets"] == reply[9]
    client.set("c", b"3")                              # published from the first mapping on
    assert _fields(client.execute_command("KV.LEASES"))[b"index_entries"] == 1


def _fields(reply) -> dict:
    """A field-value reply as a dict (redis-py parses some as a flat list)."""
    return dict(zip(reply[::2], reply[1::2])) if isinstance(reply, list) else reply


def test_publish_with_next_reserves_the_next_extent_in_the_same_command(kvstore_factory):
    """KV.PUBLISH ... NEXT ttl: the value is committed and an extent of its size is reserved
    for the same connection ([stored, [id, offset]]); a bad TTL commits nothing; with no room
    for the spare the value is stored all the same and NOSPARE stands in the spare's place."""
    daemon = kvstore_factory("--dram-size", "8mb", "--maxmemory-policy", "noeviction")
    client = redis.Redis(daemon.host, daemon.port, single_connection_client=True)
    token = client.execute_command("KV.ARENA")[4]
    (first, _), = client.execute_command("KV.RESERVE", token, 5000, 1 << 20)
    with pytest.raises(redis.ResponseError, match="TTL"):
        client.execute_command("KV.PUBLISH", first, "a", "NEXT", 0)
    assert client.exists("a") == 0
    stored, (spare, offset) = client.execute_command("KV.PUBLISH", first, "a", "NX", "NEXT", 5000)
    assert stored == 1 and client.strlen("a") == 1 << 20 and spare != first and offset >= 0
    assert _fields(client.execute_command("KV.LEASES"))[b"reservations_active"] == 1
    assert client.execute_command("KV.PUBLISH", spare, "a", "NX", "NEXT", 5000)[0] == 0    # existed
    (big, _), = client.execute_command("KV.RESERVE", token, 5000, 4 << 20)
    stored, no_room = client.execute_command("KV.PUBLISH", big, "b", "NEXT", 5000)
    assert stored == 1 and client.strlen("b") == 4 << 20
    assert isinstance(no_room, redis.ResponseError) and str(no_room).startswith("NOSPARE")


def test_mpublish_commits_a_batch_in_one_command_and_answers_per_value(kvstore_factory):
    """KV.MPUBLISH NX|OVERWRITE id key parent ...: per value 1 stored, 0 existed (NX) or EXPIRED
    (an unknown reservation: the others are committed all the same); a malformed command
    (mode, argument count, an id that is not a number) commits nothing."""
    daemon = kvstore_factory()
    client = redis.Redis(daemon.host, daemon.port, single_connection_client=True)
    token = client.execute_command("KV.ARENA")[4]
    (a, _), (b, _), (c, _) = client.execute_command("KV.RESERVE", token, 5000, 300, 400, 500)
    for bad in (("PUT", a, "a", ""), ("NX", a, "a"), ("NX", a, "a", "", "x", "b", "")):
        with pytest.raises(redis.ResponseError):
            client.execute_command("KV.MPUBLISH", *bad)
    assert _fields(client.execute_command("KV.LEASES"))[b"reservations_active"] == 3
    client.set("c", b"old")
    replies = client.execute_command("KV.MPUBLISH", "NX", a, "a", "", 12345, "x", "", b, "b", "a", c, "c", "")
    assert replies[0] == 1 and replies[2] == 1 and replies[3] == 0
    assert isinstance(replies[1], redis.ResponseError) and str(replies[1]).startswith("EXPIRED")
    assert (client.strlen("a"), client.strlen("b"), client.get("c"), client.exists("x")) == (300, 400, b"old", 0)
    (d, _), = client.execute_command("KV.RESERVE", token, 5000, 600)
    assert client.execute_command("KV.MPUBLISH", "overwrite", d, "c", "") == [1]
    assert client.strlen("c") == 600
    assert _fields(client.execute_command("KV.LEASES"))[b"reservations_active"] == 0
