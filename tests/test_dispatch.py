"""kvstore/commands/dispatch.py against a real daemon: transactions whose commands must wait,
and the order of replies around them."""
from __future__ import annotations

import os
import socket

import redis

from test_plain_path import command, read_until


def _read_until(sock: socket.socket, tail: bytes, timeout: float = 20.0) -> bytes:
    return read_until(sock, lambda data: data.endswith(tail), timeout)


def test_exec_keeps_reply_order_when_queued_writes_wait_for_room(kvstore_factory, tmp_path):
    """DRAM full of values that exist only there: each queued SET waits for demotion.
    The transaction's replies stay in order and nothing after EXEC overtakes them."""
    daemon = kvstore_factory("--dram-size", "8mb", "--ssd-dir", str(tmp_path / "ssd"),
                           "--ssd-size", "256mb")
    big = os.urandom(1 << 20)
    payload = b"".join(command("SET", f"fill{i}", big) for i in range(12))
    payload += command("SET", "small", "x") + command("MULTI")
    payload += command("SET", "t1", big[:900_000]) + command("SET", "t2", big[:800_000])
    payload += command("GET", "small") + command("EXEC") + command("PING")
    with socket.create_connection((daemon.host, daemon.port)) as sock:
        sock.sendall(payload)
        replies = _read_until(sock, b"+PONG\r\n")
    assert replies == b"+OK\r\n" * 14 + b"+QUEUED\r\n" * 3 + b"*3\r\n+OK\r\n+OK\r\n$1\r\nx\r\n+PONG\r\n"
    client = redis.Redis(daemon.host, daemon.port)
    assert client.get("t1") == big[:900_000] and client.get("t2") == big[:800_000]


def test_client_list_counts_queued_commands(server):
    client = redis.Redis(server.host, server.port)
    assert "multi=-1" in client.execute_command("CLIENT", "LIST").decode()
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(command("MULTI") + command("SET", "a", "1") + command("GET", "a"))
        assert _read_until(sock, b"+QUEUED\r\n+QUEUED\r\n") == b"+OK\r\n+QUEUED\r\n+QUEUED\r\n"
        lines = client.execute_command("CLIENT", "LIST").decode().splitlines()
        assert sum("multi=2 " in line for line in lines) == 1
