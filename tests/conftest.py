"""Fixtures that start real daemon processes on loopback.

`kvstore_factory` starts as many `python -m kvstore serve` daemons as a test
asks for (`kvstore_factory(*flags)`, the arguments of `start_kvstore` after
the folder), each on a free port and a Unix socket in the test's folder, and
stops every one it started (or was handed with `.adopt`, or started again with
`.restart`) at teardown, so a test needs no try/finally of its own; a test
that stops a daemon itself (to restart it, or with a signal) may: stopping
twice is harmless. `kvstore_module_factory` is the same for a module's shared
daemons (a start costs a second on a busy host), stopped after the module's
last test. `server` is one daemon from the factory and `kv` a KVClient of it.
`redis_server` does the same for a real redis-server (the reference), and
`redis_module_server` is one shared by a module.

Names: `kv` is always a client; a daemon is `server` or `node`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Daemon:
    """A running server process and how to reach it."""

    proc: subprocess.Popen
    host: str
    port: int
    unix_socket: str | None = None
    password: str | None = None
    log_path: str | None = None
    args: list[str] = field(default_factory=list)

    def log(self) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# How long a test waits for a condition by default: generous, since CI runs the suite on a busy
# 2-core host where a process start, an etcd round or a disk write can take seconds. A wait that
# succeeds costs only the time it needs.
WAIT_S = 30.0


def wait_ready(host: str, port: int, proc: subprocess.Popen, timeout: float = 2 * WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering")
        try:
            with socket.create_connection((host, port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("server did not answer PING in time")


def eventually(predicate, timeout: float = WAIT_S) -> bool:
    """Whether ``predicate()`` became true within ``timeout`` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def wait_until(predicate, timeout: float = WAIT_S, what: str = "the condition") -> None:
    if not eventually(predicate, timeout):
        raise AssertionError(f"timed out waiting for {what}")


async def until(predicate, timeout: float = WAIT_S, what: str = "the condition") -> None:
    """`wait_until` inside a running event loop: polls without blocking the loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def start_kvstore(tmp_path, *extra: str, password: str | None = None,
                  prefix: tuple[str, ...] | list[str] = ()) -> Daemon:
    """Start `kvstore serve` with a small arena; extra flags go through as given
    (a later `--dram-size` wins). ``prefix`` runs it through another command,
    e.g. a private mount namespace."""
    port = free_port()
    sock_path = str(tmp_path / f"kv-{port}.sock")
    log_path = str(tmp_path / f"kv-{port}.log")
    args = [*prefix, sys.executable, "-m", "kvstore", "serve", "--port", str(port),
            "--unixsocket", sock_path, "--dram-size", "64mb", *extra]
    if password:
        args += ["--requirepass", password]
    log = open(log_path, "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    daemon = Daemon(proc, "127.0.0.1", port, sock_path, password, log_path, args)
    try:
        wait_ready(daemon.host, port, proc)
    except Exception:
        daemon.stop(signal.SIGKILL)
        raise RuntimeError("kvstore did not start:\n" + daemon.log())
    return daemon


def restart(daemon: Daemon, sig: int = signal.SIGTERM) -> Daemon:
    """Stop ``daemon`` with ``sig`` (nothing if it is stopped already) and start the same
    command line again: the same port and socket, a new log file beside the old one."""
    daemon.stop(sig)
    log_path = f"{daemon.log_path or 'kv'}.{time.monotonic_ns()}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(daemon.args, stdout=log, stderr=subprocess.STDOUT)
    again = dataclasses.replace(daemon, proc=proc, log_path=log_path)
    try:
        wait_ready(again.host, again.port, proc)
    except Exception:
        again.stop(signal.SIGKILL)
        raise RuntimeError("kvstore did not restart:\n" + again.log())
    return again


class KVStoreFactory:
    """Starts kvstore daemons in one folder; `stop_all` stops every one started or adopted."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.started: list[Daemon] = []

    def __call__(self, *extra: str, **kwargs) -> Daemon:
        return self.adopt(start_kvstore(self.tmp_path, *extra, **kwargs))

    def adopt(self, daemon: Daemon) -> Daemon:
        """Stop ``daemon`` (started some other way) with the others."""
        self.started.append(daemon)
        return daemon

    def restart(self, daemon: Daemon, sig: int = signal.SIGTERM) -> Daemon:
        """`restart` ``daemon``; the new process is stopped with the others."""
        return self.adopt(restart(daemon, sig))

    def stop_all(self) -> None:
        for daemon in reversed(self.started):
            daemon.stop()


@pytest.fixture
def kvstore_factory(tmp_path):
    """Starts kvstore daemons in ``tmp_path`` on demand; stops all of them at teardown."""
    factory = KVStoreFactory(tmp_path)
    yield factory
    factory.stop_all()


@pytest.fixture(scope="module")
def kvstore_module_factory(tmp_path_factory):
    """Starts daemons shared by a module's tests; stops them after its last test."""
    factory = KVStoreFactory(tmp_path_factory.mktemp("module"))
    yield factory
    factory.stop_all()


@pytest.fixture
def server(kvstore_factory):
    return kvstore_factory()


@pytest.fixture
def kv(server):
    """A KVClient of ``server``, closed at teardown."""
    from client import KVClient
    with KVClient(server.host, server.port) as client:
        yield client


@pytest.fixture
def redis_server(tmp_path):
    daemon = start_redis(tmp_path)
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def redis_module_server(tmp_path_factory):
    """One redis-server for a module's tests (each empties what it uses)."""
    daemon = start_redis(tmp_path_factory.mktemp("redis"))
    yield daemon
    daemon.stop()


def start_redis(tmp_path) -> Daemon:
    """A real redis-server (the reference) on a free local port."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (make test installs it)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    daemon = Daemon(proc, "127.0.0.1", port)
    wait_ready("127.0.0.1", port, proc)
    return daemon
