"""Client buffer limits on a real `kvstore serve` process, as Redis enforces them.

client-output-buffer-limit: a client that pipelines reads and does not read
the replies is closed once the queued replies pass the hard limit, or stay
past the soft limit for its seconds; a client that reads its replies is never
closed. client-query-buffer-limit: a request in progress (a huge bulk, or a
multibulk with very many arguments) past the limit closes that client. Both
are counted in INFO, under Redis's names; the setting reads and refuses
values as Redis's CONFIG SET does (checked against a redis-server).
"""
from __future__ import annotations

import socket

import pytest

from conftest import eventually
from test_redis_compat import RespConnection, assert_same_replies, encode_command, run_steps

VALUE = b"v" * (256 * 1024)


def info_stat(daemon, name: str) -> int:
    with RespConnection(daemon) as conn:
        text = conn.call("INFO", "stats").decode()
    return int(text.split(f"{name}:")[1].split("\r\n")[0])


@pytest.fixture(scope="module")
def limited(kvstore_module_factory):
    daemon = kvstore_module_factory("--client-output-buffer-limit", "normal 1mb 0 0",
                                    "--client-query-buffer-limit", "1mb")
    with RespConnection(daemon) as conn:
        conn.call("SET", "big", VALUE)
    return daemon


def slow_reader(daemon) -> socket.socket:
    """A client with a tiny receive window, so replies it does not read pile up on the node."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((daemon.host, daemon.port))
    return sock


def is_closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Read and drop everything until EOF or a reset (True), or ``timeout`` of silence (False)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
    return True


def test_a_client_that_does_not_read_is_closed_at_the_hard_limit(limited):
    before = info_stat(limited, "client_output_buffer_limit_disconnections")
    with slow_reader(limited) as sock:
        sock.sendall(encode_command("GET", "big") * 64)     # 16 MiB of replies
        assert eventually(lambda: info_stat(limited, "client_output_buffer_limit_disconnections") == before + 1)
        assert is_closed_by_peer(sock)
    with RespConnection(limited) as conn:
        assert conn.call("PING") == b"+PONG\r\n"


def test_a_client_that_reads_is_never_closed(limited):
    before = info_stat(limited, "client_output_buffer_limit_disconnections")
    with RespConnection(limited) as conn:
        for _ in range(3):
            conn.send(encode_command("GET", "big") * 3)     # under the limit per batch
            for _ in range(3):
                assert conn.read_reply().endswith(VALUE + b"\r\n")
    assert info_stat(limited, "client_output_buffer_limit_disconnections") == before


def test_soft_limit_closes_after_its_seconds(kvstore_factory):
    daemon = kvstore_factory("--client-output-buffer-limit", "normal 0 512kb 1")
    with RespConnection(daemon) as conn:
        conn.call("SET", "big", VALUE)
    with slow_reader(daemon) as sock:
        sock.sendall(encode_command("GET", "big") * 16)
        assert eventually(lambda: info_stat(daemon, "client_output_buffer_limit_disconnections") == 1)
        assert is_closed_by_peer(sock)


def test_a_huge_bulk_in_progress_closes_the_client(limited):
    before = info_stat(limited, "client_query_buffer_limit_disconnections")
    with socket.create_connection((limited.host, limited.port)) as sock:
        sock.sendall(b"*2\r\n$4\r\nECHO\r\n$3000000\r\n" + b"x" * 1_500_000)
        assert is_closed_by_peer(sock)
    assert info_stat(limited, "client_query_buffer_limit_disconnections") == before + 1


def test_a_multibulk_of_many_small_arguments_closes_the_client(limited):
    before = info_stat(limited, "client_query_buffer_limit_disconnections")
    with socket.create_connection((limited.host, limited.port)) as sock:
        try:
            sock.sendall(b"*1000000\r\n$3\r\nDEL\r\n" + b"$4\r\nkey!\r\n" * 40_000)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert is_closed_by_peer(sock)
    assert info_stat(limited, "client_query_buffer_limit_disconnections") == before + 1


def test_values_under_the_query_limit_are_stored(limited):
    with RespConnection(limited) as conn:
        assert conn.call("SET", "k", b"z" * 900_000) == b"+OK\r\n"
        assert conn.call("STRLEN", "k") == b":900000\r\n"


CONFIG_STEPS = [
    ("CONFIG", "GET", "client-output-buffer-limit"), ("CONFIG", "GET", "client-query-buffer-limit"),
    ("CONFIG", "SET", "client-output-buffer-limit", "normal 1kb 2kb 10 pubsub 0 0 0"),
    ("CONFIG", "GET", "client-output-buffer-limit"),
    ("CONFIG", "SET", "client-output-buffer-limit", "normal 1mb"),
    ("CONFIG", "SET", "client-output-buffer-limit", "bogus 1 2 3"),
    ("CONFIG", "SET", "client-output-buffer-limit", "normal 1 2 x"),
    ("CONFIG", "SET", "client-query-buffer-limit", "1000"), ("CONFIG", "SET", "client-query-buffer-limit", "2mb"),
    ("CONFIG", "GET", "client-query-buffer-limit"),
    ("CONFIG", "SET", "client-output-buffer-limit", "normal 0 0 0 pubsub 33554432 8388608 60"),
    ("CONFIG", "SET", "client-query-buffer-limit", "1gb"),
]


def test_limit_settings_read_and_refuse_as_redis(redis_server, server):
    assert_same_replies(run_steps(redis_server, CONFIG_STEPS), run_steps(server, CONFIG_STEPS))
