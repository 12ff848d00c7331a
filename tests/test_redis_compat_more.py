"""Reply-for-reply compatibility with Redis 7 for the rest of the string, key, expiry,
transaction and introspection commands.

Same method as tests/test_redis_compat.py (whose helpers it uses): each
scenario runs on a real redis-server and on a kvstore node from an empty
keyspace, with the same raw requests, and the raw replies must be equal byte
for byte (TTL readings within a tolerance). Both servers start once for the
module, so the whole file runs in seconds.
"""
from __future__ import annotations

import pytest

from conftest import Daemon
from test_redis_compat import RespConnection, Step, assert_same_replies, decode, normalize, run_steps

BIG = b"\x5a" * 5000

SCENARIOS: dict[str, list[Step]] = {
    "no-multi-commands-abort-exec": [
        ("MULTI",), ("SHUTDOWN",), ("SET", "a", "1"), ("EXEC",), ("EXISTS", "a"),
        ("MULTI",), ("SHUTDOWN", "NOSAVE"), ("DISCARD",), ("PING",),
    ],
    "multi-and-watch-inside-multi-do-not-abort": [
        ("MULTI",), ("MULTI",), ("SET", "a", "1"), ("EXEC",), ("GET", "a"),
        ("MULTI",), ("WATCH", "a"), ("INCR", "a"), ("EXEC",),
        ("MULTI",), ("WATCH",), ("EXEC",),
    ],
    "multi-queue-errors": [
        ("MULTI",), ("SETEX", "k"), ("SET", "k", "v"), ("EXEC",), ("EXISTS", "k"),
        ("MULTI",), ("SETEX", "k", "10", "v"), ("INCR", "k"), ("GET", "k"), ("EXEC",), ("TTL", "k"),
    ],
    "watch": [
        ("WATCH", "a", "b"), ("SET", "a", "1"), ("MULTI",), ("SET", "b", "2"), ("EXEC",), ("GET", "b"),
        ("WATCH", "a"), ("MULTI",), ("SET", "b", "3"), ("EXEC",), ("GET", "b"),
        ("WATCH", "a"), ("UNWATCH",), ("SET", "a", "2"), ("MULTI",), ("SET", "b", "4"), ("EXEC",),
        ("WATCH", "a"), ("DEL", "a"), ("MULTI",), ("EXEC",),
        ("WATCH", "missing"), ("MULTI",), ("PING",), ("EXEC",),
        ("SET", "e", "v"), ("WATCH", "e"), ("EXPIRE", "e", "100"), ("MULTI",), ("EXEC",),
        ("WATCH", "a"), ("FLUSHALL",), ("MULTI",), ("EXEC",),
        ("SET", "a", "x"), ("WATCH", "a"), ("APPEND", "a", "y"), ("MULTI",), ("EXEC",),
        ("SET", "a", "1"), ("WATCH", "a"), ("INCR", "a"), ("MULTI",), ("EXEC",),
        ("WATCH", "a"), ("MULTI",), ("DISCARD",), ("SET", "a", "9"), ("MULTI",), ("GET", "a"), ("EXEC",),
        ("WATCH", "a"), ("MULTI",), ("SETEX", "a"), ("EXEC",), ("SET", "a", "8"), ("MULTI",), ("EXEC",),
        ("SET", "t", "v", "PX", "100"), ("WATCH", "t"), 0.2, ("MULTI",), ("EXEC",),
        ("SET", "p", "v", "EX", "100"), ("WATCH", "p"), ("PERSIST", "p"), ("MULTI",), ("EXEC",),
        ("WATCH", "p"), ("PERSIST", "p"), ("MULTI",), ("EXEC",),
        ("SET", "p", "v", "EX", "100"), ("WATCH", "p"), ("GETEX", "p", "PERSIST"), ("MULTI",), ("EXEC",),
        ("WATCH", "p"), ("GET", "p"), ("TTL", "p"), ("EXISTS", "p"), ("MULTI",), ("EXEC",),
        ("UNWATCH", "x"), ("WATCH",),
    ],
    "setex-psetex": [
        ("SETEX", "k", "100", "v"), ("GET", "k"), ("TTL", "k"), ("PSETEX", "p", "100000", "v"), ("PTTL", "p"),
        ("SETEX", "k", "0", "v"), ("SETEX", "k", "-1", "v"), ("SETEX", "k", "abc", "v"),
        ("PSETEX", "k", "0", "v"), ("SETEX", "k", "99999999999999999999", "v"),
        ("SETEX", "k", "9999999999999999", "v"), ("PSETEX", "k", "9223372036854775807", "v"),
        ("SETEX", "k", "10"), ("SETEX", "k", "10", "v", "x"), ("PSETEX", "short", "50", "v"), 0.15,
        ("GET", "short"), ("SETEX", "big", "100", BIG), ("STRLEN", "big"),
    ],
    "setnx-getset-msetnx": [
        ("SETNX", "k", "v"), ("SETNX", "k", "w"), ("GET", "k"), ("SETNX", "k"),
        ("SET", "t", "v", "EX", "100"), ("GETSET", "t", "w"), ("TTL", "t"), ("GETSET", "new", "x"), ("GET", "new"),
        ("GETSET", "t"), ("MSETNX", "a", "1", "b", "2"), ("MGET", "a", "b"), ("MSETNX", "b", "3", "c", "4"),
        ("MGET", "b", "c"), ("MSETNX", "a"), ("MSETNX", "a", "1", "b"), ("MSETNX", "x", "1", "x", "2"),
        ("GET", "x"),
    ],
    "getex": [
        ("GETEX", "missing"), ("SET", "k", "v"), ("GETEX", "k"), ("TTL", "k"), ("GETEX", "k", "EX", "100"),
        ("TTL", "k"), ("GETEX", "k", "PX", "200000"), ("TTL", "k"), ("GETEX", "k", "PERSIST"), ("TTL", "k"),
        ("GETEX", "k", "EXAT", "99999999999"), ("TTL", "k"), ("GETEX", "k", "PXAT", "99999999999000"),
        ("GETEX", "k", "EX", "0"), ("GETEX", "k", "EX", "-5"), ("GETEX", "k", "EX", "x"), ("GETEX", "k", "EX"),
        ("GETEX", "k", "EX", "10", "PX", "100"), ("GETEX", "k", "EX", "10", "EX", "20"), ("TTL", "k"),
        ("GETEX", "k", "PERSIST", "EX", "10"), ("GETEX", "k", "KEEPTTL"), ("GETEX", "k", "FOO"),
        ("GETEX", "missing", "EX", "0"), ("GETEX", "missing", "EX", "x"), ("GETEX", "missing", "BAR"), ("GETEX", "k", "EXAT", "1"),
        ("EXISTS", "k"), ("GETEX",),
    ],
    "append-setrange": [
        ("APPEND", "k", "hello"), ("APPEND", "k", " world"), ("GET", "k"), ("APPEND", "k", ""),
        ("SET", "t", "v", "EX", "100"), ("APPEND", "t", "w"), ("TTL", "t"),
        ("SETRANGE", "k", "6", "WORLD"), ("GET", "k"), ("SETRANGE", "k", "15", "!"), ("GET", "k"),
        ("SETRANGE", "n", "3", "x"), ("GET", "n"), ("SETRANGE", "e", "5", ""), ("EXISTS", "e"),
        ("SETRANGE", "k", "0", ""), ("SETRANGE", "k", "-1", "x"), ("SETRANGE", "k", "x", "x"),
        ("SETRANGE", "k", "536870911", "xx"), ("SETRANGE", "k", "1"), ("APPEND", "k"),
        ("SET", "g", "abc"), ("APPEND", "g", BIG), ("STRLEN", "g"), ("GETRANGE", "g", "0", "5"),
        ("SETRANGE", "g", "4000", "xyz"), ("GETRANGE", "g", "3998", "4004"), ("APPEND", "g", "end"),
        ("GETRANGE", "g", "-5", "-1"), ("SET", "h", "x" * 30), ("APPEND", "h", "y" * 2), ("GET", "h"),
    ],
    "incr-decr": [
        ("INCR", "n"), ("INCR", "n"), ("DECR", "n"), ("INCRBY", "n", "10"), ("DECRBY", "n", "3"), ("GET", "n"),
        ("INCRBY", "n", "-20"), ("DECRBY", "n", "-5"), ("SET", "s", "abc"), ("INCR", "s"), ("DECR", "s"),
        ("SET", "sp", " 1"), ("INCR", "sp"), ("SET", "z", "01"), ("INCR", "z"),
        ("SET", "max", "9223372036854775807"), ("INCR", "max"), ("SET", "min", "-9223372036854775808"),
        ("DECR", "min"), ("INCRBY", "n", "abc"), ("INCRBY", "n", "1.5"), ("DECRBY", "n", "-9223372036854775808"),
        ("INCRBY", "n", "99999999999999999999"), ("SET", "t", "5", "EX", "100"), ("INCR", "t"), ("TTL", "t"),
        ("SET", "long", "1" * 30), ("INCR", "long"), ("INCR",), ("INCRBY", "n"),
    ],
    "incrbyfloat": [
        ("INCRBYFLOAT", "f", "10.5"), ("INCRBYFLOAT", "f", "0.1"), ("INCRBYFLOAT", "g", "0.1"),
        ("INCRBYFLOAT", "g", "0.2"), ("INCRBYFLOAT", "f", "-5"), ("INCRBYFLOAT", "f", "5.0e3"),
        ("INCRBYFLOAT", "f", "abc"), ("INCRBYFLOAT", "f", ""), ("INCRBYFLOAT", "f", " 1"),
        ("INCRBYFLOAT", "f", "inf"), ("INCRBYFLOAT", "f", "nan"), ("SET", "s", "x"), ("INCRBYFLOAT", "s", "1"),
        ("SET", "i", "3"), ("INCRBYFLOAT", "i", "1.5"), ("INCRBYFLOAT", "i", "-4.5"), ("GET", "i"),
        ("INCRBYFLOAT", "h", "1e10"), ("INCRBYFLOAT", "h", ".5"), ("INCRBYFLOAT", "h", "-1e10"),
        ("INCRBYFLOAT", "f"), ("SET", "big", BIG), ("INCRBYFLOAT", "big", "1"), ("INCR", "big"),
        ("INCRBYFLOAT", "f", "1" * 5119), ("INCRBYFLOAT", "f", "1" * 5120), ("SET", "long", "1" * 5119),
        ("INCRBYFLOAT", "long", "0"), ("INCRBYFLOAT", "f", "1e-5000"), ("INCRBYFLOAT", "f", "0e-5000"),
        ("INCRBYFLOAT", "f", "-inf"), ("INCRBYFLOAT", "f", "1e5000"),
    ],
    "rename-renamenx": [
        ("RENAME", "missing", "x"), ("RENAMENX", "missing", "x"), ("SET", "a", "1", "EX", "100"),
        ("RENAME", "a", "b"), ("EXISTS", "a"), ("GET", "b"), ("TTL", "b"), ("RENAME", "b", "b"), ("GET", "b"),
        ("SET", "c", "3"), ("RENAMENX", "b", "c"), ("RENAMENX", "b", "b"), ("RENAMENX", "b", "d"), ("GET", "d"),
        ("SET", "e", "5", "EX", "100"), ("RENAME", "c", "e"), ("TTL", "e"), ("GET", "e"),
        ("SET", "big", BIG), ("RENAME", "big", "big2"), ("STRLEN", "big2"), ("RENAME", "a"),
        ("RENAME", "a", "b", "c"),
    ],
    "copy": [
        ("COPY", "missing", "x"), ("SET", "a", "1", "PX", "100000"), ("COPY", "a", "b"), ("GET", "b"),
        ("PTTL", "b"), ("SET", "c", "3"), ("COPY", "a", "c"), ("GET", "c"), ("COPY", "a", "c", "REPLACE"),
        ("GET", "c"), ("COPY", "a", "a"), ("COPY", "a", "d", "DB", "0"), ("GET", "d"),
        ("COPY", "a", "d", "FOO"), ("COPY", "a", "d", "DB"), ("COPY", "a", "d", "DB", "x"),
        ("COPY", "a", "d", "replace", "db", "0"), ("COPY", "a"), ("SET", "big", BIG), ("COPY", "big", "big2"),
        ("STRLEN", "big2"), ("GETRANGE", "big2", "0", "3"),
    ],
    "touch-randomkey": [
        ("RANDOMKEY",), ("TOUCH", "a"), ("SET", "a", "1"), ("SET", "b", "2"), ("TOUCH", "a", "b", "c", "a"),
        ("DEL", "b"), ("RANDOMKEY",), ("TOUCH",), ("RANDOMKEY", "x"),
        ("SET", "gone", "v", "PX", "30"), ("DEL", "a"), 0.1, ("RANDOMKEY",),
    ],
    "expireat-expiretime": [
        ("SET", "k", "v"), ("EXPIRETIME", "k"), ("PEXPIRETIME", "k"), ("EXPIRETIME", "missing"),
        ("PEXPIRETIME", "missing"), ("EXPIREAT", "k", "99999999999"), ("EXPIRETIME", "k"),
        ("PEXPIREAT", "k", "99999999999123"), ("PEXPIRETIME", "k"), ("EXPIRETIME", "k"),
        ("EXPIREAT", "k", "99999999999", "NX"), ("EXPIREAT", "k", "99999999990", "XX"), ("EXPIRETIME", "k"),
        ("EXPIREAT", "k", "99999999999", "LT"), ("EXPIREAT", "k", "99999999999", "GT"), ("EXPIRETIME", "k"),
        ("EXPIREAT", "k", "99999999999", "NX", "XX"), ("EXPIREAT", "k", "1", "GT", "LT"),
        ("EXPIREAT", "k", "x"), ("EXPIREAT", "k", "99999999999", "FOO"), ("EXPIREAT", "missing", "99999999999"),
        ("EXPIREAT", "k", "1"), ("EXISTS", "k"), ("SET", "k", "v"), ("PEXPIREAT", "k", "-5"), ("EXISTS", "k"),
        ("EXPIRETIME",), ("PEXPIREAT", "k"), ("SET", "p", "v"), ("EXPIRE", "p", "100", "NX"),
        ("EXPIRE", "p", "200", "NX"), ("EXPIRE", "p", "50", "GT"), ("EXPIRE", "p", "50", "LT"), ("TTL", "p"),
    ],
    "object": [
        ("OBJECT", "ENCODING", "missing"), ("SET", "i", "12345"), ("OBJECT", "ENCODING", "i"),
        ("SET", "s", "hello"), ("OBJECT", "ENCODING", "s"), ("SET", "r", "x" * 45), ("OBJECT", "ENCODING", "r"),
        ("SET", "e", "x" * 44), ("OBJECT", "encoding", "e"), ("SET", "z", "012"), ("OBJECT", "ENCODING", "z"),
        ("OBJECT", "REFCOUNT", "s"), ("OBJECT", "REFCOUNT", "missing"), ("OBJECT", "FREQ", "s"),
        ("OBJECT", "FREQ", "missing"), ("OBJECT", "HELP"), ("OBJECT", "FOO"), ("OBJECT",),
        ("OBJECT", "ENCODING"), ("OBJECT", "ENCODING", "s", "x"), ("OBJECT", "HELP", "x"),
    ],
    "command-getkeys": [
        ("COMMAND", "GETKEYS", "GET", "a"), ("COMMAND", "GETKEYS", "get", "a"), ("COMMAND", "GETKEYS", "FOO", "a"),
        ("COMMAND", "GETKEYS", "GET"), ("COMMAND", "GETKEYS", "GET", "a", "b"), ("COMMAND", "GETKEYS", "PING", "x"),
        ("COMMAND", "GETKEYS", "MSET", "a", "1", "b", "2"), ("COMMAND", "GETKEYS", "MSET", "a", "1", "b"),
        ("COMMAND", "GETKEYS", "SET", "k"), ("COMMAND", "GETKEYS", "RENAME", "a", "b"),
        ("COMMAND", "GETKEYS", "CLIENT", "LIST"), ("COMMAND", "GETKEYS", "OBJECT", "ENCODING", "k"),
        ("COMMAND", "GETKEYS", "MSETNX", "a", "1"), ("COMMAND", "GETKEYS"),
    ],
    "client-kill-and-no-evict": [
        ("CLIENT", "KILL", "1.2.3.4:5"), ("CLIENT", "KILL", "ID", "0"), ("CLIENT", "KILL", "ID", "x"),
        ("CLIENT", "KILL", "ID", "99999"), ("CLIENT", "KILL", "TYPE", "foo"),
        ("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "maybe"), ("CLIENT", "KILL", "USER", "nobody"),
        ("CLIENT", "KILL", "ID"), ("CLIENT", "KILL", "LADDR", "1:1"), ("CLIENT", "KILL", "ADDR", "1.2.3.4:5"),
        ("CLIENT", "KILL", "SKIPME", "yes"), ("CLIENT", "KILL", "TYPE", "master"), ("CLIENT", "KILL", "FOO", "bar"),
        ("CLIENT", "KILL", "ID", "1", "TYPE"), ("CLIENT", "KILL"), ("CLIENT", "NO-EVICT", "on"),
        ("CLIENT", "NO-EVICT", "OFF"), ("CLIENT", "NO-EVICT", "x"), ("CLIENT", "NO-EVICT"),
    ],
    "client-pause-arguments": [
        ("CLIENT", "PAUSE", "x"), ("CLIENT", "PAUSE", "-1"), ("CLIENT", "PAUSE", "10", "foo"),
        ("CLIENT", "PAUSE", "10", "write", "x"), ("CLIENT", "PAUSE", "99999999999999999999"),
        ("CLIENT", "PAUSE"), ("CLIENT", "UNPAUSE", "x"), ("CLIENT", "PAUSE", "0", "all"), ("CLIENT", "UNPAUSE"),
        ("CLIENT", "PAUSE", "10", "WRITE"), ("CLIENT", "UNPAUSE"), ("SET", "k", "v"),
    ],
    "latency-monitor-off": [
        ("LATENCY", "LATEST"), ("LATENCY", "HISTORY", "command"), ("LATENCY", "RESET"),
        ("LATENCY", "RESET", "command", "x"), ("LATENCY", "GRAPH", "command"), ("LATENCY", "HISTORY"),
        ("LATENCY", "LATEST", "x"), ("LATENCY", "FOO"), ("LATENCY",),
    ],
    "slowlog-errors-and-help": [
        ("SLOWLOG", "GET", "-2"), ("SLOWLOG", "GET", "x"), ("SLOWLOG", "GET", "1", "2"), ("SLOWLOG", "LEN", "x"),
        ("SLOWLOG", "RESET", "x"), ("SLOWLOG",), ("SLOWLOG", "FOO"), ("SLOWLOG", "HELP"), ("SLOWLOG", "RESET"),
        ("SLOWLOG", "GET", "0"),
    ],
    "lcs": [
        ("LCS", "a", "b"), ("MSET", "a", "ohmytext", "b", "mynewtext"), ("LCS", "a", "b"), ("LCS", "a", "b", "LEN"),
        ("LCS", "a", "b", "IDX"), ("LCS", "a", "b", "IDX", "MINMATCHLEN", "4"),
        ("LCS", "a", "b", "IDX", "MINMATCHLEN", "4", "WITHMATCHLEN"), ("LCS", "a", "b", "idx", "withmatchlen"),
        ("LCS", "a", "b", "LEN", "IDX"), ("LCS", "a", "b", "MINMATCHLEN", "x"), ("LCS", "a", "b", "FOO"),
        ("LCS", "a", "b", "IDX", "MINMATCHLEN", "-1"), ("LCS", "a", "missing"), ("LCS", "a", "missing", "IDX"),
        ("LCS", "a"), ("MSET", "x", "abcabcabcxyz", "y", "xaybczabcxxyz"), ("LCS", "x", "y"),
        ("LCS", "x", "y", "IDX", "WITHMATCHLEN"), ("LCS", "y", "x", "IDX"), ("LCS", "x", "x", "IDX"),
        ("SET", "big1", BIG[:2000] + b"q" * 100), ("SET", "big2", b"q" * 50 + BIG[:1500]),
        ("LCS", "big1", "big2", "LEN"), ("LCS", "big1", "big2", "IDX", "MINMATCHLEN", "10"),
    ],
}


@pytest.fixture(scope="module")
def node(kvstore_module_factory) -> Daemon:
    return kvstore_module_factory()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_replies_match_redis(scenario, redis_module_server, node):
    expected = normalize(run_steps(redis_module_server, SCENARIOS[scenario]))
    assert_same_replies(expected, normalize(run_steps(node, SCENARIOS[scenario])))


def test_a_write_from_another_client_aborts_exec(target):
    with RespConnection(target) as watcher, RespConnection(target) as other:
        assert watcher.call("WATCH", "k") == b"+OK\r\n"
        assert other.call("SET", "k", "v") == b"+OK\r\n"
        assert watcher.call("MULTI") == b"+OK\r\n"
        assert watcher.call("SET", "k", "mine") == b"+QUEUED\r\n"
        assert watcher.call("EXEC") == b"*-1\r\n"
        assert watcher.call("GET", "k") == b"$1\r\nv\r\n"


@pytest.fixture(params=["redis", "kvstore"])
def target(request, redis_module_server, node) -> Daemon:
    """Each server in turn, with an empty keyspace."""
    daemon = redis_module_server if request.param == "redis" else node
    with RespConnection(daemon) as conn:
        conn.call("FLUSHALL")
    return daemon


def test_object_idletime_says_it_is_not_tracked(node):
    """A deliberate departure: eviction keeps an access order, not access times."""
    with RespConnection(node) as conn:
        conn.call("SET", "k", "v")
        assert conn.call("OBJECT", "IDLETIME", "k").startswith(b"-ERR kvstore keeps the order of accesses")
        assert conn.call("OBJECT", "IDLETIME", "missing") == b"$-1\r\n"


def client_id(conn: RespConnection) -> int:
    return int(conn.call("CLIENT", "ID")[1:-2])


def test_client_kill_by_id_closes_that_client(target):
    with RespConnection(target) as killer, RespConnection(target) as victim, RespConnection(target) as bystander:
        assert killer.call("CLIENT", "KILL", "ID", client_id(victim)) == b":1\r\n"
        assert victim.closed_by_peer()
        assert bystander.call("PING") == b"+PONG\r\n"


def test_client_kill_by_user_skips_the_caller_unless_asked(target):
    with RespConnection(target) as killer, RespConnection(target) as victim:
        victim.call("PING")
        assert killer.call("CLIENT", "KILL", "USER", "default") == b":1\r\n"
        assert victim.closed_by_peer()
        assert killer.call("CLIENT", "KILL", "USER", "default", "SKIPME", "no") == b":1\r\n"
        assert killer.closed_by_peer()


def test_client_kill_old_form_by_address(target):
    with RespConnection(target) as killer, RespConnection(target) as victim:
        addr = victim.sock.getsockname()
        assert killer.call("CLIENT", "KILL", f"{addr[0]}:{addr[1]}") == b"+OK\r\n"
        assert victim.closed_by_peer()


def test_client_tracking_is_refused_as_an_unknown_subcommand(node):
    """A deliberate departure: no client-side caching invalidations; Redis's error for a subcommand it lacks."""
    with RespConnection(node) as conn:
        assert conn.call("CLIENT", "TRACKING", "on") == b"-ERR unknown subcommand 'TRACKING'. Try CLIENT HELP.\r\n"


NEW_COMMANDS = ["setex", "psetex", "setnx", "getset", "msetnx", "getex", "append", "setrange", "incr", "decr",
                "incrby", "decrby", "incrbyfloat", "watch", "unwatch", "rename", "renamenx", "copy", "touch",
                "randomkey", "expireat", "pexpireat", "expiretime", "pexpiretime", "object", "latency", "slowlog", "lcs"]


def test_command_info_of_the_new_commands_matches_redis(redis_module_server, node):
    """Name, arity and key positions (what cluster clients route by) as Redis reports them;
    OBJECT names its key (2, 2, 1) where Redis's container says (0, 0, 0), so that
    cluster routing and ACL key checks see it."""
    def shape(daemon):
        with RespConnection(daemon) as conn:
            return [None if e is None else (e[0], e[1], e[3], e[4], e[5])
                    for e in decode(conn.call("COMMAND", "INFO", *NEW_COMMANDS)) if e[0] != b"object"]
    assert shape(node) == shape(redis_module_server)


def test_command_docs_describe_the_new_commands(node):
    with RespConnection(node) as conn:
        flat = decode(conn.call("COMMAND", "DOCS", *NEW_COMMANDS))
        docs = dict(zip(flat[::2], flat[1::2]))
        count = decode(conn.call("COMMAND", "COUNT"))
        listed = decode(conn.call("COMMAND", "LIST"))
    assert sorted(docs) == sorted(n.encode() for n in NEW_COMMANDS)
    assert all(dict(zip(d[::2], d[1::2]))[b"summary"] for d in docs.values())
    assert count == len([n for n in listed if b"|" not in n]) and set(docs) <= set(listed)  # LIST adds subcommands


def slowlog_entries(conn: RespConnection, *count) -> list:
    return decode(conn.call("SLOWLOG", "GET", *count))


def test_slowlog_records_what_is_slower_than_the_threshold(target):
    """Threshold 0 logs every command (with Redis's shortening of long arguments), -1 none."""
    with RespConnection(target) as conn:
        try:
            assert conn.call("CONFIG", "SET", "slowlog-log-slower-than", "0") == b"+OK\r\n"
            conn.call("SLOWLOG", "RESET")
            conn.call("SET", "k", "v" * 200)
            conn.call("MSET", *[str(i) for i in range(40)])
            entries = slowlog_entries(conn, "-1")
            assert [e[3][0] for e in entries[:3]] == [b"MSET", b"SET", b"SLOWLOG"]
            mset, set_ = entries[0], entries[1]
            assert set_[3] == [b"SET", b"k", b"v" * 128 + b"... (72 more bytes)"]
            assert len(mset[3]) == 32 and mset[3][-1] == b"... (10 more arguments)"
            assert mset[0] > set_[0] and mset[2] >= 0 and mset[4].startswith(b"127.0.0.1:")
            assert len(slowlog_entries(conn, "1")) == 1
            assert conn.call("CONFIG", "SET", "slowlog-log-slower-than", "-1") == b"+OK\r\n"
            length = decode(conn.call("SLOWLOG", "LEN"))
            conn.call("GET", "k")
            assert decode(conn.call("SLOWLOG", "LEN")) == length
            assert conn.call("CONFIG", "SET", "slowlog-max-len", "1") == b"+OK\r\n"
            assert decode(conn.call("SLOWLOG", "LEN")) == length       # trimmed at the next entry
            assert conn.call("CONFIG", "SET", "slowlog-log-slower-than", "0") == b"+OK\r\n"
            assert decode(conn.call("SLOWLOG", "LEN")) == 1
        finally:
            conn.call("CONFIG", "SET", "slowlog-log-slower-than", "10000", "slowlog-max-len", "128")


def test_slowlog_settings_are_bounded(target):
    with RespConnection(target) as conn:
        assert conn.call("CONFIG", "SET", "slowlog-log-slower-than", "-5").startswith(
            b"-ERR CONFIG SET failed (possibly related to argument 'slowlog-log-slower-than')")
        assert conn.call("CONFIG", "SET", "slowlog-max-len", "-1").startswith(
            b"-ERR CONFIG SET failed (possibly related to argument 'slowlog-max-len')")
        pairs = decode(conn.call("CONFIG", "GET", "slowlog*"))
        assert dict(zip(pairs[::2], pairs[1::2])) == {b"slowlog-log-slower-than": b"10000", b"slowlog-max-len": b"128"}


def nothing_arrives(conn: RespConnection, within: float) -> bool:
    return conn.read_available(1, within) == b""


def test_client_pause_write_holds_writes_until_unpause(target):
    with RespConnection(target) as admin, RespConnection(target) as writer_, RespConnection(target) as reader:
        assert admin.call("CLIENT", "PAUSE", "20000", "WRITE") == b"+OK\r\n"
        try:
            writer_.send(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n")
            assert reader.call("GET", "k") == b"$-1\r\n"          # reads go on
            assert nothing_arrives(writer_, 0.2)
        finally:
            assert admin.call("CLIENT", "UNPAUSE") == b"+OK\r\n"
        writer_.sock.settimeout(10)
        assert writer_.read_reply() == b"+OK\r\n"
        assert reader.call("GET", "k") == b"$1\r\nv\r\n"


def test_client_pause_all_holds_every_command_until_its_deadline(target):
    with RespConnection(target) as admin, RespConnection(target) as other:
        assert admin.call("CLIENT", "PAUSE", "400") == b"+OK\r\n"
        other.send(b"*1\r\n$4\r\nPING\r\n")
        assert nothing_arrives(other, 0.1)
        other.sock.settimeout(10)
        assert other.read_reply() == b"+PONG\r\n"


@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
def test_redis_py_sends_these_commands_on_its_own(node):
    """redis-py's setex/setnx/getex/incrbyfloat and an optimistic transaction (WATCH, MULTI, EXEC)."""
    import redis as redis_py
    client = redis_py.Redis(host=node.host, port=node.port)
    try:
        client.flushall()
        assert client.setex("k", 100, "v") and 0 < client.ttl("k") <= 100
        assert client.setnx("n", "1") and not client.setnx("n", "2")
        assert client.getex("k", persist=True) == b"v" and client.ttl("k") == -1
        assert client.incrbyfloat("f", 0.5) == 0.5

        def bump(pipe):
            value = int(pipe.get("n"))
            pipe.multi()
            pipe.set("n", value + 1)
        client.transaction(bump, "n")
        assert client.get("n") == b"2"
        with client.pipeline() as pipe:
            pipe.watch("n")
            client.set("n", "changed")          # another client's write
            pipe.multi()
            pipe.set("n", "mine")
            with pytest.raises(redis_py.WatchError):
                pipe.execute()
        assert client.get("n") == b"changed"
    finally:
        client.close()


def test_lcs_of_long_values_answers_len_but_refuses_the_walk(node):
    """A deliberate limit: the string and IDX replies walk back over both values in Python."""
    with RespConnection(node) as conn:
        conn.call("SET", "a", "x")
        conn.call("SET", "b", b"yx" * 200_000)
        assert conn.call("LCS", "a", "b", "LEN") == b":1\r\n"
        assert conn.call("LCS", "a", "b").startswith(b"-ERR LCS walks back over both values")
