"""CLUSTER, READONLY, READWRITE, ASKING and the MOVED/ASK/CROSSSLOT decisions, against real Redis replies.

Standalone: a kvstore node and a plain redis-server must answer the same bytes.
Cluster mode: two redis-server processes with --cluster-enabled are joined and
given slots; a ClusterState holding the same topology (same node ids and
addresses) must produce the same CLUSTER replies, modulo what only gossip
knows (ping times, per-node config epochs, bus ports, message counters).
"""
from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import hiredis
import pytest

from kvstore.cluster.node import ClusterState
from kvstore.cluster.routing import redirect
from kvstore.cluster.slots import SLOTS, SlotMap, keyslot
from kvstore.commands.families import build_table
from kvstore.commands.table import CommandError
from kvstore.net.client_state import RedirectFlags
from kvstore.net.protocol import writer

COMMANDS = build_table()

A, B = "a" * 40, "b" * 40


def raw(port: int, *commands: bytes, resp3: bool = False) -> list[bytes]:
    """Each command's reply bytes (one reply per command), read with a RESP parser."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        replies = []
        for cmd in ([b"HELLO 3"] if resp3 else []) + list(commands):
            s.sendall(cmd + b"\r\n")
            replies.append(_one_reply(s))
        return replies[1:] if resp3 else replies


def _one_reply(s: socket.socket) -> bytes:
    reader, data = hiredis.Reader(), b""
    while True:
        chunk = s.recv(65536)
        assert chunk, "connection closed"
        data += chunk
        reader.feed(chunk)
        if reader.gets() is not False:
            return data


STANDALONE = [b"CLUSTER INFO", b"CLUSTER SLOTS", b"CLUSTER SHARDS", b"CLUSTER NODES", b"CLUSTER MYID",
              b"CLUSTER KEYSLOT foo", b"CLUSTER ADDSLOTS 1", b"CLUSTER SETSLOT 1 STABLE", b"CLUSTER HELP",
              b"CLUSTER FOO", b"CLUSTER", b"CLUSTER KEYSLOT", b"READONLY", b"READWRITE", b"ASKING", b"READONLY x"]


def test_standalone_node_answers_as_redis_without_cluster_support(server, redis_server):
    assert raw(server.port, *STANDALONE) == raw(redis_server.port, *STANDALONE)


# ------------------------------------------------------------------ cluster mode, against Redis Cluster


def cluster_ok(port: int) -> bool:
    return (b"cluster_state:ok" in raw(port, b"CLUSTER INFO")[0]
            and raw(port, b"CLUSTER NODES")[0].count(b"connected") == 2)


@pytest.fixture(scope="module")
def redis_cluster(redis_module_factory):
    """Two Redis Cluster nodes: the first owns 0-5000 and is moving slot 100 to the second, which owns the rest.

    Tests only read from it, so one serves the whole module.
    """
    first, _ = redis_module_factory.cluster_node()
    second, second_bus = redis_module_factory.cluster_node()
    ids = [raw(d.port, b"CLUSTER MYID")[0].split(b"\r\n")[1].decode() for d in (first, second)]
    raw(first.port, b"CLUSTER MEET 127.0.0.1 %d %d" % (second.port, second_bus))
    raw(first.port, b"CLUSTER ADDSLOTSRANGE 0 5000")
    raw(second.port, b"CLUSTER ADDSLOTSRANGE 5001 16383")
    deadline = time.monotonic() + 10
    while not (cluster_ok(first.port) and cluster_ok(second.port)):
        assert time.monotonic() < deadline, "the Redis cluster did not form"
        time.sleep(0.05)
    raw(first.port, f"CLUSTER SETSLOT 100 MIGRATING {ids[1]}".encode())
    raw(second.port, f"CLUSTER SETSLOT 100 IMPORTING {ids[0]}".encode())
    return first, second, ids


def mirror(first, second, ids, me: int) -> ClusterState:
    """A ClusterState with the Redis cluster's topology, seen from node ``me``."""
    nodes = {ids[0]: f"127.0.0.1:{first.port}", ids[1]: f"127.0.0.1:{second.port}"}
    owners = [ids[0]] * 5001 + [ids[1]] * (SLOTS - 5001)
    state = ClusterState(ids[me], nodes[ids[me]])
    state.apply(SlotMap.build(1, nodes, owners, {100: (ids[0], ids[1])}))
    return state


def run(cluster, *args: bytes, protocol: int = 2) -> bytes:
    """One command through the table's checks and handler, as dispatch runs it."""
    conn = SimpleNamespace(server=SimpleNamespace(cluster=cluster), enc=writer.Encoder(protocol), redirects=RedirectFlags())
    cmd = COMMANDS.lookup(args[0])
    try:
        if not cmd.arity_ok(len(args)):
            raise CommandError(f"wrong number of arguments for '{cmd.name}' command")
        if cmd.subcommands and len(args) > 1:
            cmd.check_subcommand(list(args))
        return cmd.handler(conn, list(args))
    except CommandError as e:
        return writer.error(str(e), e.code)


def parsed(reply: bytes):
    reader = hiredis.Reader()
    reader.feed(reply)
    return reader.gets()


def test_cluster_slots_is_byte_for_byte_redis(redis_cluster):
    first, second, ids = redis_cluster
    state = mirror(first, second, ids, 0)
    assert run(state, b"CLUSTER", b"SLOTS") == raw(first.port, b"CLUSTER SLOTS")[0]
    assert run(state, b"CLUSTER", b"SLOTS", protocol=3) == raw(first.port, b"CLUSTER SLOTS", resp3=True)[0]


def test_cluster_shards_has_redis_fields_and_values(redis_cluster):
    first, second, ids = redis_cluster
    state = mirror(first, second, ids, 0)
    for protocol in (2, 3):
        ours = run(state, b"CLUSTER", b"SHARDS", protocol=protocol)
        theirs = raw(first.port, b"CLUSTER SHARDS", resp3=protocol == 3)[0]
        assert sorted(map(repr, parsed(ours))) == sorted(map(repr, parsed(theirs)))
        assert sorted(ours.split(b"\r\n")) == sorted(theirs.split(b"\r\n"))     # same framing, any order


def normalised_nodes(text: bytes) -> list[list[bytes]]:
    """CLUSTER NODES lines without what only gossip knows: bus port, pong time, config epoch."""
    rows = []
    for line in text.split(b"\n")[:-1]:
        fields = line.split(b" ")
        fields[1] = fields[1].split(b"@")[0]
        fields[5] = fields[6] = b"*"
        rows.append(fields)
    return sorted(rows)


@pytest.mark.parametrize("me", [0, 1])
def test_cluster_nodes_lines_are_redis_lines(redis_cluster, me):
    first, second, ids = redis_cluster
    port = (first, second)[me].port
    ours = run(mirror(first, second, ids, me), b"CLUSTER", b"NODES")
    theirs = raw(port, b"CLUSTER NODES")[0]
    ours_text, theirs_text = parsed(ours), parsed(theirs)
    assert ours_text.endswith(b"\n") and ours_text.count(b"\n") == 2
    assert normalised_nodes(ours_text) == normalised_nodes(theirs_text)
    assert b"@0 " in ours_text
    ours3 = run(mirror(first, second, ids, me), b"CLUSTER", b"NODES", protocol=3)
    assert ours3.startswith(b"=") and b"txt:" in ours3


def test_cluster_info_fields_are_redis_fields(redis_cluster):
    first, second, ids = redis_cluster
    ours = parsed(run(mirror(first, second, ids, 0), b"CLUSTER", b"INFO")).decode()
    theirs = parsed(raw(first.port, b"CLUSTER INFO")[0]).decode()
    assert ours.endswith("\r\n") and theirs.endswith("\r\n")
    ours_fields = dict(line.split(":") for line in ours.split("\r\n")[:-1])
    theirs_fields = dict(line.split(":") for line in theirs.split("\r\n")[:-1])
    assert [k for k in theirs_fields if k in ours_fields] == list(ours_fields)      # same names, same order
    for name in ("cluster_state", "cluster_slots_assigned", "cluster_slots_ok", "cluster_slots_pfail",
                 "cluster_slots_fail", "cluster_known_nodes", "cluster_size"):
        assert ours_fields[name] == theirs_fields[name], name


@pytest.mark.parametrize("args", [(b"CLUSTER", b"MYID"), (b"CLUSTER", b"KEYSLOT", b"{user}x"),
                                  (b"CLUSTER", b"KEYSLOT"), (b"CLUSTER", b"FOO"),
                                  (b"CLUSTER", b"REPLICAS", b"nosuchnode"), (b"CLUSTER", b"MYID", b"x"),
                                  (b"READONLY",), (b"READWRITE",), (b"ASKING",)])
def test_small_replies_match_redis(redis_cluster, args):
    first, second, ids = redis_cluster
    assert run(mirror(first, second, ids, 0), *args) == raw(first.port, b" ".join(args))[0]


def test_replicas_of_a_known_node_is_empty(redis_cluster):
    first, second, ids = redis_cluster
    args = (b"CLUSTER", b"REPLICAS", ids[1].encode())
    assert run(mirror(first, second, ids, 0), *args) == raw(first.port, b" ".join(args))[0] == b"*0\r\n"


@pytest.mark.parametrize("sub", [b"ADDSLOTS 1", b"ADDSLOTSRANGE 1 2", b"DELSLOTS 1", b"SETSLOT 1 STABLE",
                                 b"MEET 127.0.0.1 7000", b"FORGET x", b"RESET", b"FAILOVER", b"BUMPEPOCH",
                                 b"REPLICATE x", b"FLUSHSLOTS", b"SAVECONFIG", b"SET-CONFIG-EPOCH 1"])
def test_topology_changes_are_refused(sub):
    reply = run(ClusterState(A, "127.0.0.1:7001"), b"CLUSTER", *sub.split())
    assert reply.startswith(b"-ERR CLUSTER " + sub.split()[0] + b" is not supported: the topology is kept in etcd")


def test_connection_flags_are_set_on_the_connection():
    conn = SimpleNamespace(server=SimpleNamespace(cluster=ClusterState(A, "127.0.0.1:7001")), enc=writer.Encoder(2),
                           redirects=RedirectFlags())
    for name, attr, value in [(b"READONLY", "readonly", True), (b"READWRITE", "readonly", False),
                              (b"ASKING", "asking", True)]:
        assert COMMANDS.lookup(name).handler(conn, [name]) == writer.OK
        assert getattr(conn.redirects, attr) is value


def test_cluster_state_fail_and_counts_without_full_coverage():
    state = ClusterState(A, "127.0.0.1:7001")
    info = parsed(run(state, b"CLUSTER", b"INFO")).decode()
    assert "cluster_state:fail\r\n" in info and "cluster_slots_assigned:0\r\n" in info
    assert "cluster_known_nodes:1\r\n" in info and "cluster_size:0\r\n" in info
    nodes = parsed(run(state, b"CLUSTER", b"NODES"))
    assert nodes == f"{A} 127.0.0.1:7001@0 myself,master - 0 0 0 connected\n".encode()
    assert run(state, b"CLUSTER", b"SLOTS") == b"*0\r\n"
    assert run(state, b"CLUSTER", b"LINKS") == b"*0\r\n"          # no cluster bus, no links


# ------------------------------------------------------------------ routing, against Redis Cluster's errors


def routed(state: ClusterState, keys: list[bytes], asking: bool = False, present=()) -> bytes | None:
    return redirect(state, keys, asking, lambda key: key in present)


def key_in(slot_range: range, prefix: bytes = b"k") -> bytes:
    return next(prefix + b"%d" % i for i in range(100000) if keyslot(prefix + b"%d" % i) in slot_range)


def test_redirections_match_redis_byte_for_byte(redis_cluster):
    first, second, ids = redis_cluster
    mine, theirs = key_in(range(0, 5001)), key_in(range(5001, SLOTS))
    source, target = mirror(first, second, ids, 0), mirror(first, second, ids, 1)
    moving = b"{%s}" % next(b"%d" % i for i in range(100000) if keyslot(b"%d" % i) == 100)
    cases = [
        (source, first, [b"GET", theirs], [theirs], False),                     # MOVED
        (source, first, [b"MGET", mine, theirs], [mine, theirs], False),        # CROSSSLOT
        (source, first, [b"GET", moving], [moving], False),                     # ASK: the key is not here
        (target, second, [b"GET", moving], [moving], False),                    # MOVED back to the source
        (source, first, [b"GET", mine], [mine], False),                         # served here
    ]
    for state, daemon, command, keys, asking in cases:
        theirs_reply = raw(daemon.port, b" ".join(command))[0]
        ours = routed(state, keys, asking)
        if theirs_reply.startswith(b"-"):
            assert ours == theirs_reply, command
        else:
            assert ours is None, command
    asked = raw(second.port, b"ASKING", b"GET " + moving)
    assert asked[1] == b"$-1\r\n" and routed(target, [moving], asking=True) is None
    tryagain = raw(second.port, b"ASKING", b"MGET " + moving + b" " + moving + b"x")
    assert routed(target, [moving, moving + b"x"], asking=True) == tryagain[1]


def test_unserved_slots_and_an_incomplete_map():
    nodes = {A: "127.0.0.1:7001"}
    state = ClusterState(A, nodes[A])
    state.apply(SlotMap.build(1, nodes, [A] * 100 + [None] * (SLOTS - 100)))
    served, unserved = key_in(range(0, 100)), key_in(range(100, SLOTS))
    assert routed(state, [unserved]) == b"-CLUSTERDOWN Hash slot not served\r\n"
    assert routed(state, [served]) == b"-CLUSTERDOWN The cluster is down\r\n"
    assert routed(state, []) is None


def test_a_slot_at_rest_here_is_served_whatever_the_flags(redis_cluster):
    """`ClusterState.serves_at_rest` lets plain GETs and SETs skip routing: it holds only
    where `redirect` would answer None, with or without ASKING."""
    first, second, ids = redis_cluster
    moving = b"{%s}" % next(b"%d" % i for i in range(100000) if keyslot(b"%d" % i) == 100)
    keys = [key_in(range(0, 5001)), key_in(range(5001, SLOTS)), moving]
    for me in (0, 1):
        state = mirror(first, second, ids, me)
        for key in keys:
            at_rest = state.serves_at_rest(key)
            assert at_rest == (keyslot(key) != 100 and state.is_mine(keyslot(key)))
            if at_rest:
                assert routed(state, [key], False) is None and routed(state, [key], True) is None
    nodes = {A: "127.0.0.1:7001"}
    partial = ClusterState(A, nodes[A])
    partial.apply(SlotMap.build(1, nodes, [A] * 100 + [None] * (SLOTS - 100)))
    assert not partial.serves_at_rest(key_in(range(0, 100)))        # CLUSTERDOWN: not every slot served
