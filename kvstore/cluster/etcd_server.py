"""A throwaway etcd: one member on free loopback ports, its data in a temporary directory.

`kvstore cluster up` starts one when no ``--etcd`` is given, and the tests
start one per test. It is the real server (Debian's ``etcd-server``), run
with ``--unsafe-no-fsync`` because its data dies with it anyway. `stop` and
`start` again keep the data directory and the ports, which is how tests
show nodes riding out an etcd restart.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

HOST = "127.0.0.1"


class EtcdError(RuntimeError):
    """etcd is missing or did not come up; the message says why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ThrowawayEtcd:
    """One etcd process; ``url`` is its client URL (``http://127.0.0.1:PORT``)."""

    def __init__(self, data_dir: str | None = None, name: str = "kvstore-etcd", host: str = HOST):
        self.exe = shutil.which("etcd")
        if self.exe is None:
            raise EtcdError("etcd is not installed (apt-get install etcd-server, or `make system-deps`)")
        self.owns_dir = data_dir is None
        self.dir = data_dir or tempfile.mkdtemp(prefix="kvstore-etcd-")
        self.name = name
        self.host = host                # a bridge address when the nodes live in network namespaces
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.dir, "etcd.log")

    def start(self, timeout: float = 20.0) -> "ThrowawayEtcd":
        os.makedirs(self.dir, exist_ok=True)
        client, peer = f"http://{self.host}:{self.client_port}", f"http://{self.host}:{self.peer_port}"
        args = [self.exe, "--name", self.name, "--data-dir", os.path.join(self.dir, "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{self.name}={peer}", "--unsafe-no-fsync", "--log-level", "warn"]
        with open(self.log_path, "ab") as log:
            # Its own session: a Ctrl-C meant for the parent must not stop etcd before the nodes leave.
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self._wait_healthy(timeout)
        return self

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EtcdError(f"etcd exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as reply:
                    if b'"true"' in reply.read():
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        self.stop(signal.SIGKILL)
        raise EtcdError(f"etcd did not become healthy within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Stop the process; the data directory and ports stay for a later `start`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """Stop and remove the data directory when it is ours."""
        self.stop()
        if self.owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
