"""The gateway's HTTP layer in process, in front of a conductor nobody answers: slow and oversized clients cost a
socket for `CLIENT_TIMEOUT_S` at most and never hold other requests back."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from llm_procs import get
from workers import gateway as gateway_module
from workers import http_app
from workers.catalog import TINY, TINY_CONTEXT, ByteTokenizer
from workers.gateway import Router
from workers.metrics import GatewayMetrics

TIMEOUT_S = 0.5


@pytest.fixture
def gateway(monkeypatch):
    monkeypatch.setattr(http_app, "CLIENT_TIMEOUT_S", TIMEOUT_S)
    router = Router("127.0.0.1:1", TINY, ByteTokenizer(), TINY_CONTEXT, None, GatewayMetrics())
    server = http_app.GatewayServer(router, "127.0.0.1", 0).start()
    yield server
    server.stop()


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"])
def test_a_client_silent_before_its_request_head_is_dropped(gateway, sent):
    sock = connect(gateway)
    sock.sendall(sent)
    started = time.monotonic()
    assert get(gateway.url, "/health")[0] == 200          # the stalled client holds nothing back
    assert read_all(sock) == b""
    assert time.monotonic() - started < TIMEOUT_S + 5


def test_a_body_that_stalls_gets_408_and_the_connection_closed(gateway):
    sock = connect(gateway)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"messages\": ")
    reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408 ") and b'"code": 408' in reply


def test_an_oversized_body_gets_413_without_being_read(gateway):
    sock = connect(gateway)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                 % (http_app.MAX_BODY_BYTES + 1))
    reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 413 ") and b'"param": null' in reply


def test_errors_and_unknown_routes_are_openai_error_objects(gateway):
    status, body = get(gateway.url, "/v1/chat/completions")
    assert status == 404 and b'"type": "not_found"' in body
    assert get(gateway.url, "/health") == (200, b'{"status": "ok"}')


class EndlessRouter(Router):
    """Tokens every 10 ms until closed; `closed` is set when the stream's generator is."""

    def __init__(self):
        super().__init__("127.0.0.1:1", TINY, ByteTokenizer(), TINY_CONTEXT, None, GatewayMetrics())
        self.closed = threading.Event()

    def generate(self, req, ids, served):
        try:
            while True:
                time.sleep(0.01)
                yield ord("a"), None
        finally:
            self.closed.set()


def test_a_client_that_disconnects_mid_stream_stops_its_decode():
    router = EndlessRouter()
    server = http_app.GatewayServer(router, "127.0.0.1", 0).start()
    try:
        sock = connect(server)
        body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "stream": true}'
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        received = b""
        while b"chat.completion.chunk" not in received:         # the head and the first events, in any cuts
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
        assert not router.closed.is_set()
        sock.close()
        assert router.closed.wait(5)
    finally:
        server.stop()


class WideText:
    """64 KiB of text per token: a stream that fills the socket buffers in a few dozen events."""

    def __init__(self, router):
        pass

    def add(self, token: int) -> str:
        return "x" * 65536

    def rest(self) -> str:
        return ""


def test_a_client_that_stops_reading_its_stream_is_dropped(monkeypatch):
    monkeypatch.setattr(http_app, "CLIENT_TIMEOUT_S", TIMEOUT_S)
    monkeypatch.setattr(gateway_module, "IncrementalText", WideText)
    router = EndlessRouter()
    server = http_app.GatewayServer(router, "127.0.0.1", 0).start()
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "stream": true}'
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        assert router.closed.wait(15)          # never read: the stream is dropped, its decode closed
        sock.close()
    finally:
        server.stop()
