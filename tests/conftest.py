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
`redis_factory` and `redis_module_factory` do the same for real redis-servers
(the reference), `redis_server` is one of them and `redis_module_server` one
shared by a module.

Clusters: `cluster_factory(nodes, dram_size, extra)` starts `kvstore cluster
up` (a throwaway etcd and N nodes), `.join(up, *flags)` a `kvstore serve
--cluster` node that joins one; at teardown the joined nodes stop first (while
their etcd runs, so they leave cleanly), then the clusters, whose logs are
kept when a test failed. `cluster_module_factory` is the same for a module's
shared cluster. `etcd` is a throwaway etcd of the test's own.

Names: `kv` is always a client; a daemon is `server` or `node`; a running
cluster is `cluster` (shared) or `up`.
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

from loadtest.cluster_up import ClusterUp


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


class RedisFactory:
    """Starts redis-servers (the reference), each in a folder of its own; `stop_all` stops them."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.started: list[Daemon] = []

    def __call__(self, *extra: str) -> Daemon:
        folder = self.tmp_path / f"redis-{len(self.started)}"
        folder.mkdir()
        self.started.append(start_redis(folder, *extra))
        return self.started[-1]

    def cluster_node(self) -> tuple[Daemon, int]:
        """A redis-server with --cluster-enabled (no slots yet), and its cluster bus port."""
        bus_port = free_port()
        return self("--cluster-enabled", "yes", "--cluster-port", str(bus_port)), bus_port

    def stop_all(self) -> None:
        for daemon in reversed(self.started):
            daemon.stop()


@pytest.fixture
def redis_factory(tmp_path):
    factory = RedisFactory(tmp_path)
    yield factory
    factory.stop_all()


@pytest.fixture(scope="module")
def redis_module_factory(tmp_path_factory):
    factory = RedisFactory(tmp_path_factory.mktemp("redis"))
    yield factory
    factory.stop_all()


@pytest.fixture
def redis_server(redis_factory):
    return redis_factory()


@pytest.fixture(scope="module")
def redis_module_server(redis_module_factory):
    """One redis-server for a module's tests (each empties what it uses)."""
    return redis_module_factory()


def start_redis(folder, *extra: str) -> Daemon:
    """A real redis-server (the reference) on a free local port, its files in ``folder``."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (make test installs it)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(folder), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    daemon = Daemon(proc, "127.0.0.1", port)
    wait_ready("127.0.0.1", port, proc)
    return daemon


class ClusterFactory:
    """Starts `kvstore cluster up` clusters and nodes that join one; `stop_all` stops all of them."""

    def __init__(self, tmp_path):
        self.joined = KVStoreFactory(tmp_path)
        self.clusters: list[ClusterUp] = []

    def __call__(self, nodes: int = 3, dram_size: str = "64mb", extra: tuple[str, ...] = ()) -> ClusterUp:
        up = ClusterUp(nodes, dram_size, tuple(extra)).__enter__()
        self.clusters.append(up)
        return up

    def join(self, up: ClusterUp, *flags: str) -> Daemon:
        """A `kvstore serve --cluster` node joining ``up``'s etcd; ``flags`` go to `start_kvstore`."""
        return self.joined("--cluster", up.etcd_url, *flags)

    @staticmethod
    def stop(up: ClusterUp, failed: bool = False) -> None:
        """Stop ``up`` (stopping it again is harmless); its logs are removed unless ``failed``."""
        up.__exit__(*((AssertionError, None, None) if failed else (None, None, None)))

    def stop_all(self, failed: bool) -> None:
        self.joined.stop_all()
        for up in reversed(self.clusters):
            self.stop(up, failed)


@pytest.fixture
def cluster_factory(request, tmp_path):
    """Starts clusters for one test; stops them (and the nodes joined to them) at teardown."""
    factory = ClusterFactory(tmp_path)
    failed_before = request.session.testsfailed
    yield factory
    factory.stop_all(failed=request.session.testsfailed > failed_before)


@pytest.fixture(scope="module")
def cluster_module_factory(request, tmp_path_factory):
    """Starts clusters shared by a module's tests; stops them after its last test."""
    factory = ClusterFactory(tmp_path_factory.mktemp("cluster"))
    failed_before = request.session.testsfailed
    yield factory
    factory.stop_all(failed=request.session.testsfailed > failed_before)


@pytest.fixture
def etcd(tmp_path):
    """A throwaway etcd (Debian's etcd-server) on free loopback ports, its data in ``tmp_path``; a
    test may `stop` and `start` it again (same ports, same data). A test that starts nodes on it
    names `etcd` before their factory: fixtures stop in the reverse order of a test's arguments,
    so the nodes leave while etcd still runs."""
    from kvstore.cluster.etcd_server import EtcdError, ThrowawayEtcd
    try:
        server = ThrowawayEtcd(str(tmp_path / "etcd")).start()
    except EtcdError as e:
        pytest.fail(str(e))
    yield server
    server.close()
