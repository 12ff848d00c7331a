"""The faults a chaos run injects, one class each: how to start it, how to end it, and when it cannot run.

A fault acts on a `ChaosCluster`: ``start`` breaks something, ``end`` lets it
recover (the run waits its duration in between when ``held``). ``unavailable``
says why a fault cannot run on this machine (no network namespaces, no
filesystem of its own for the SSD tier), so its row says so instead of a
number. ``wrong_bytes`` is what the fault itself caught being served wrongly
(only the stalled writer checks anything of its own: its half-sent values
must never be visible).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket

from client import KVClusterClient
from client.errors import KVError
from loadtest.chaos_cluster import ChaosCluster

FILL_CHUNK = 1 << 20


class Fault:
    name = ""
    held = True

    def __init__(self, victim: int = 0):
        self.victim = victim
        self.wrong_bytes = 0

    def unavailable(self, cluster: ChaosCluster) -> str | None:
        return None

    def start(self, cluster: ChaosCluster) -> None:
        raise NotImplementedError

    def end(self, cluster: ChaosCluster) -> None:
        raise NotImplementedError


class NoFault(Fault):
    """The load alone, as long as a fault lasts: the reference for the rows that follow."""

    name = "none (load only)"

    def start(self, cluster: ChaosCluster) -> None:
        pass

    def end(self, cluster: ChaosCluster) -> None:
        pass


class KillRestart(Fault):
    """kill -9 a node and start it again at once (it joins the cluster again)."""

    name = "kill -9 a node, restart it"
    held = False

    def start(self, cluster: ChaosCluster) -> None:
        cluster.kill_and_restart(self.victim)

    def end(self, cluster: ChaosCluster) -> None:
        pass


class Pause(Fault):
    """SIGSTOP a node; SIGCONT at the end."""

    name = "SIGSTOP a node"

    def start(self, cluster: ChaosCluster) -> None:
        cluster.signal(self.victim, signal.SIGSTOP)

    def end(self, cluster: ChaosCluster) -> None:
        cluster.signal(self.victim, signal.SIGCONT)


class Partition(Fault):
    """The node's link goes down (its own network namespace); up at the end."""

    name = "cut a node's link"

    def unavailable(self, cluster: ChaosCluster) -> str | None:
        return None if cluster.lab is not None else "needs --netns (each node a host of its own)"

    def start(self, cluster: ChaosCluster) -> None:
        cluster.lab.cut(self.victim)

    def end(self, cluster: ChaosCluster) -> None:
        cluster.lab.heal(self.victim)


class EtcdStop(Fault):
    """SIGSTOP the cluster's etcd; SIGCONT at the end."""

    name = "stop etcd"

    def unavailable(self, cluster: ChaosCluster) -> str | None:
        return None if cluster.etcd_pid else "cluster up did not start the etcd"

    def start(self, cluster: ChaosCluster) -> None:
        os.kill(cluster.etcd_pid, signal.SIGSTOP)

    def end(self, cluster: ChaosCluster) -> None:
        os.kill(cluster.etcd_pid, signal.SIGCONT)


class DiskFull(Fault):
    """Fill the filesystem under node 0's SSD tier to the last byte; free it at the end."""

    name = "fill the disk under a node's SSD tier"

    def unavailable(self, cluster: ChaosCluster) -> str | None:
        return cluster.small_fs_problem

    def start(self, cluster: ChaosCluster) -> None:
        self.filler = cluster.small_fs / "filler"
        chunk = b"\0" * FILL_CHUNK
        with open(self.filler, "wb", buffering=0) as f:
            for size in (FILL_CHUNK, 4096, 1):
                with contextlib.suppress(OSError):
                    while True:
                        f.write(chunk[:size])
        free = os.statvfs(cluster.small_fs)
        if free.f_bavail:
            raise RuntimeError(f"{cluster.small_fs} still has {free.f_bavail} free blocks after filling")

    def end(self, cluster: ChaosCluster) -> None:
        self.filler.unlink(missing_ok=True)


class StalledWriter(Fault):
    """Clients that send half of a large value and stall; they hang up at the end.

    One per node, each a ``KV.PUT`` of a 4 MiB value cut at 2 MiB. While they
    stall, and after, their keys must read as missing: a partial value is
    never visible.
    """

    name = "a client sends half a value and stalls"
    VALUE_BYTES = 4 << 20

    def start(self, cluster: ChaosCluster) -> None:
        self.sockets: list[socket.socket] = []
        self.keys = [b"chaos:half:%d:%d" % (os.getpid(), i) for i in range(len(cluster.nodes))]
        for node, key in zip(cluster.nodes, self.keys):
            sock = socket.create_connection(node.host_port, timeout=5)
            header = b"*3\r\n$6\r\nKV.PUT\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, self.VALUE_BYTES)
            sock.sendall(header + b"\x5a" * (self.VALUE_BYTES // 2))
            self.sockets.append(sock)
        self._check(cluster)

    def end(self, cluster: ChaosCluster) -> None:
        self._check(cluster)
        for sock in self.sockets:
            sock.close()
        self._check(cluster)

    def _check(self, cluster: ChaosCluster) -> None:
        """Read the half-sent keys from their owners: anything served for them is wrong."""
        with KVClusterClient(cluster.addrs, fast_path="off", timeout=2, retries=0) as kv, \
                contextlib.suppress(KVError):
            self.wrong_bytes += sum(len(v) for v in kv.batch_get(self.keys) if v is not None)


FAULTS = {"none": NoFault, "kill": KillRestart, "stop": Pause, "cut": Partition, "etcd": EtcdStop, "disk": DiskFull,
          "stall": StalledWriter}
