"""`kvstore llm up` as a real process for tests, and the HTTP calls its gateway answers.

`LlmUp(*flags)` starts it, reads the JSON line it prints once every part is
ready (gateway, store, conductor, workers with their pids) and stops it with
SIGTERM, which must end it cleanly (exit status 0).
"""
from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
from urllib.parse import urlparse

HTTP_TIMEOUT_S = 60.0       # no request may hang: a stuck one fails the test here


class LlmUp:
    def __init__(self, *flags: str):
        self.flags = flags

    def __enter__(self) -> dict:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore", "llm", "up", *self.flags],
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llm up exited with {self.proc.wait(30)} before it was ready")
        return json.loads(line)

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(60) == 0


def post(url: str, body, path: str = "/v1/completions") -> tuple[int, bytes]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=HTTP_TIMEOUT_S)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    reply = conn.getresponse()
    return reply.status, reply.read()


def get(url: str, path: str) -> tuple[int, bytes]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=HTTP_TIMEOUT_S)
    conn.request("GET", path)
    reply = conn.getresponse()
    return reply.status, reply.read()
