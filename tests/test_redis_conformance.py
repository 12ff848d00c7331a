"""What Redis's own test suite (loadtest/redis_suite.py) found different, checked reply for reply.

Same method as tests/test_redis_compat.py: each scenario runs on a real
redis-server and on a kvstore node from an empty keyspace with the same raw
requests, and the raw replies must be equal byte for byte. Where the contents
must differ (client ids, addresses, CPU seconds) the shape is compared on both.
Both servers start once for the module.
"""
from __future__ import annotations

import re
import socket
import time

import pytest

from conftest import Daemon
from test_redis_compat import (RespConnection, Step, assert_same_replies, decode, encode_command, normalize,
                               run_steps)
# The fixtures: a kvstore node and a redis-server for the module, and each of them in turn
# with an empty keyspace (``target``).
from test_redis_compat_more import node, target  # noqa: F401

SCENARIOS: dict[str, list[Step]] = {
    "client-list-filters": [
        ("CLIENT", "LIST", "ID"), ("CLIENT", "LIST", "ID", "abc"), ("CLIENT", "LIST", "ID", "1", "x"),
        ("CLIENT", "LIST", "ID", "0", "-5"), ("CLIENT", "LIST", "TYPE", "foo"), ("CLIENT", "LIST", "TYPE"),
        ("CLIENT", "LIST", "TYPE", "master"), ("CLIENT", "LIST", "TYPE", "pubsub"),
        ("CLIENT", "LIST", "TYPE", "normal", "x"), ("CLIENT", "LIST", "foo"), ("CLIENT", "INFO", "x"),
    ],
    "client-arguments": [
        ("CLIENT",), ("CLIENT", "REPLY"), ("CLIENT", "REPLY", "foo"), ("CLIENT", "REPLY", "ON"),
        ("CLIENT", "REPLY", "on", "x"), ("CLIENT", "KILL"), ("CLIENT", "KILL", "foo"),
        ("CLIENT", "KILL", "foo", "bar"), ("CLIENT", "KILL", "ID", "abc"), ("CLIENT", "KILL", "ID", "0"),
        ("CLIENT", "KILL", "TYPE", "foo"), ("CLIENT", "KILL", "SKIPME", "maybe"),
        ("CLIENT", "KILL", "1.2.3.4:5"), ("CLIENT", "KILL", "ID", "999999", "SKIPME"),
        ("CLIENT", "MAINT_NOTIFICATIONS", "ON"),
        ("CLIENT", "MAINT_NOTIFICATIONS", "ON", "moving-endpoint-type", "internal-ip"),
        ("CLIENT", "GETNAME", "x"), ("CLIENT", "NO-EVICT", "maybe"), ("CLIENT", "ID", "x"),
        ("TIME", "x"),
    ],
    "object-encoding": [
        ("SET", "n", "10"), ("INCR", "n"), ("OBJECT", "ENCODING", "n"), ("INCRBY", "n", "10000000000"),
        ("OBJECT", "ENCODING", "n"), ("DECR", "n"), ("OBJECT", "ENCODING", "n"),
        ("SET", "s", "12345678901234567890"), ("OBJECT", "ENCODING", "s"),
        ("SET", "e", "x" * 44), ("OBJECT", "ENCODING", "e"), ("SET", "e", "x" * 45), ("OBJECT", "ENCODING", "e"),
        ("SET", "z", "0123"), ("OBJECT", "ENCODING", "z"), ("SET", "m", "-9223372036854775808"),
        ("OBJECT", "ENCODING", "m"), ("SET", "m", "9223372036854775808"), ("OBJECT", "ENCODING", "m"),
        ("SET", "a", "1"), ("APPEND", "a", "x"), ("OBJECT", "ENCODING", "a"),
        ("SET", "a", "5"), ("APPEND", "a", "7"), ("OBJECT", "ENCODING", "a"), ("INCR", "a"), ("OBJECT", "ENCODING", "a"),
        ("APPEND", "new", "abc"), ("OBJECT", "ENCODING", "new"), ("APPEND", "num", "12"), ("OBJECT", "ENCODING", "num"),
        ("SET", "r", "1234"), ("SETRANGE", "r", "0", "2"), ("OBJECT", "ENCODING", "r"),
        ("SETRANGE", "fresh", "0", "ab"), ("OBJECT", "ENCODING", "fresh"), ("SETRANGE", "none", "5", ""),
        ("EXISTS", "none"), ("SET", "q", "1"), ("SETRANGE", "q", "0", ""), ("OBJECT", "ENCODING", "q"),
        ("APPEND", "q", ""), ("OBJECT", "ENCODING", "q"), ("SET", "q", "2"), ("OBJECT", "ENCODING", "q"),
        ("SET", "f", "1.5"), ("INCRBYFLOAT", "f", "1"), ("OBJECT", "ENCODING", "f"),
        ("SETNX", "x1", "456"), ("OBJECT", "ENCODING", "x1"), ("MSET", "x2", "789", "x3", "abc"),
        ("OBJECT", "ENCODING", "x2"), ("OBJECT", "ENCODING", "x3"), ("SETEX", "x4", "100", "42"),
        ("OBJECT", "ENCODING", "x4"), ("GETSET", "r", "5"), ("OBJECT", "ENCODING", "r"),
        ("OBJECT", "ENCODING", "missing"),
    ],
    "config-redis-parameters": [
        ("CONFIG", "SET", "list-max-listpack-size", "5"), ("CONFIG", "GET", "list-max-listpack-size"),
        ("CONFIG", "GET", "list-max-ziplist-size"), ("CONFIG", "SET", "lua-time-limit", "10"),
        ("CONFIG", "GET", "lua-time-limit"), ("CONFIG", "GET", "busy-reply-threshold"),
        ("CONFIG", "SET", "no-such-param", "1"), ("CONFIG", "SET", "daemonize", "yes"),
        ("CONFIG", "SET", "rdbchecksum", "no"), ("CONFIG", "SET", "activerehashing", "maybe"),
        ("CONFIG", "SET", "activerehashing", "NO"), ("CONFIG", "GET", "activerehashing"),
        ("CONFIG", "GET", "key-load-delay"), ("CONFIG", "GET", "key-load*"), ("CONFIG", "GET", "slaveof"),
        ("CONFIG", "GET", "replicaof"), ("CONFIG", "SET", "hash-max-ziplist-entries", "0"),
        ("CONFIG", "GET", "hash-max-listpack-entries"), ("CONFIG", "SET", "hz", "20", "no-such", "1"),
        ("CONFIG", "GET", "hz"), ("CONFIG", "SET", "save", "3000 5"), ("CONFIG", "GET", "save"),
        ("CONFIG", "SET", "save", ""), ("CONFIG", "SET", "repl-backlog-size", "10000002"),
        ("CONFIG", "GET", "repl-backlog-size"),
        # back to the defaults: the servers are shared by the module
        ("CONFIG", "SET", "hash-max-ziplist-entries", "512"), ("CONFIG", "SET", "list-max-listpack-size", "-2"),
        ("CONFIG", "SET", "lua-time-limit", "5000"), ("CONFIG", "SET", "activerehashing", "yes"),
        ("CONFIG", "SET", "repl-backlog-size", "1048576"),
    ],
    "oom-in-multi": [
        ("SET", "a", "1"), ("SET", "b", "2"), ("CONFIG", "SET", "maxmemory-policy", "noeviction"),
        ("CONFIG", "SET", "maxmemory", "1"), ("SET", "c", "3"), ("GET", "a"),
        ("MULTI",), ("SET", "x", "1"), ("DISCARD",),
        ("MULTI",), ("GET", "a"), ("PING",), ("EXEC",), ("CONFIG", "SET", "maxmemory", "0"),
        ("MULTI",), ("GET", "a"), ("PING",), ("CONFIG", "SET", "maxmemory", "1"), ("EXEC",),
        ("CONFIG", "SET", "maxmemory", "0"), ("MULTI",), ("SET", "x", "1"), ("GET", "x"),
        ("CONFIG", "SET", "maxmemory", "1"), ("EXEC",), ("CONFIG", "SET", "maxmemory", "0"),
        ("MULTI",), ("SET", "x", "1"), ("CONFIG", "SET", "maxmemory", "1"), ("EXEC",),
        ("CONFIG", "SET", "maxmemory", "0"), ("GET", "x"),
        ("MULTI",), ("SET", "foo", "bar"), ("CONFIG", "SET", "maxmemory", "bla"), ("EXEC",),
        ("CONFIG", "SET", "maxmemory-policy", "noeviction"),
    ],
    "command-list-and-getkeys": [
        ("COMMAND", "LIST", "bad_arg"), ("COMMAND", "LIST", "FILTERBY", "bad_arg"),
        ("COMMAND", "LIST", "FILTERBY", "bad_arg", "bad_arg2"), ("COMMAND", "LIST", "FILTERBY", "MODULE", "x"),
        ("COMMAND", "LIST", "FILTERBY", "ACLCAT", "nope"), ("COMMAND", "LIST", "FILTERBY", "PATTERN", "set"),
        ("COMMAND", "LIST", "FILTERBY", "PATTERN", "get"), ("COMMAND", "LIST", "FILTERBY", "PATTERN", "non_exists*"),
        ("COMMAND", "GETKEYS", "MEMORY", "USAGE", "key"), ("COMMAND", "GETKEYS", "GET", "key"),
        ("COMMAND", "INFO", "get|key"),
    ],
    "keys-pattern-with-many-stars": [
        ("SET", "a" * 40, "1"), ("KEYS", "a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*b"),
        ("KEYS", "a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a"), ("SCAN", "0", "MATCH", "*a*a*a*a*a*a*a*a*a*a*a*a*c", "COUNT", "100"),
        ("SET", "abcde", "1"), ("KEYS", "a*c*e"), ("KEYS", "a**e"), ("KEYS", "*b?d*"),
    ],
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_replies_match_redis(scenario, redis_module_server, node):
    expected = normalize(run_steps(redis_module_server, SCENARIOS[scenario]))
    assert_same_replies(expected, normalize(run_steps(node, SCENARIOS[scenario])))


def _raw_transcript(daemon: Daemon, requests: list[tuple]) -> bytes:
    """All bytes the server sends back for ``requests`` pipelined (some get no reply)."""
    with socket.create_connection((daemon.host, daemon.port), timeout=5) as sock:
        sock.sendall(b"".join(encode_command(*r) for r in requests) + encode_command("ECHO", "end"))
        data = b""
        while not data.endswith(b"$3\r\nend\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def test_client_reply_off_skip_on(redis_module_server, node):
    requests = [("CLIENT", "REPLY", "SKIP"), ("PING", "a"), ("PING", "b"), ("CLIENT", "REPLY", "OFF"),
                ("PING",), ("SET", "k", "v"), ("GET", "k"), ("CLIENT", "REPLY", "ON"), ("GET", "k"),
                ("CLIENT", "REPLY", "SKIP"), ("CLIENT", "REPLY", "ON"), ("PING",),
                ("CLIENT", "REPLY", "OFF"), ("MULTI",), ("SET", "k", "w"), ("EXEC",), ("CLIENT", "REPLY", "ON"),
                ("GET", "k"), ("DEL", "k")]
    assert _raw_transcript(node, requests) == _raw_transcript(redis_module_server, requests)


def _fields(line: str) -> list[str]:
    return [f.split("=", 1)[0] for f in line.split(" ")]


def test_client_info_and_list_fields(redis_module_server, node):
    """Redis 7's fields in Redis's order (lib-name and lib-ver, from Redis 7.2, last); the
    caller's line counts its own request in qbuf and names the subcommand."""
    lines = {}
    for name, daemon in (("redis", redis_module_server), ("kvstore", node)):
        with RespConnection(daemon) as conn:
            info = decode(conn.call("CLIENT", "INFO")).decode().strip()
            mine = decode(conn.call("CLIENT", "ID"))
            listed = decode(conn.call("CLIENT", "LIST", "ID", str(mine))).decode().strip()
        lines[name] = (info, listed)
    for (info, listed), (ref_info, ref_listed) in zip([lines["kvstore"]], [lines["redis"]]):
        assert [f for f in _fields(info) if f not in ("lib-name", "lib-ver")] == _fields(ref_info)
        assert [f for f in _fields(listed) if f not in ("lib-name", "lib-ver")] == _fields(ref_listed)
        for text, ref, cmd in ((info, ref_info, "client|info"), (listed, ref_listed, "client|list")):
            assert f" cmd={cmd} " in text and f" cmd={cmd} " in ref
            assert re.search(r" qbuf=(\d+) ", text)[1] == re.search(r" qbuf=(\d+) ", ref)[1]


def _info_fields(daemon: Daemon, *sections: str) -> dict[str, str]:
    with RespConnection(daemon) as conn:
        text = decode(conn.call("INFO", *sections)).decode()
    return dict(line.split(":", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_info_cpu_and_sections(redis_module_server, node):
    cpu, ref = _info_fields(node, "cpu"), _info_fields(redis_module_server, "cpu")
    assert list(cpu) == list(ref)
    assert all(re.fullmatch(r"\d+\.\d{6}", v) for v in cpu.values())
    for sections in ((), ("default",), ("all",), ("everything",), ("cpu", "all"), ("cpu", "default")):
        kv_fields, redis_fields = _info_fields(node, *sections), _info_fields(redis_module_server, *sections)
        for name in ("used_cpu_user", "used_cpu_sys_children", "master_repl_offset", "role"):
            assert (name in kv_fields) == (name in redis_fields), (sections, name)
        assert any(k.startswith("cmdstat_") for k in kv_fields) == \
            any(k.startswith("cmdstat_") for k in redis_fields), sections


def test_commandstats_count_calls_and_failures(target):
    with RespConnection(target) as conn:
        assert conn.call("CONFIG", "RESETSTAT") == b"+OK\r\n"
        conn.call("SET", "foo", "bar")
        conn.call("EXPIRE", "foo", "0")
        conn.call("INCR", "nan") and conn.call("SET", "nan", "x") and conn.call("INCR", "nan")
        stats = _info_fields(target, "commandstats")
    assert re.fullmatch(r"calls=1,usec=\d+,usec_per_call=\d+\.\d\d,rejected_calls=0,failed_calls=0",
                        stats["cmdstat_expire"])
    assert "cmdstat_del" not in stats
    assert re.match(r"calls=2,.*,failed_calls=1$", stats["cmdstat_incr"])


def test_time_is_seconds_and_microseconds(target):
    with RespConnection(target) as conn:
        seconds, micros = decode(conn.call("TIME"))
    assert abs(int(seconds) - time.time()) < 5 and 0 <= int(micros) < 1_000_000


def test_randomkey_reaches_every_key_after_a_flush(target):
    with RespConnection(target) as conn:
        for start in range(0, 3000, 500):
            conn.call("MSET", *[str(i).encode() for n in range(start, start + 500) for i in (n, n)])
        conn.call("FLUSHALL")
        conn.call("SET", "foo", "x")
        conn.call("SET", "bar", "y")
        seen = {decode(conn.call("RANDOMKEY")) for _ in range(100)}
    assert seen == {b"foo", b"bar"}
