"""kvstore/net/connection.py in process: one `Connection` on a loopback TCP pair, its
socket events delivered by hand, so a test can count the loop turns a request
takes and look at what a reply holds while the client does not read.

- A SET whose value is already in the socket behind its header is run in the
  turn that read the header (the value is received straight into its extent).
- Big SETs take the plain path: committed where they were received, nothing
  left reserved after many overwrites, nothing reserved after a client dies
  in the middle of a value.
- GET copies values into the reply buffer while a few MiB are queued, and
  sends the rest from the arena under holds given back once sent.
"""
from __future__ import annotations

import os
import socket

import pytest

from kvstore.net import connection
from kvstore.admin.config import Config
from kvstore.net.connection import COPIED_REPLIES, Connection
from kvstore.net.server import Server
from loadtest.wire_steps import HandDrivenLoop

VALUE_SIZE = 64 * 1024


class Pair:
    """A connected client socket and the node's `Connection` for its other end."""

    def __init__(self, server: Server):
        with socket.create_server(("127.0.0.1", 0)) as listener:
            self.client = socket.create_connection(listener.getsockname())
            accepted, _ = listener.accept()
        accepted.setblocking(False)
        self.server = server
        self.conn = Connection(server, accepted, 1)
        self.client.settimeout(10)

    def set_command(self, key: bytes, value: bytes) -> bytes:
        return b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(key), key, len(value), value)

    def turns_until(self, reply: bytes, limit: int = 50) -> int:
        """Deliver readable events until ``reply`` came back whole: how many it took."""
        got = b""
        for turn in range(1, limit + 1):
            self.conn.on_readable()
            self.client.setblocking(False)
            try:
                got += self.client.recv(1 << 20)
            except BlockingIOError:
                pass
            self.client.setblocking(True)
            if got == reply:
                return turn
        raise AssertionError(f"no {reply!r} after {limit} turns: {got[:40]!r}")

    def close(self) -> None:
        self.client.close()
        self.conn.close()


@pytest.fixture
def server():
    node = Server(Config(dram_size=64 << 20, port=0))
    node.loop = HandDrivenLoop()
    yield node
    node.engine.close()


@pytest.fixture
def pair(server):
    p = Pair(server)
    yield p
    p.close()


def value_sent_whole(pair: Pair, key: bytes, value: bytes) -> None:
    """Write the SET at once and wait until the node's socket holds all of it."""
    payload = pair.set_command(key, value)
    pair.client.sendall(payload)
    sock = pair.conn.sock
    while len(sock.recv(len(payload), socket.MSG_PEEK)) < len(payload):
        pass


def test_a_big_set_already_in_the_socket_runs_in_one_turn(pair):
    value = os.urandom(VALUE_SIZE)
    value_sent_whole(pair, b"k", value)
    assert pair.turns_until(b"+OK\r\n") == 1
    engine = pair.server.engine
    assert engine.value(engine.lookup(b"k")) == value


def test_a_value_that_comes_later_is_read_when_it_comes(pair):
    value = os.urandom(VALUE_SIZE)
    payload = pair.set_command(b"k", value)
    head = payload.index(b"$%d\r\n" % VALUE_SIZE) + len(b"$%d\r\n" % VALUE_SIZE)
    pair.client.sendall(payload[:head])
    pair.conn.on_readable()         # the header: the value is not there yet
    pair.client.sendall(payload[head:])
    pair.turns_until(b"+OK\r\n")
    engine = pair.server.engine
    assert engine.value(engine.lookup(b"k")) == value


def test_big_sets_take_the_plain_path_and_leave_nothing_reserved(pair, monkeypatch):
    generic = []
    monkeypatch.setattr(connection, "dispatch", lambda *args: generic.append(args))
    engine = pair.server.engine
    for _ in range(20):
        value = os.urandom(VALUE_SIZE)
        value_sent_whole(pair, b"k", value)
        pair.turns_until(b"+OK\r\n")
    assert generic == []
    assert engine.value(engine.lookup(b"k")) == value
    assert engine.allocator.requested == VALUE_SIZE      # one value, no reservation left behind


def test_a_client_that_dies_in_the_middle_of_a_value_leaves_nothing_reserved(pair):
    engine = pair.server.engine
    payload = pair.set_command(b"k", os.urandom(VALUE_SIZE))
    pair.client.sendall(payload[:len(payload) // 2])
    pair.conn.on_readable()
    assert engine.allocator.used > 0            # the half received lies in its extent
    pair.client.close()
    for _ in range(10):                         # the rest of the half, then EOF
        if pair.conn.closed:
            break
        pair.conn.on_readable()
    assert pair.conn.closed and engine.allocator.used == 0


def test_values_are_copied_while_a_few_mib_are_queued_then_sent_from_the_arena(pair):
    engine = pair.server.engine
    value = os.urandom(256 * 1024)
    engine.put(b"big", value)
    count = 3 * COPIED_REPLIES // len(value)
    get = b"*2\r\n$3\r\nGET\r\n$3\r\nbig\r\n"
    pair.client.sendall(get * count)
    pair.conn.on_readable()
    conn = pair.conn
    copied = len(conn.wbuf) + sum(len(buf) for buf, lease in conn.out if lease is None)
    held = [lease for _, lease in conn.out if lease is not None]
    assert copied <= COPIED_REPLIES + len(value)
    assert held and engine.holds.is_held(held[0][0])
    expected = (b"$%d\r\n" % len(value) + value + b"\r\n") * count
    got = bytearray()
    while len(got) < len(expected):
        got += pair.client.recv(1 << 20)
        conn.flush()
    assert got == expected
    assert not conn.out and not engine.holds.is_held(held[0][0])


def test_a_single_big_value_is_copied_and_holds_nothing(pair):
    engine = pair.server.engine
    value = os.urandom(VALUE_SIZE)
    engine.put(b"k", value)
    slot = engine.lookup(b"k")
    pair.conn.write_value(slot)
    assert not pair.conn.out and not engine.holds.is_held(engine.entries.dram_offset(slot))
    assert pair.conn.wbuf == b"$%d\r\n" % VALUE_SIZE + value + b"\r\n"
