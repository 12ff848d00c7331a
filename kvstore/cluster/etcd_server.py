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
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from kvstore.cluster.ports import HOST, free_ports, port_was_taken

START_TRIES = 3         # a first start whose ports another process took meanwhile tries fresh ones


class EtcdError(RuntimeError):
    """etcd is missing or did not come up; the message says why."""


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
        self.client_port, self.peer_port = free_ports(2, host)
        self.started = False
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def _data_dir(self) -> str:
        return os.path.join(self.dir, "data")

    @property
    def log_path(self) -> str:
        return os.path.join(self.dir, "etcd.log")

    def start(self, timeout: float = 20.0) -> "ThrowawayEtcd":
        """Start etcd and wait until it is healthy. A first start that finds a port taken tries fresh
        ones (START_TRIES in all); a restart keeps its ports, which the nodes know it by."""
        for attempt in range(1, START_TRIES + 1):
            try:
                self._start_once(timeout)
                break
            except EtcdError:
                if self.started or attempt == START_TRIES or not port_was_taken(self.log_tail()):
                    raise
                self.client_port, self.peer_port = free_ports(2, self.host)
                shutil.rmtree(self._data_dir, ignore_errors=True)      # nothing of the old ports may stay
        self.started = True
        return self

    def _start_once(self, timeout: float) -> None:
        os.makedirs(self.dir, exist_ok=True)
        client, peer = f"http://{self.host}:{self.client_port}", f"http://{self.host}:{self.peer_port}"
        args = [self.exe, "--name", self.name, "--data-dir", self._data_dir,
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{self.name}={peer}", "--unsafe-no-fsync", "--log-level", "warn"]
        with open(self.log_path, "ab") as log:
            # Its own session: a Ctrl-C meant for the parent must not stop etcd before the nodes leave.
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self._wait_healthy(timeout)

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

    def discard_data(self) -> None:
        """Stop and remove what etcd stored (a 64 MB preallocated WAL at least), keeping its log: for a
        throwaway whose data is of no use once it stops, in a directory that is not ours to remove."""
        self.stop()
        shutil.rmtree(self._data_dir, ignore_errors=True)

    def close(self) -> None:
        """Stop and remove the data directory when it is ours."""
        self.stop()
        if self.owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
