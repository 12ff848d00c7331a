"""The cluster a chaos run breaks: `kvstore cluster up`, plus what the faults need to reach into it.

`ChaosCluster` starts ``kvstore cluster up`` (``--netns`` when asked: each
node a host of its own, so a link can be cut) with every node's SSD tier in
a folder of its own (written through: every put reaches it), and node 0's
on a small tmpfs of its own, so filling that filesystem starves one node's
SSD tier and no one else's. It keeps per
node what a fault needs: the pid, the command line it was started with
(read from ``/proc`` before a kill, so the node is restarted exactly as
``cluster up`` started it, in its namespace), and the process when it was
restarted here, which this class then stops at the end. A node that is
restarted joins the cluster again by itself.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from client import KVClient
from client.errors import KVError
from kvstore.cluster.netns import HostLab
from loadtest.cluster_up import ClusterUp

SSD_FS_BYTES = 384 << 20         # node 0's SSD filesystem
SSD_TIER_SIZE = "256mb"          # every node's SSD tier: inside that filesystem until a fault fills it


@dataclass
class Node:
    """One node of the cluster as the faults see it."""

    index: int
    addr: str
    pid: int
    netns: str | None = None
    restarted: subprocess.Popen | None = None

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.addr.rpartition(":")
        return host, int(port)


class ChaosCluster:
    """``cluster up`` with N nodes; node 0's SSD tier on a filesystem of its own when one can be mounted."""

    def __init__(self, nodes: int, *, netns: bool, node_timeout: float, dram_size: str = "256mb"):
        self.work = Path(tempfile.mkdtemp(prefix="kvstore-chaos-"))
        self.ssd_root = self.work / "ssd"
        self.small_fs = self.ssd_root / "node-0"
        self.small_fs_problem = _mount_tmpfs(self.small_fs, SSD_FS_BYTES)
        flags = ["--node-timeout", str(node_timeout), "--ssd-dir", str(self.ssd_root),
                 *(["--netns"] if netns else []), "--", "--ssd-size", SSD_TIER_SIZE, "--ssd-write-policy", "write-through"]
        self.up = ClusterUp(nodes=nodes, dram_size=dram_size, extra=tuple(flags))
        self.nodes: list[Node] = []
        self.lab: HostLab | None = None
        self.etcd_pid: int | None = None

    def __enter__(self) -> "ChaosCluster":
        try:
            self.up.__enter__()
        except BaseException:
            self._clean_up()
            raise
        info = self.up.info
        namespaces = info.get("netns") or [None] * len(info["nodes"])
        self.nodes = [Node(i, n["addr"], n["pid"], namespaces[i]) for i, n in enumerate(info["nodes"])]
        self.lab = HostLab.of(info["netns"]) if info.get("netns") else None
        self.etcd_pid = info.get("etcd_pid")
        return self

    @property
    def addrs(self) -> list[str]:
        return [node.addr for node in self.nodes]

    # ------------------------------------------------------------ what faults do

    def signal(self, index: int, sig: int) -> None:
        os.kill(self.nodes[index].pid, sig)

    def kill_and_restart(self, index: int) -> None:
        """kill -9 a node, then start it again with the command line and folder it had."""
        node = self.nodes[index]
        argv = Path(f"/proc/{node.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        cwd = os.readlink(f"/proc/{node.pid}/cwd")
        os.kill(node.pid, signal.SIGKILL)
        _wait_gone(node.pid, node.restarted)
        prefix = ["ip", "netns", "exec", node.netns] if node.netns else []
        with open(self.work / f"node-{index}-restarted.log", "ab") as log:
            node.restarted = subprocess.Popen([*prefix, *(a.decode() for a in argv)], cwd=cwd, stdout=log,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True)
        node.pid = node.restarted.pid

    # ------------------------------------------------------------ checks

    def node_up(self, index: int) -> bool:
        """The node's process lives and answers PING."""
        node = self.nodes[index]
        if not _alive(node.pid):
            return False
        try:
            with socket.create_connection(node.host_port, timeout=1) as s:
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def owners(self) -> set[str]:
        """The addresses that own slots in the map, as the first node that answers says."""
        for node in self.nodes:
            host, port = node.host_port
            try:
                with KVClient(host, port, timeout=1, retries=0, fast_path="off") as kv:
                    ranges = kv.execute("CLUSTER", "SLOTS")
            except KVError:
                continue
            return {f"{_text(owner[0])}:{owner[1]}" for _, _, owner, *_ in ranges}
        return set()

    # ------------------------------------------------------------ the end

    def __exit__(self, *exc: object) -> None:
        for node in self.nodes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.pid, signal.SIGCONT)         # a node paused by a fault cut short
        if self.etcd_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.etcd_pid, signal.SIGCONT)
        for node in self.nodes:
            if node.restarted is not None and node.restarted.poll() is None:
                node.restarted.terminate()
                try:
                    node.restarted.wait(15)
                except subprocess.TimeoutExpired:
                    node.restarted.kill()
                    node.restarted.wait()
        self.up.__exit__(*exc)
        self._clean_up()

    def _clean_up(self) -> None:
        """Unmount the small filesystem and remove the run's folder."""
        if self.small_fs_problem is None:
            subprocess.run(["umount", "-l", str(self.small_fs)], capture_output=True)
            self.small_fs_problem = "unmounted"
        shutil.rmtree(self.work, ignore_errors=True)


def _mount_tmpfs(path: Path, size: int) -> str | None:
    """Mount a tmpfs of ``size`` bytes at ``path``; None when done, else why not."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "kvstore-chaos", str(path)],
                              capture_output=True, text=True)
    except FileNotFoundError:
        return "mount is not installed"
    return None if done.returncode == 0 else f"cannot mount a tmpfs: {done.stderr.strip()}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else value


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    return False


def _wait_gone(pid: int, child: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """Wait until a killed node has died (reaped, when it is our child)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child is not None and child.poll() is not None:
            return
        if child is None and not _alive(pid):
            return
        time.sleep(0.02)
    raise RuntimeError(f"node pid {pid} did not die within {timeout:.0f} s of SIGKILL")
