"""Hosts on one machine: each node in its own network namespace behind a capped link.

A cluster spread over hosts gains from striping and hot-block copies because
each host has its own NIC. On one machine every node shares the loopback,
which is faster than any NIC, so those gains never show. `HostLab` gives each
node a host of its own instead:

    root namespace:  bridge kvbrN  10.213.X.1/24  (etcd and clients live here)
                        |-- vhN_i ==veth== vnN_i  10.213.X.(10+i)  in namespace kvnsN_i
    tc tbf on both ends of each veth: the node's download (vhN_i egress) and
    upload (vnN_i egress) are capped at the same rate, as a host NIC would be.

A partition is a link set down (`cut`/`heal`). Everything is named after the
lab's id (the creating process's pid), and `close` deletes the namespaces
(their veth ends go with them) and the bridge. Only `ip` and `tc` from
iproute2 are used; netem is not (these machines lack it), tbf is.
"""
from __future__ import annotations

import os
import subprocess


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, a sandbox without netns)."""


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(command)}: {done.stderr.strip()}")


def _tc(*args: str, netns: str | None = None) -> None:
    command = [*(["ip", "netns", "exec", netns] if netns else []), "tc", *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(command)}: {done.stderr.strip()}")


class HostLab:
    """``count`` namespaces on one bridge, each link capped at ``rate`` (tc syntax, e.g. ``1gbit``)."""

    def __init__(self, count: int, rate: str | None = None, lab_id: int | None = None):
        self.id = os.getpid() if lab_id is None else lab_id
        self.count, self.rate = count, rate
        self.subnet = f"10.213.{self.id % 250}"
        self.bridge = f"kvbr{self.id}"[:15]
        self.namespaces = [f"kvns{self.id}_{i}" for i in range(count)]
        self._made: list[str] = []

    @classmethod
    def of(cls, namespaces: list[str]) -> "HostLab":
        """The lab another process made (namespace names as `cluster up` prints them), to cut and
        heal its links; closing it stays with its maker."""
        lab_id = namespaces[0].removeprefix("kvns").rpartition("_")[0]
        return cls(len(namespaces), lab_id=int(lab_id))

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge: etcd and clients are reached here."""
        return f"{self.subnet}.1"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def prefix(self, i: int) -> list[str]:
        """A command prefix that runs a program inside host ``i``."""
        return ["ip", "netns", "exec", self.namespaces[i]]

    def up(self) -> "HostLab":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append("bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.count):
                self._add_host(i)
        except NetnsUnavailable:
            self.close()
            raise
        return self

    def _add_host(self, i: int) -> None:
        ns, outside, inside = self.namespaces[i], self._outside(i), f"vn{self.id}_{i}"[:15]
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", ns)
        _ip("link", "set", outside, "master", self.bridge, "up")
        _ip("addr", "add", f"{self.address(i)}/24", "dev", inside, netns=ns)
        _ip("link", "set", inside, "up", netns=ns)
        _ip("link", "set", "lo", "up", netns=ns)
        if self.rate:
            # burst: at least rate/HZ; 1 MiB keeps a 1-10 gbit cap smooth without letting a whole value through.
            for dev, where in ((outside, None), (inside, ns)):
                _tc("qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "1mb",
                    "latency", "50ms", netns=where)

    def _outside(self, i: int) -> str:
        return f"vh{self.id}_{i}"[:15]

    def cut(self, i: int) -> None:
        """Partition host ``i`` (its link goes down)."""
        _ip("link", "set", self._outside(i), "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self._outside(i), "up")

    def close(self) -> None:
        """Delete what `up` made; safe to call twice."""
        for name in reversed(self._made):
            if name == "bridge":
                subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            else:
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()


def netns_available() -> tuple[bool, str]:
    """Whether this machine lets us make namespaces (and why not)."""
    probe = HostLab(1, lab_id=os.getpid() % 100000 + 900000)
    try:
        probe.up()
    except NetnsUnavailable as exc:
        return False, str(exc)
    except FileNotFoundError:
        return False, "iproute2 (ip, tc) is not installed"
    finally:
        probe.close()
    return True, ""
