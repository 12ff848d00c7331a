"""ACL users on the wire, against real processes: a `kvstore serve` daemon (with an
--aclfile) and, for the replies that must match byte for byte, a redis-server 7.

Covers: ACL SETUSER/GETUSER/DELUSER/LIST/USERS/WHOAMI/CAT/DRYRUN/LOAD/SAVE, AUTH
as a user, the NOPERM texts (also inside MULTI), ACL categories against
Redis's, tenant isolation on the KV-cache commands (a refusal never depends on
whether the other tenant's key exists; flushes and the fast path are refused to
a tenant), and the SDK falling back to the wire when the node refuses it the arena.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from client import KVClient
from client.errors import AuthenticationError, FastPathUnavailable, ResponseError
from conftest import free_port
from test_redis_compat import (ErrorReply, Pipelined, RespConnection, assert_same_replies, decode,
                               run_steps)

USERS = ("alice", "bob", "carol", "dave", "a b")


@pytest.fixture(scope="module")
def node(kvstore_module_factory):
    aclfile = kvstore_module_factory.tmp_path / "users.acl"
    aclfile.write_text("user default on nopass ~* &* +@all\n")
    daemon = kvstore_module_factory("--aclfile", str(aclfile))
    daemon.aclfile = aclfile
    return daemon


@pytest.fixture
def fresh_node(node):
    """The module's node with only the default user and an empty keyspace."""
    with RespConnection(node) as conn:
        conn.call("ACL", "DELUSER", *USERS)
        conn.call("ACL", "SETUSER", "default", "on", "nopass", "resetkeys", "~*", "&*", "+@all")
        conn.call("FLUSHALL")
    return node


def clean(daemon) -> None:
    with RespConnection(daemon) as conn:
        conn.call("ACL", "DELUSER", *USERS)


SETUP = [
    ("ACL", "SETUSER", "alice", "on", ">pw", "~tenantA:*", "+@all"),
    ("ACL", "SETUSER", "bob", "on", ">pw", "~tenantB:*", "%R~ro:*", "%W~wo:*", "-@all", "+get"),
    ("ACL", "SETUSER", "carol", "on", "nopass", "allkeys", "+@all", "-@dangerous"),
    ("ACL", "GETUSER", "alice"), ("ACL", "GETUSER", "bob"), ("ACL", "GETUSER", "carol"),
    ("ACL", "GETUSER", "nosuch"), ("ACL", "LIST"), ("ACL", "USERS"), ("ACL", "WHOAMI"),
]
ERRORS = [
    ("ACL", "SETUSER", "dave", "bogus"), ("ACL", "SETUSER", "dave", "+nosuch"),
    ("ACL", "SETUSER", "dave", "+@nosuch"), ("ACL", "SETUSER", "dave", "#abc"),
    ("ACL", "SETUSER", "dave", "<nopw"), ("ACL", "SETUSER", "dave", "%X~a"),
    ("ACL", "SETUSER", "dave", "allkeys", "~x"), ("ACL", "SETUSER", "a b"), ("ACL", "GETUSER", "dave"),
    ("ACL", "DELUSER", "default"), ("ACL", "CAT", "nosuch"), ("ACL", "GENPASS", "0"),
    ("ACL", "GENPASS", "x"), ("ACL", "nosuch"), ("ACL",), ("ACL", "SETUSER"), ("ACL", "GETUSER"),
    ("ACL", "DRYRUN", "nobody", "get", "x"), ("ACL", "DRYRUN", "bob", "nosuch"),
    ("ACL", "DRYRUN", "bob", "get"), ("ACL", "DRYRUN", "bob", "del", "x"),
    ("ACL", "DRYRUN", "bob", "get", "tenantB:1"), ("ACL", "DRYRUN", "bob", "get", "x"),
]
AS_BOB = [
    ("AUTH", "bob", "wrong"), ("AUTH", "nobody", "pw"), ("AUTH", "bob", "pw"), ("ACL", "WHOAMI"),
    ("GET", "x"), ("GET", "tenantB:1"), ("DEL", "x"), ("SET", "wo:1", "v"), ("GET", "ro:1"),
    ("GET", "wo:1"), ("MGET", "tenantB:1"), ("PING",), ("CONFIG", "GET", "maxmemory"),
    ("MULTI",), ("GET", "x"), ("EXEC",),
    ("AUTH", "alice", "pw"), ("ACL", "WHOAMI"), ("SET", "tenantA:1", "v"), ("GET", "tenantA:1"),
    ("GET", "tenantB:1"), ("SET", "tenantB:1", "v"), ("EXISTS", "tenantA:1", "tenantB:1"),
    ("MSET", "tenantA:2", "v", "tenantB:2", "v"), ("GETRANGE", "tenantB:1", "0", "-1"),
    ("AUTH", "carol", "anything"), ("GET", "tenantB:1"), ("FLUSHALL",), ("KEYS", "*"), ("INFO", "x"),
    ("ACL", "LIST"),
    ("AUTH", "default", "anything"), ("ACL", "DELUSER", "alice", "nosuch", "alice"), ("ACL", "USERS"),
    Pipelined((("AUTH", "alice", "pw"), ("PING",))),
]


def test_acl_replies_match_redis(redis_server, fresh_node):
    steps = SETUP + ERRORS + AS_BOB
    expected = run_steps(redis_server, steps)
    try:
        assert_same_replies(expected, run_steps(fresh_node, steps))
    finally:
        clean(fresh_node)


def test_deleted_users_connections_are_closed(fresh_node):
    with RespConnection(fresh_node) as admin, RespConnection(fresh_node) as alice:
        admin.call("ACL", "SETUSER", "alice", "on", ">pw", "~a:*", "+@all")
        assert alice.call("AUTH", "alice", "pw") == b"+OK\r\n"
        assert alice.call("ACL", "WHOAMI") == b"$5\r\nalice\r\n"
        assert b"user=alice" in decode(admin.call("CLIENT", "LIST"))
        assert admin.call("ACL", "DELUSER", "alice") == b":1\r\n"
        assert alice.closed_by_peer()


def test_rule_changes_apply_to_logged_in_clients(fresh_node):
    with RespConnection(fresh_node) as admin, RespConnection(fresh_node) as alice:
        admin.call("ACL", "SETUSER", "alice", "on", ">pw", "~a:*", "+@all")
        alice.call("AUTH", "alice", "pw")
        assert alice.call("SET", "a:1", "v") == b"+OK\r\n"
        admin.call("ACL", "SETUSER", "alice", "-set")
        assert alice.call("SET", "a:1", "v") == b"-NOPERM this user has no permissions to run the 'set' command\r\n"
        assert alice.call("GET", "a:1") == b"$1\r\nv\r\n"


def test_names_passwords_and_patterns_are_binary_safe(fresh_node):
    name, password, prefix = b"t\xff\xfe", b"p\xff\x00\r\n", b"\xffbin:"
    with RespConnection(fresh_node) as admin, RespConnection(fresh_node) as user:
        assert admin.call("ACL", "SETUSER", name, "on", b">" + password, b"~" + prefix + b"*", "+@all") == \
            b"+OK\r\n"
        fields = dict(zip(*[iter(decode(admin.call("ACL", "GETUSER", name)))] * 2))
        assert fields[b"keys"] == b"~" + prefix + b"*"
        assert user.call("AUTH", name, password) == b"+OK\r\n"
        assert decode(user.call("ACL", "WHOAMI")) == name
        assert "user=t\ufffd\ufffd " in decode(admin.call("CLIENT", "LIST")).decode()
        assert user.call("SET", prefix + b"1", "v") == b"+OK\r\n"
        assert user.call("SET", b"\xfebin:1", "v") == NOPERM_KEY
        assert admin.call("ACL", "DELUSER", name) == b":1\r\n"


def test_genpass_and_cat(fresh_node):
    with RespConnection(fresh_node) as conn:
        password = decode(conn.call("ACL", "GENPASS"))
        assert len(password) == 64 and int(password, 16) >= 0
        assert len(decode(conn.call("ACL", "GENPASS", "5"))) == 2
        assert b"kvcache" in decode(conn.call("ACL", "CAT"))
        kv_commands = decode(conn.call("ACL", "CAT", "kvcache"))
        assert b"kv.match" in kv_commands and b"kv.arena" in kv_commands and b"get" not in kv_commands


def test_categories_match_redis(redis_server, node):
    """Every category holds the same commands (subcommands included) on both servers,
    for the commands both have."""
    with RespConnection(redis_server) as redis, RespConnection(node) as ours:
        redis_categories = set(decode(redis.call("ACL", "CAT")))
        ours_all = {c: set(decode(ours.call("ACL", "CAT", c))) for c in decode(ours.call("ACL", "CAT"))}
        both = set().union(*ours_all.values()) & set().union(
            *(set(decode(redis.call("ACL", "CAT", c))) for c in redis_categories))
        assert redis_categories == set(ours_all) - {b"kvcache"}
        differences = {}
        for category in redis_categories:
            theirs = set(decode(redis.call("ACL", "CAT", category))) & both
            if theirs != ours_all[category] & both:
                differences[category] = (sorted(theirs ^ (ours_all[category] & both)))
        assert not differences


def test_command_info_lists_acl_categories(node):
    with RespConnection(node) as conn:
        [entry] = decode(conn.call("COMMAND", "INFO", "kv.match"))
        assert entry[6] == [b"@read", b"@fast", b"@kvcache"]
        [publish] = decode(conn.call("COMMAND", "INFO", "kv.publish"))
        assert publish[3:6] == [2, 2, 1]


# ------------------------------------------------------------------ tenants

NOPERM_KEY = b"-NOPERM this user has no permissions to access one of the keys used as arguments\r\n"


def test_a_tenant_cannot_reach_another_tenants_blocks(fresh_node):
    """bob (~tenantB:*, every command) against alice's blocks: every request that names
    one is refused the same way whether the block exists or not."""
    with RespConnection(fresh_node) as admin, RespConnection(fresh_node) as bob:
        for name, prefix in (("alice", "tenantA"), ("bob", "tenantB")):
            admin.call("ACL", "SETUSER", name, "on", ">pw", f"~{prefix}:*", "+@all")
        admin.call("KV.PUT", "tenantA:1", "block-one")
        admin.call("KV.PUT", "tenantA:2", "block-two", "PARENT", "tenantA:1")
        assert bob.call("AUTH", "bob", "pw") == b"+OK\r\n"
        for key in ("tenantA:1", "tenantA:missing"):
            for request in (("KV.MATCH", "tenantB:0", key), ("KV.MATCH", key), ("KV.LOCATE", key),
                            ("KV.PIN", key), ("KV.UNPIN", key), ("GET", key), ("EXISTS", key), ("TYPE", key),
                            ("KV.GETLAYERS", key, "0", "-1"), ("KV.PUT", "tenantB:1", "v", "PARENT", key),
                            ("MEMORY", "USAGE", key), ("DEL", key), ("EXPIRE", key, "1")):
                assert bob.call(*request) == NOPERM_KEY, request
        for request in (("KEYS", "*"), ("SCAN", "0"), ("FLUSHALL",), ("FLUSHDB",), ("KV.ARENA",),
                        ("KV.GPUARENA",), ("KV.LEASE", "t", "1000", "tenantB:1"), ("KV.RELEASE", "1"),
                        ("KV.RESERVE", "t", "1000", "16"), ("KV.PUBLISH", "1", "tenantB:1"),
                        ("KV.UNRESERVE", "1")):
            assert bob.call(*request) == NOPERM_KEY, request
        assert bob.call("KV.PUT", "tenantB:1", "mine") == b":1\r\n"
        assert bob.call("KV.MATCH", "tenantB:1", "tenantB:2") == b":1\r\n"
        assert admin.call("KV.MATCH", "tenantA:1", "tenantA:2") == b":2\r\n"    # nothing was flushed
        assert decode(admin.call("ACL", "DRYRUN", "bob", "kv.match", "tenantA:1")) == \
            b"This user has no permissions to access the 'tenantA:1' key"


def test_sdk_falls_back_to_the_wire_when_the_arena_is_refused(server):
    """A restricted user's client in fast_path="auto" mode stores and reads over the
    socket; in "required" mode it is told the fast path is unavailable."""
    with RespConnection(server) as admin:
        assert admin.call("ACL", "SETUSER", "default", "resetkeys", "~tenantA:*") == b"+OK\r\n"
    client = KVClient(unix_socket=server.unix_socket, fast_path="auto")
    try:
        assert client.put(b"tenantA:block", b"x" * 100_000)
        assert bytes(client.get(b"tenantA:block")) == b"x" * 100_000
        assert client.match_prefix([b"tenantA:block", b"tenantA:next"]) == 1
        assert "NOPERM" in (client.fast_path.unavailable or "")
        assert client.fast_path.stats.reads == 0 and client.fast_path.stats.writes == 0
    finally:
        client.close()
    strict = KVClient(unix_socket=server.unix_socket, fast_path="required")
    try:
        with pytest.raises(FastPathUnavailable, match="NOPERM"):
            strict.get(b"tenantA:block")
    finally:
        strict.close()


def test_sdk_logs_in_as_a_tenant(fresh_node):
    """KVClient(username=...) acts as that ACL user: its tenant's keys work (over the
    wire: the arena is refused to it), another tenant's are NOPERM."""
    with RespConnection(fresh_node) as admin:
        admin.call("ACL", "SETUSER", "alice", "on", ">pw", "~tenantA:*", "+@all")
        admin.call("SET", "tenantB:secret", "s")
    with KVClient(unix_socket=fresh_node.unix_socket, username="alice", password="pw") as alice:
        assert alice.execute("ACL", "WHOAMI") == b"alice"
        assert alice.put(b"tenantA:1", b"a" * 70_000) and bytes(alice.get(b"tenantA:1")) == b"a" * 70_000
        with pytest.raises(ResponseError, match="NOPERM"):
            alice.get(b"tenantB:secret")
        assert "NOPERM" in (alice.fast_path.unavailable or "")
    with pytest.raises(AuthenticationError, match="WRONGPASS"):
        KVClient(unix_socket=fresh_node.unix_socket, username="alice", password="wrong").ping()
    clean(fresh_node)


# ------------------------------------------------------------------ the ACL file

def test_acl_save_and_load(fresh_node):
    aclfile = fresh_node.aclfile
    with RespConnection(fresh_node) as admin, RespConnection(fresh_node) as alice:
        admin.call("ACL", "SETUSER", "alice", "on", ">pw", "~a:*", "+@kvcache")
        assert admin.call("ACL", "SAVE") == b"+OK\r\n"
        saved = aclfile.read_text().splitlines()
        assert saved == [line.decode() for line in decode(admin.call("ACL", "LIST"))]
        assert alice.call("AUTH", "alice", "pw") == b"+OK\r\n"
        aclfile.write_text("user default on nopass ~* &* +@all\nuser bob on >pw ~b:* +get bogus\n")
        refused = decode(admin.call("ACL", "LOAD"))
        assert isinstance(refused, ErrorReply) and b":2: Syntax error. WARNING: ACL errors detected" in refused.text
        assert decode(admin.call("ACL", "USERS")) == [b"alice", b"default"]
        aclfile.write_text("user default on nopass ~* &* +@all\nuser bob on >pw ~b:* +get\n")
        assert admin.call("ACL", "LOAD") == b"+OK\r\n"
        assert decode(admin.call("ACL", "USERS")) == [b"bob", b"default"]
        assert alice.closed_by_peer()
    clean(fresh_node)


def test_no_acl_file_and_a_bad_one_at_start(tmp_path, kvstore_factory):
    daemon = kvstore_factory()
    with RespConnection(daemon) as conn:
        assert conn.call("ACL", "SAVE").startswith(b"-ERR This Redis instance is not configured to use an ACL")
    daemon.stop()
    bad = tmp_path / "bad.acl"
    bad.write_text("user alice on +nosuch\n")
    done = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--port", str(free_port()),
                           "--dram-size", "8mb", "--aclfile", str(bad)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "Could not start" in done.stderr and "Error in applying operation '+nosuch'" in done.stderr


def test_requirepass_set_live_is_the_default_users_password(fresh_node):
    with RespConnection(fresh_node) as admin, RespConnection(fresh_node) as later:
        assert admin.call("CONFIG", "SET", "requirepass", "sekrit") == b"+OK\r\n"
        try:
            with RespConnection(fresh_node) as fresh:
                assert fresh.call("GET", "k").startswith(b"-NOAUTH")
                assert fresh.call("AUTH", "default", "sekrit") == b"+OK\r\n"
            assert later.call("PING") == b"+PONG\r\n"       # already logged in as default
        finally:
            assert admin.call("CONFIG", "SET", "requirepass", "") == b"+OK\r\n"
    assert os.path.exists(fresh_node.aclfile)
