"""TLS on a real `kvstore serve` process: --tls-port beside the plain port, with a
throwaway CA made by `openssl` (loadtest/certs.py).

redis-py with ssl=True stores and reads values of every size (1 MiB values
cross many TLS records each way), pipelines, and is refused without a client
certificate when --tls-auth-clients is yes; the SDK's ``tls=`` option does
the same work over TLS (with the fast path off, so every byte crosses TLS).
A peer that speaks plain RESP to the TLS port, or stops in the middle of a
handshake, costs only its own connection.
"""
from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import sys

import pytest
import redis

from client import AsyncKVClient, KVClient
from client.errors import ConnectionError, TimeoutError
from conftest import free_port
from loadtest.certs import make_certificates
from test_redis_compat import RespConnection


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_node(kvstore_module_factory, certs):
    port = free_port()
    daemon = kvstore_module_factory("--tls-port", str(port), *certs.server_flags("yes"))
    daemon.tls_port = port
    return daemon


def tls_client(node, certs, **extra) -> redis.Redis:
    options = dict(ssl=True, ssl_ca_certs=certs.ca, ssl_certfile=certs.client_cert, ssl_keyfile=certs.client_key)
    options.update(extra)
    return redis.Redis(host="127.0.0.1", port=node.tls_port, socket_timeout=10, **options)


@pytest.mark.parametrize("size", [0, 1, 16_383, 16_384, 70_000, 1 << 20, 5_000_001])
def test_values_round_trip_over_tls(tls_node, certs, size):
    value = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    with tls_client(tls_node, certs) as client:
        assert client.set(f"k{size}", value)
        assert client.get(f"k{size}") == value
        assert client.strlen(f"k{size}") == size


def test_pipelines_over_tls(tls_node, certs):
    with tls_client(tls_node, certs) as client:
        pipe = client.pipeline(transaction=False)
        for i in range(2000):
            pipe.set(f"p{i}", b"v" * (i % 700))
        assert all(pipe.execute())
        values = client.mget([f"p{i}" for i in range(2000)])
        assert values == [b"v" * (i % 700) for i in range(2000)]
        big = [bytes([i]) * 300_000 for i in range(8)]
        pipe = client.pipeline(transaction=True)
        for i, value in enumerate(big):
            pipe.set(f"b{i}", value)
            pipe.get(f"b{i}")
        assert pipe.execute()[1::2] == big


def test_the_plain_port_still_serves(tls_node):
    with RespConnection(tls_node) as conn:
        assert conn.call("PING") == b"+PONG\r\n"


def refused(node, context: ssl.SSLContext) -> bool:
    """Whether the node turns this client away: in the handshake, or (TLS 1.3: the
    client's certificate is checked after the client finished) at its first request."""
    try:
        with socket.create_connection(("127.0.0.1", node.tls_port), timeout=10) as raw:
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(100) != b"+PONG\r\n"
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        return True


def context(certs, *, trust: str | None = None, certificate: bool = True) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=trust or certs.ca)
    if certificate:
        ctx.load_cert_chain(certs.client_cert, certs.client_key)
    return ctx


def test_a_client_needs_a_certificate_and_must_trust_the_node(tls_node, certs):
    for _ in range(3):      # a failed handshake leaves nothing behind that stalls the next client
        assert not refused(tls_node, context(certs))
        assert refused(tls_node, context(certs, certificate=False))
        assert refused(tls_node, context(certs, trust=certs.client_cert))


def test_plain_resp_and_a_stalled_handshake_on_the_tls_port(tls_node, certs):
    with socket.create_connection(("127.0.0.1", tls_node.tls_port), timeout=10) as plain:
        plain.sendall(b"PING\r\n")
        try:
            assert not plain.recv(100).startswith(b"+PONG")      # dropped: what it sent is no handshake
        except ConnectionResetError:
            pass
    stalled = socket.create_connection(("127.0.0.1", tls_node.tls_port), timeout=10)
    stalled.sendall(b"\x16\x03\x01\x00")                  # the start of a ClientHello, then silence
    try:
        assert not refused(tls_node, context(certs))
    finally:
        stalled.close()


def test_optional_client_certificates(kvstore_factory, certs):
    port = free_port()
    daemon = kvstore_factory("--tls-port", str(port), *certs.server_flags("optional"))
    daemon.tls_port = port
    with tls_client(daemon, certs, ssl_certfile=None, ssl_keyfile=None) as anonymous:
        assert anonymous.set("k", "v") and anonymous.get("k") == b"v"
    with tls_client(daemon, certs) as named:
        assert named.get("k") == b"v"
    assert refused(daemon, context(certs, trust=certs.client_cert))


def test_bad_tls_settings_stop_the_node_with_a_message(tmp_path, certs):
    base = [sys.executable, "-m", "kvstore", "serve", "--port", str(free_port()), "--dram-size", "8mb"]
    for flags, message in ((["--tls-port", "1"], "tls-port needs tls-cert-file and tls-key-file"),
                           (["--tls-port", "1", "--tls-cert-file", certs.server_cert, "--tls-key-file",
                             certs.server_key], "tls-ca-cert-file must be given"),
                           (["--tls-port", str(free_port()), "--tls-cert-file", certs.ca, "--tls-key-file",
                             certs.server_key, "--tls-auth-clients", "no"], "Could not start")):
        done = subprocess.run(base + flags, capture_output=True, text=True, timeout=60)
        assert done.returncode in (1, 2) and message in done.stderr and "Traceback" not in done.stderr


# ------------------------------------------------------------------ the SDK

def sdk_context(certs) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=certs.ca)
    ctx.load_cert_chain(certs.client_cert, certs.client_key)
    return ctx


def test_sdk_over_tls(tls_node, certs):
    value = bytes(range(256)) * 4096 + b"tail"                 # 1 MiB and a bit
    with KVClient("127.0.0.1", tls_node.tls_port, tls=sdk_context(certs), fast_path="off") as client:
        assert client.put(b"sdk:1", value)
        assert bytes(client.get(b"sdk:1")) == value
        assert client.batch_put([(b"sdk:%d" % i, b"v" * i * 1000) for i in range(2, 40)])
        assert [bytes(v) for v in client.batch_get([b"sdk:%d" % i for i in range(2, 40)])] == \
            [b"v" * i * 1000 for i in range(2, 40)]
        assert client.match_prefix([b"sdk:1", b"sdk:2", b"sdk:missing"]) == 2


def test_async_sdk_over_tls(tls_node, certs):
    value = b"a" * (3 << 20)

    async def run():
        async with AsyncKVClient("127.0.0.1", tls_node.tls_port, tls=sdk_context(certs),
                                 fast_path="off") as client:
            assert await client.put(b"async:1", value)
            got = await asyncio.gather(*(client.get(b"async:1") for _ in range(4)))
            assert all(bytes(g) == value for g in got)
            return await client.match_prefix([b"async:1", b"async:2"])

    assert asyncio.run(run()) == 1


def test_sdk_refused_without_a_client_certificate(tls_node, certs):
    with pytest.raises((ConnectionError, TimeoutError)):
        with KVClient("127.0.0.1", tls_node.tls_port, tls=ssl.create_default_context(cafile=certs.ca),
                      retries=0, fast_path="off") as client:
            client.get(b"x")
