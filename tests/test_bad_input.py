"""Bad input on the wire: the daemon answers as Redis does and keeps serving.

Starts real redis-server and `kvstore serve` processes. Every expectation
below is Redis 7's reply, and each test runs against Redis too, so the
expectation is known to be right. What is checked:
- malformed RESP gets Redis's `-ERR Protocol error: ...` text, and the
  connection is closed exactly where Redis closes it (and left open where
  Redis skips the bad frame);
- limits: bulk lengths above --proto-max-bulk-len, Redis's pre-AUTH limits, a
  multibulk header that claims billions of elements (memory stays bounded);
- a client that sends half a value and disconnects leaves nothing behind, and
  everyone else is served meanwhile;
- a full noeviction store answers Redis's -OOM error;
- a hypothesis fuzz of the parser: random bytes and mutated commands never
  take the daemon down.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import Daemon, wait_until
from test_redis_compat import RespConnection, encode_command

MiB = 1 << 20
PASSWORD = "pw"
MAXCLIENTS = 4


@pytest.fixture(scope="module")
def node(kvstore_module_factory) -> Daemon:
    return kvstore_module_factory()


@pytest.fixture(scope="module")
def node_guarded(kvstore_module_factory) -> Daemon:
    """A password, a 1 MiB bulk limit and a small client limit."""
    return kvstore_module_factory("--proto-max-bulk-len", "1mb", "--maxclients", str(MAXCLIENTS),
                                  password=PASSWORD)


@pytest.fixture(scope="module")
def node_noeviction(kvstore_module_factory) -> Daemon:
    return kvstore_module_factory("--maxmemory-policy", "noeviction")


def configure(daemon: Daemon, *pairs: str) -> Daemon:
    with RespConnection(daemon) as conn:
        for name, value in zip(pairs[::2], pairs[1::2]):
            assert conn.call("CONFIG", "SET", name, value) == b"+OK\r\n", name
    return daemon


def flushed(daemon: Daemon) -> Daemon:
    with RespConnection(daemon) as conn:
        if daemon.password:
            conn.call("AUTH", daemon.password)
        assert conn.call("FLUSHALL") == b"+OK\r\n"
    return daemon


@pytest.fixture(params=["redis", "kvstore"])
def target(request, node) -> Daemon:
    return flushed(request.getfixturevalue("redis_server") if request.param == "redis" else node)


@pytest.fixture(params=["redis", "kvstore"])
def guarded(request, node_guarded) -> Daemon:
    if request.param == "kvstore":
        return flushed(node_guarded)
    redis = configure(request.getfixturevalue("redis_server"), "proto-max-bulk-len", "1mb",
                      "maxclients", str(MAXCLIENTS), "requirepass", PASSWORD)
    redis.password = PASSWORD
    return redis


@pytest.fixture(params=["redis", "kvstore"])
def noeviction(request, node_noeviction) -> Daemon:
    if request.param == "kvstore":
        return flushed(node_noeviction)
    return configure(request.getfixturevalue("redis_server"), "maxmemory-policy", "noeviction",
                     "maxmemory", "64mb")


def only_client_left(conn: RespConnection) -> None:
    """Wait until the server has seen every connection but ``conn`` close."""
    wait_until(lambda: b"connected_clients:1\r\n" in conn.call("INFO", "clients"),
               what="the server to notice closed connections")


def answers_ping(daemon: Daemon) -> bool:
    with RespConnection(daemon, timeout=5) as conn:
        return conn.call("PING") == b"+PONG\r\n"


def rss_bytes(daemon: Daemon) -> int:
    with open(f"/proc/{daemon.proc.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS line")


@dataclass(frozen=True)
class Malformed:
    """A request and Redis's reply to it; `closes`: Redis closes the connection after."""

    payload: bytes
    reply: bytes
    closes: bool = True


def protocol_error(text: str) -> bytes:
    return b"-ERR Protocol error: " + text.encode() + b"\r\n"


MALFORMED = {
    "multibulk-not-a-number": Malformed(b"*abc\r\n", protocol_error("invalid multibulk length")),
    "multibulk-trailing-junk": Malformed(b"*1x\r\n", protocol_error("invalid multibulk length")),
    "multibulk-leading-zero": Malformed(b"*01\r\n$4\r\nPING\r\n",
                                        protocol_error("invalid multibulk length")),
    "multibulk-lf-only": Malformed(b"*1\n$4\r\nPING\r\n", protocol_error("invalid multibulk length")),
    "multibulk-above-int-max": Malformed(b"*2147483648\r\n",
                                         protocol_error("invalid multibulk length")),
    "multibulk-count-too-long": Malformed(b"*" + b"1" * 70000,
                                          protocol_error("too big mbulk count string")),
    "element-not-bulk": Malformed(b"*1\r\nabc\r\n", protocol_error("expected '$', got 'a'")),
    "element-nested-array": Malformed(b"*1\r\n*1\r\n", protocol_error("expected '$', got '*'")),
    "bulk-not-a-number": Malformed(b"*1\r\n$abc\r\n", protocol_error("invalid bulk length")),
    "bulk-negative": Malformed(b"*1\r\n$-1\r\n", protocol_error("invalid bulk length")),
    "bulk-leading-zero": Malformed(b"*1\r\n$04\r\nPING\r\n", protocol_error("invalid bulk length")),
    "bulk-plus-sign": Malformed(b"*1\r\n$+4\r\nPING\r\n", protocol_error("invalid bulk length")),
    "bulk-space": Malformed(b"*1\r\n$ 4\r\nPING\r\n", protocol_error("invalid bulk length")),
    "bulk-above-default-limit": Malformed(b"*1\r\n$536870913\r\n",
                                          protocol_error("invalid bulk length")),
    "bulk-count-too-long": Malformed(b"*1\r\n$" + b"1" * 70000,
                                     protocol_error("too big bulk count string")),
    "inline-too-long": Malformed(b"A" * 70000, protocol_error("too big inline request")),
    "inline-unbalanced-quotes": Malformed(b'SET k "abc\r\n',
                                          protocol_error("unbalanced quotes in request")),
    "inline-quote-then-text": Malformed(b'ECHO "a"b\r\n',
                                        protocol_error("unbalanced quotes in request")),
    "multibulk-negative-is-skipped": Malformed(b"*-5\r\nPING\r\n", b"+PONG\r\n", closes=False),
    "multibulk-empty-is-skipped": Malformed(b"*0\r\nPING\r\n", b"+PONG\r\n", closes=False),
    "empty-lines-are-skipped": Malformed(b"\r\n\r\n\nPING\r\n", b"+PONG\r\n", closes=False),
    # Redis skips the two bytes after a bulk's data without looking at them.
    "bulk-terminator-not-checked": Malformed(b"*1\r\n$4\r\nPINGxx", b"+PONG\r\n", closes=False),
    "empty-command-name": Malformed(
        b"*1\r\n$0\r\n\r\n", b"-ERR unknown command '', with args beginning with: \r\n", closes=False),
    "reply-types-as-commands": Malformed(
        b"+PING\r\n", b"-ERR unknown command '+PING', with args beginning with: \r\n", closes=False),
}


def assert_replies_then(conn: RespConnection, payload: bytes, reply: bytes, closes: bool) -> None:
    conn.send(payload)
    got = conn.read_available(len(reply), quiet=3.0)
    assert got == reply
    if closes:
        assert conn.closed_by_peer(), "Redis closes the connection after this error"
    else:
        conn.send(b"PING\r\n")
        assert conn.read_reply() == b"+PONG\r\n", "the connection must stay usable"


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_request(target, case):
    bad = MALFORMED[case]
    with RespConnection(target) as conn:
        assert conn.call("SET", "before", "1") == b"+OK\r\n"
        assert_replies_then(conn, bad.payload, bad.reply, bad.closes)
    assert answers_ping(target)


def test_request_split_into_single_bytes(target):
    request = encode_command("SET", "slow", "hello world") + b"GET slow\r\n"
    with RespConnection(target) as conn:
        for i in range(len(request)):
            conn.send(request[i:i + 1])
            time.sleep(0.001)
        assert conn.read_reply() == b"+OK\r\n"
        assert conn.read_reply() == b"$11\r\nhello world\r\n"


def test_command_errors_keep_the_connection(target):
    requests = [("GET",), ("SET", "k"), ("NOSUCH", "a"), ("EXPIRE", "k", "soon"),
                ("GETRANGE", "k", "0", "x"), ("SET", "k", "v", "EX", "1.5"), ("SET", "k", "v", "BAD"),
                ("MSET", "a", "1", "b"), ("SCAN", "notacursor"), ("PING",)]
    expected = [
        b"-ERR wrong number of arguments for 'get' command\r\n",
        b"-ERR wrong number of arguments for 'set' command\r\n",
        b"-ERR unknown command 'NOSUCH', with args beginning with: 'a' \r\n",
        b"-ERR value is not an integer or out of range\r\n",
        b"-ERR value is not an integer or out of range\r\n",
        b"-ERR value is not an integer or out of range\r\n",
        b"-ERR syntax error\r\n",
        b"-ERR wrong number of arguments for 'mset' command\r\n",
        b"-ERR invalid cursor\r\n",
        b"+PONG\r\n",
    ]
    with RespConnection(target) as conn:
        conn.send(b"".join(encode_command(*r) for r in requests))
        assert [conn.read_reply() for _ in requests] == expected
        assert conn.call("EXISTS", "k", "a", "b") == b":0\r\n"


def test_bulk_above_proto_max_bulk_len(guarded):
    with RespConnection(guarded) as conn:
        assert conn.call("AUTH", PASSWORD) == b"+OK\r\n"
        assert conn.call("SET", "at-limit", b"x" * MiB) == b"+OK\r\n"
        assert conn.call("STRLEN", "at-limit") == b":1048576\r\n"
        header = b"*3\r\n$3\r\nSET\r\n$4\r\nover\r\n$1048577\r\n"
        assert_replies_then(conn, header, protocol_error("invalid bulk length"), closes=True)
    with RespConnection(guarded) as conn:
        assert conn.call("AUTH", PASSWORD) == b"+OK\r\n"
        assert conn.call("EXISTS", "over", "at-limit") == b":1\r\n"


NOAUTH = b"-NOAUTH Authentication required.\r\n"
WRONGPASS = b"-WRONGPASS invalid username-password pair or user is disabled.\r\n"


def test_auth_failures(guarded):
    with RespConnection(guarded) as conn:
        assert conn.call("GET", "k") == NOAUTH
        assert conn.call("SET", "k", "v") == NOAUTH
        assert conn.call("AUTH", "wrong") == WRONGPASS
        assert conn.call("AUTH", "default", "wrong") == WRONGPASS
        assert conn.call("AUTH", "someone", PASSWORD) == WRONGPASS
        assert conn.call("GET", "k") == NOAUTH
        assert conn.call("AUTH", PASSWORD) == b"+OK\r\n"
        assert conn.call("GET", "k") == b"$-1\r\n"
    with RespConnection(guarded) as conn:
        assert conn.call("AUTH", "default", PASSWORD) == b"+OK\r\n"
        assert conn.call("PING") == b"+PONG\r\n"


@pytest.mark.parametrize("payload,error", [
    (b"*11\r\n", "unauthenticated multibulk length"),
    (b"*2\r\n$3\r\nGET\r\n$16385\r\n", "unauthenticated bulk length"),
])
def test_limits_before_auth(guarded, payload, error):
    with RespConnection(guarded) as conn:
        assert_replies_then(conn, payload, protocol_error(error), closes=True)
    with RespConnection(guarded) as conn:
        assert conn.call("AUTH", PASSWORD) == b"+OK\r\n"
        assert conn.call("ECHO", b"e" * 16385) == b"$16385\r\n" + b"e" * 16385 + b"\r\n"


MAXCLIENTS_ERROR = b"-ERR max number of clients reached\r\n"


def authenticated(daemon: Daemon) -> RespConnection:
    """A connection the server accepted: its AUTH answered OK."""
    conn = RespConnection(daemon)
    if conn.call("AUTH", PASSWORD) != b"+OK\r\n":
        conn.close()
        raise AssertionError("a connection within the client limit was refused")
    return conn


def can_authenticate(daemon: Daemon) -> bool:
    try:
        with RespConnection(daemon) as conn:
            return conn.call("AUTH", PASSWORD) == b"+OK\r\n"
    except (ConnectionError, OSError):
        return False


def test_maxclients_refuses_the_extra_connection(guarded):
    """Redis answers the connection past the limit with an error and closes it."""
    held = [authenticated(guarded)]
    try:
        only_client_left(held[0])      # the connections of earlier tests and fixtures are gone
        held += [authenticated(guarded) for _ in range(MAXCLIENTS - 1)]
        with RespConnection(guarded) as extra:
            assert extra.read_available(len(MAXCLIENTS_ERROR), quiet=10) == MAXCLIENTS_ERROR
            assert extra.closed_by_peer(wait=10)
        assert held[0].call("PING") == b"+PONG\r\n"
    finally:
        for conn in held:
            conn.close()
    wait_until(lambda: can_authenticate(guarded), what="the closed connections' places to free up")


def test_slow_reader_does_not_stall_others(target):
    value = bytes(range(256)) * (4 * MiB // 256)
    with RespConnection(target) as slow, RespConnection(target) as other:
        assert slow.call("SET", "big", value) == b"+OK\r\n"
        slow.send(encode_command("GET", "big") * 16)  # 64 MiB of replies nobody reads yet
        time.sleep(0.2)
        for i in range(50):
            assert other.call("SET", f"other-{i}", i) == b"+OK\r\n"
            assert other.call("GET", f"other-{i}") == b"$%d\r\n%d\r\n" % (len(str(i)), i)
        expected = b"$4194304\r\n" + value + b"\r\n"
        assert all(slow.read_reply() == expected for _ in range(16))


def test_huge_multibulk_claims_keep_memory_bounded(target):
    before = rss_bytes(target)
    for _ in range(20):
        with RespConnection(target) as liar:
            liar.send(b"*2147483647\r\n" + b"$3\r\nabc\r\n" * 1000)
            assert answers_ping(target), "others must be served while a request is pending"
        with RespConnection(target) as liar:
            liar.send(b"*5000000\r\n$3\r\nSET\r\n$1\r\nk\r\n$50000000\r\n" + b"v" * 65536)
    assert answers_ping(target)
    growth = rss_bytes(target) - before
    assert growth < 64 * MiB, f"RSS grew by {growth / MiB:.0f} MiB"
    with RespConnection(target) as conn:
        assert conn.call("EXISTS", "k") == b":0\r\n"


def test_half_sent_value_leaves_nothing(noeviction):
    """A 4 MiB SET cut in the middle: no key, old value intact, no reservation kept."""
    value = bytes(range(256)) * (4 * MiB // 256)
    with RespConnection(noeviction) as other:
        assert other.call("SET", "kept", "old") == b"+OK\r\n"
        for round_ in range(24):  # 24 x 4 MiB > the 64 MiB store: leaked space would show
            for key in ("kept", f"absent-{round_}"):
                with RespConnection(noeviction) as quitter:
                    quitter.send(encode_command("SET", key, value)[:2 * MiB])
                    assert other.call("SET", "alive", str(round_)) == b"+OK\r\n"
                    assert other.call("GET", "kept") == b"$3\r\nold\r\n"
            assert other.call("EXISTS", f"absent-{round_}") == b":0\r\n"
        only_client_left(other)
        assert other.call("GET", "kept") == b"$3\r\nold\r\n"
        assert other.call("DBSIZE") == b":2\r\n"
        for i in range(8):
            assert other.call("SET", f"full-{i}", value) == b"+OK\r\n", "space was not released"
        assert other.call("STRLEN", "full-7") == b":4194304\r\n"


def test_half_sent_kv_put_leaves_nothing(node_noeviction):
    flushed(node_noeviction)
    with RespConnection(node_noeviction) as other:
        for _ in range(4):
            with RespConnection(node_noeviction) as quitter:
                quitter.send(encode_command("KV.PUT", "block", b"\x01" * (4 * MiB), "PARENT", "root")
                             [:3 * MiB])
                assert other.call("PING") == b"+PONG\r\n"
        only_client_left(other)
        assert other.call("EXISTS", "block") == b":0\r\n"
        assert other.call("KV.MATCH", "block") == b":0\r\n"
        assert other.call("DBSIZE") == b":0\r\n"


OOM = b"-OOM command not allowed when used memory > 'maxmemory'.\r\n"


def test_noeviction_store_answers_oom(noeviction):
    value = b"\x5a" * (512 * 1024)
    with RespConnection(noeviction) as conn:
        stored = 0
        reply = b""
        while stored < 1000:
            reply = conn.call("SET", f"fill-{stored}", value)
            if reply != b"+OK\r\n":
                break
            stored += 1
        assert reply == OOM
        assert 16 < stored < 1000
        assert conn.call("EXISTS", f"fill-{stored}") == b":0\r\n"
        assert conn.call("GET", "fill-0") == b"$524288\r\n" + value + b"\r\n"
        assert conn.call("SET", "another", value) == OOM
        assert conn.call("DEL", "fill-1") == b":1\r\n"
        assert conn.call("FLUSHALL") == b"+OK\r\n"
        assert conn.call("SET", "after-flush", value) == b"+OK\r\n"


SAFE_COMMANDS = [
    ("SET", "k", "v"), ("GET", "k"), ("MGET", "a", "k", "b"), ("DEL", "a", "k"), ("EXISTS", "k", "k"),
    ("PING",), ("ECHO", "hello"), ("SET", "k", "v", "EX", "10", "NX"), ("GETRANGE", "k", "0", "-1"),
    ("SCAN", "0", "MATCH", "k*", "COUNT", "10"), ("KEYS", "k*"), ("TTL", "k"), ("HELLO", "3"),
    ("CLIENT", "SETNAME", "fuzz"), ("KV.PUT", "child", "v", "PARENT", "root", "NX"),
    ("KV.MATCH", "root", "child", "x"), ("KV.LOCATE", "root", "child"), ("KV.STATS",),
    ("MSET", "a", "1", "b", "2"), ("GETDEL", "a"), ("STRLEN", "k"),
]


@st.composite
def mutated_commands(draw) -> bytes:
    """A pipeline of valid requests with bytes flipped, inserted, dropped or cut."""
    picks = draw(st.lists(st.sampled_from(SAFE_COMMANDS), min_size=1, max_size=4))
    data = bytearray(b"".join(encode_command(*c) for c in picks))
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["flip", "insert", "delete", "cut", "digits"]))
        if op == "flip" and pos < len(data):
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 8))]
        elif op == "cut":
            del data[pos:]
        elif op == "digits":
            data[pos:pos] = draw(st.sampled_from([b"-1", b"0", b"99999999999", b"2147483648", b"-"]))
    return bytes(data)


def send_and_hang_up(daemon: Daemon, payload: bytes) -> None:
    with socket.create_connection((daemon.host, daemon.port), timeout=5) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(0.2)
            while sock.recv(65536):
                pass
        except (socket.timeout, ConnectionError):
            pass


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(payload=st.one_of(st.binary(max_size=512), mutated_commands()))
def test_fuzzed_input_never_takes_the_daemon_down(target, payload):
    send_and_hang_up(target, payload)
    assert target.proc.poll() is None, "the daemon exited"
    assert answers_ping(target), f"no PONG after {payload!r}"
    assert "Traceback" not in target.log(), target.log()[-3000:]
