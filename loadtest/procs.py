"""Start and stop the servers a benchmark compares, on free loopback ports.

A benchmark owns every process it starts. `ProcessGroup` is the one place
that remembers them, by PID, and stops them all when the benchmark ends:
normally, on an exception, on Ctrl-C, or on SIGTERM (turned into
KeyboardInterrupt while the group is open). Servers start in their own
session, so a Ctrl-C at the terminal reaches only the benchmark, which then
stops them in order instead of leaving them half-killed.

Readiness is checked the way a client sees it: a server is up when it answers
PING (or, for Mooncake, when its holder process says its segment is mounted).
"""
from __future__ import annotations

import itertools
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvstore.cluster.ports import HOST, free_port, free_ports, port_was_taken

SERVER_START_TRIES = 3      # a server whose port another process took meanwhile starts again on a fresh one
DEFAULT_KVSTORE_CMD = "{python} -m kvstore serve --port {port} --dram-size {memory}"


@dataclass
class Process:
    """One child process and the file its output goes to."""

    name: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 5.0) -> None:
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


@dataclass
class Server:
    """A server process that answers on host:port."""

    name: str
    host: str
    port: int
    process: Process


class ProcessGroup:
    """Every process a benchmark started; stops them all on exit, newest first."""

    def __init__(self, log_dir: str | Path | None = None) -> None:
        self._own_dir = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="loadtest-"))
        self.processes: list[Process] = []
        self._old_sigterm = None

    def __enter__(self) -> ProcessGroup:
        self._old_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
        signal.signal(signal.SIGTERM, self._old_sigterm or signal.SIG_DFL)
        if self._own_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Process:
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        process = Process(name, popen, log_path)
        self.processes.append(process)
        return process

    def stop(self, process: Process) -> None:
        process.stop()
        self.processes.remove(process)

    def stop_all(self) -> None:
        while self.processes:
            self.processes.pop().stop()


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def wait_for_ping(host: str, port: int, process: Process, timeout: float = 30.0) -> None:
    """Return once the server answers PING with +PONG; raise with its log if it dies or stalls."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.popen.poll() is not None:
            raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.log_tail()}")
        try:
            with socket.create_connection((host, port), timeout=1) as s:
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{process.name} did not answer PING within {timeout:.0f} s:\n{process.log_tail()}")


def ensure_redis_tools() -> str:
    """Path of redis-server, installing redis-server and redis-tools from Debian if either is missing."""
    if not (shutil.which("redis-server") and shutil.which("redis-benchmark")):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server", "redis-tools"], check=True, env=env)
    return shutil.which("redis-server")


def start_redis(group: ProcessGroup, maxmemory: str, name: str = "redis") -> Server:
    """A redis-server with persistence off and the same memory limit the store gets."""
    redis_server = ensure_redis_tools()
    return start_server(group, name, lambda port: [
        redis_server, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
        "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru", "--dir", str(group.log_dir)])


def start_kvstore(group: ProcessGroup, memory: str, cmd_template: str = DEFAULT_KVSTORE_CMD,
                  name: str = "kvstore") -> Server:
    """The store daemon; cmd_template may name another command with {python}, {port}, {memory}."""
    return start_server(group, name, lambda port: shlex.split(cmd_template.format(
        python=shlex.quote(sys.executable), port=port, memory=memory, dir=group.log_dir)))


def start_server(group: ProcessGroup, name: str, argv_for: Callable[[int], list[str]]) -> Server:
    """Start ``argv_for(port)`` on a free port and wait for its PING; one that finds its port taken by
    another process meanwhile is started again on a fresh port (SERVER_START_TRIES starts in all)."""
    for attempt in itertools.count(1):
        port = free_port()
        process = group.start(name, argv_for(port))
        try:
            wait_for_ping(HOST, port, process)
            return Server(name, HOST, port, process)
        except RuntimeError:
            group.stop(process)
            if attempt == SERVER_START_TRIES or not port_was_taken(process.log_tail()):
                raise


@dataclass
class MooncakeCluster:
    """A Mooncake master (with its HTTP metadata server) and one process holding a memory segment."""

    master_address: str
    metadata_url: str


_MOONCAKE_HOLDER = """
import sys, time
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
rc = store.setup("{host}", "{metadata}", {segment}, 16 << 20, "tcp", "", "{master}")
print("MOUNTED" if rc == 0 else f"SETUP FAILED {{rc}}", flush=True)
while rc == 0:
    time.sleep(3600)
"""


def mooncake_master_path() -> str:
    """The mooncake_master binary the wheel installs next to this interpreter."""
    path = shutil.which("mooncake_master", path=str(Path(sys.executable).parent)) or shutil.which("mooncake_master")
    if path is None:
        raise RuntimeError("mooncake_master is not installed (pip install mooncake-transfer-engine-non-cuda)")
    return path


def start_mooncake(group: ProcessGroup, segment_bytes: int, timeout: float = 30.0) -> MooncakeCluster:
    """Start mooncake_master and a holder process that mounts segment_bytes of DRAM for the store."""
    rpc_port, http_port, metrics_port = free_ports(3)
    master = group.start("mooncake-master", [
        mooncake_master_path(), f"--rpc_port={rpc_port}", f"--rpc_address={HOST}",
        "--enable_http_metadata_server=true", f"--http_metadata_server_host={HOST}",
        f"--http_metadata_server_port={http_port}", f"--metrics_host={HOST}", f"--metrics_port={metrics_port}"])
    cluster = MooncakeCluster(f"{HOST}:{rpc_port}", f"http://{HOST}:{http_port}/metadata")
    _wait_for_port(HOST, rpc_port, master, timeout)
    _wait_for_port(HOST, http_port, master, timeout)
    holder_code = _MOONCAKE_HOLDER.format(host=HOST, metadata=cluster.metadata_url, segment=segment_bytes,
                                          master=cluster.master_address)
    holder = group.start("mooncake-holder", [sys.executable, "-c", holder_code])
    _wait_for_log(holder, "MOUNTED", timeout)
    return cluster


def _wait_for_port(host: str, port: int, process: Process, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.popen.poll() is not None:
            raise RuntimeError(f"{process.name} exited with {process.popen.returncode}: {process.log_tail(3)}")
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{process.name} did not listen on {port} within {timeout:.0f} s")


def _wait_for_log(process: Process, marker: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tail = process.log_tail(50)
        if marker in tail:
            return
        if process.popen.poll() is not None or "FAILED" in tail:
            raise RuntimeError(f"{process.name} failed: {process.log_tail(3)}")
        time.sleep(0.1)
    raise RuntimeError(f"{process.name} did not report {marker} within {timeout:.0f} s")
