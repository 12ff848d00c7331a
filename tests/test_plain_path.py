"""The plain GET/SET path of kvstore/commands/dispatch.py (`run_plain`) against real daemons.

Pipelined plain GETs and SETs skip dispatch's generic checks while nothing
those checks look at can matter; these tests switch each of those conditions
on and off in the middle of one pipelined write and check that the replies
are what the generic path (and, where Redis has the feature, redis-server
itself) gives, byte for byte:
- MULTI/EXEC and DISCARD between plain commands, WATCH of a key a plain SET writes;
- AUTH and a restricted ACL user in the middle of a batch (NOAUTH, NOPERM);
- errors a plain command raises (OOM under noeviction) answered in order, the
  batch going on after them;
- CLIENT PAUSE WRITE from another client holding a plain SET;
- SLOWLOG and INFO's command count seeing plain commands;
- lower-case and mixed-case names, SET with options, wrong argument counts.
"""
from __future__ import annotations

import socket
import time

import redis

from conftest import Daemon


def command(*args) -> bytes:
    out = b"*%d\r\n" % len(args)
    for arg in args:
        arg = arg if isinstance(arg, bytes) else str(arg).encode()
        out += b"$%d\r\n%s\r\n" % (len(arg), arg)
    return out


def exchange(daemon, payload: bytes, replies: int, timeout: float = 20.0) -> bytes:
    """Send ``payload`` in one write and read until ``replies`` top-level replies came back."""
    with socket.create_connection((daemon.host, daemon.port)) as sock:
        sock.sendall(payload)
        return read_replies(sock, replies, timeout)


def read_replies(sock: socket.socket, replies: int, timeout: float = 20.0) -> bytes:
    return read_until(sock, lambda data: count_replies(data) >= replies, timeout)


def read_until(sock: socket.socket, done, timeout: float = 20.0) -> bytes:
    """What ``sock`` sends until ``done(data)`` holds, it closes, or ``timeout`` passes."""
    data, deadline = b"", time.monotonic() + timeout
    while not done(data) and time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(1 << 16)
        except socket.timeout:
            break
        if not chunk:
            break
        data += chunk
    return data


def count_replies(data: bytes) -> int:
    """Complete top-level RESP2 replies at the start of ``data``."""
    pos, count = 0, 0
    while True:
        end = skip_reply(data, pos)
        if end is None:
            return count
        pos, count = end, count + 1


def skip_reply(data: bytes, pos: int) -> int | None:
    nl = data.find(b"\r\n", pos)
    if nl < 0:
        return None
    kind, body = data[pos:pos + 1], data[pos + 1:nl]
    if kind == b"$" and body != b"-1":
        end = nl + 2 + int(body) + 2
        return end if end <= len(data) else None
    if kind == b"*" and body != b"-1":
        pos = nl + 2
        for _ in range(int(body)):
            pos = skip_reply(data, pos)
            if pos is None:
                return None
        return pos
    return nl + 2


def same_as_redis(servers: tuple[Daemon, Daemon], payload: bytes, replies: int, *setup: tuple) -> bytes:
    """The replies of kvstore and of redis-server (``servers``, in that order) to ``payload``
    (after ``setup`` commands): equal."""
    got = {}
    for name, daemon in zip(("kvstore", "redis"), servers):
        client = redis.Redis(daemon.host, daemon.port)
        for args in setup:
            client.execute_command(*args)
        got[name] = exchange(daemon, payload, replies)
    assert got["kvstore"] == got["redis"]
    return got["kvstore"]


def test_transactions_between_plain_commands_answer_as_redis(server, redis_server):
    payload = (command("SET", "a", "1") + command("GET", "a") + command("MULTI") + command("SET", "a", "2")
               + command("GET", "a") + command("EXEC") + command("get", "a") + command("MULTI")
               + command("set", "a", "3") + command("DISCARD") + command("GET", "a")
               + command("WATCH", "a") + command("SET", "a", "4") + command("MULTI") + command("GET", "a")
               + command("EXEC") + command("GET", "a"))
    replies = same_as_redis((server, redis_server), payload, 17)
    assert replies.endswith(b"*-1\r\n$1\r\n4\r\n")


def test_auth_and_a_restricted_user_in_the_middle_of_a_batch_answer_as_redis(server, redis_server):
    setup = (("ACL", "SETUSER", "reader", "on", ">pw", "~a*", "+get", "+auth"),
             ("SET", "a", "1"), ("SET", "b", "2"))
    payload = (command("GET", "a") + command("AUTH", "reader", "pw") + command("GET", "a")
               + command("GET", "b") + command("SET", "a", "x") + command("GET", "a")
               + command("AUTH", "default", "nopass-is-ignored") + command("GET", "b"))
    replies = same_as_redis((server, redis_server), payload, 8, *setup)
    assert replies.count(b"-NOPERM") == 2        # the key b, then SET; back as default, b is readable


def test_noauth_until_auth_in_the_same_batch(kvstore_factory):
    daemon = kvstore_factory(password="secret")
    payload = (command("SET", "a", "1") + command("GET", "a") + command("AUTH", "secret")
               + command("SET", "a", "1") + command("GET", "a"))
    assert exchange(daemon, payload, 5) == (b"-NOAUTH Authentication required.\r\n" * 2
                                            + b"+OK\r\n+OK\r\n$1\r\n1\r\n")


def test_names_in_any_case_options_and_wrong_counts_answer_as_redis(server, redis_server):
    payload = (command("Set", "k", "v") + command("gEt", "k") + command("SET", "k", "w", "NX")
               + command("SET", "k", "w", "XX", "GET") + command("GET", "k", "extra") + command("SET", "k")
               + command("GET", "missing") + command("set", "k", "") + command("get", "k"))
    same_as_redis((server, redis_server), payload, 9)


def test_an_oom_error_is_answered_in_order_and_the_batch_goes_on(kvstore_factory):
    daemon = kvstore_factory("--dram-size", "1mb", "--maxmemory-policy", "noeviction")
    value = b"v" * 30_000           # below the reader's big-bulk size: a plain SET
    payload = b"".join(command("SET", f"k{i}", value) for i in range(60)) + command("GET", "k0")
    replies = exchange(daemon, payload, 61)
    oom = b"-OOM command not allowed when used memory > 'maxmemory'.\r\n"
    assert replies.startswith(b"+OK\r\n") and oom in replies
    assert replies.endswith(b"$30000\r\n" + value + b"\r\n")
    assert replies.count(b"+OK\r\n") + replies.count(oom) == 60


def test_client_pause_write_holds_a_plain_set(server):
    admin = redis.Redis(server.host, server.port)
    admin.set("k", "old")
    admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(command("GET", "k") + command("SET", "k", "new") + command("GET", "k"))
            time.sleep(0.3)
            assert admin.get("k") == b"old"         # the SET waits for the pause to end
            admin.execute_command("CLIENT", "UNPAUSE")
            assert read_replies(sock, 3) == b"$3\r\nold\r\n+OK\r\n$3\r\nnew\r\n"
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")


def test_slowlog_and_the_command_count_see_plain_commands(server):
    admin = redis.Redis(server.host, server.port)
    admin.config_set("slowlog-log-slower-than", 0)
    admin.slowlog_reset()
    before = admin.info("stats")["total_commands_processed"]
    payload = b"".join(command("SET", f"k{i}", "v") + command("GET", f"k{i}") for i in range(10))
    assert exchange(server, payload, 20) == b"+OK\r\n$1\r\nv\r\n" * 10
    logged = [entry["command"] for entry in admin.slowlog_get(128)]
    assert sum(c.startswith(b"SET k") for c in logged) == 10 and sum(c.startswith(b"GET k") for c in logged) == 10
    # the count also holds INFO, SLOWLOG GET and SLOWLOG RESET's successors of this client: at least 20 more
    assert admin.info("stats")["total_commands_processed"] - before >= 20 + 2
