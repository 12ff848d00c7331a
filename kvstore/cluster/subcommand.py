"""`kvstore cluster up` (a whole cluster on this machine) and `kvstore cluster status`.

``up`` starts a throwaway etcd (unless ``--etcd`` names one) and N
``kvstore serve --cluster etcd://HOST:PORT/NAME`` nodes on free loopback
ports (flags after ``--`` go to every node's ``serve``), waits until the
leader's map covers every slot with all N nodes and every node has applied
it, and prints one JSON line that scripts and tests read::

    {"etcd": "etcd://127.0.0.1:P/kvstore", "etcd_pid": ..., "name": "kvstore", "nodes": [{"id": ..., "addr": ..., "pid": ...}]}

(``etcd_pid`` only when it started the etcd).

It then stays in the foreground; SIGINT or SIGTERM stops the nodes (cleanly,
so they leave the cluster) and the etcd it started. ``status`` reads the
cluster's state from etcd: nodes, leader, epoch, slot ranges and coverage.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from kvstore.cluster.etcd_kv import EtcdKV
from kvstore.cluster.etcd_server import EtcdError, ThrowawayEtcd
from kvstore.cluster.kv import Unavailable
from kvstore.cluster.membership import ClusterError
from kvstore.cluster.netns import HostLab, NetnsUnavailable
from kvstore.cluster.ports import free_ports, port_was_taken
from kvstore.cluster.runner import ClusterURL
from kvstore.cluster.slots import SLOTS, SlotMap, SlotMapError

START_TIMEOUT = 60.0
NODE_START_TRIES = 3        # a node whose port another process took meanwhile starts again on a fresh one


@dataclass
class Snapshot:
    """The cluster as etcd holds it."""

    nodes: dict[str, str]
    leader: str | None
    slot_map: SlotMap | None
    problem: str = ""           # why the stored map could not be read


async def read_snapshot(url: ClusterURL) -> Snapshot:
    kv = EtcdKV(url.host, url.port, timeout=2)
    prefix = f"/kvstore/{url.name}/".encode()
    try:
        _, kvs = await kv.get_prefix(prefix)
    finally:
        await kv.close()
    found = {kv.key[len(prefix):]: kv.value for kv in kvs}
    nodes = {k[6:].decode(errors="replace"): v.decode(errors="replace") for k, v in found.items()
             if k.startswith(b"nodes/")}
    leader = found[b"leader"].decode(errors="replace") if b"leader" in found else None
    slot_map, problem = None, ""
    if b"slotmap" in found:
        try:
            slot_map = SlotMap.from_json(found[b"slotmap"])
        except SlotMapError as e:
            problem = f"the stored slot map is malformed: {e}"
    return Snapshot(nodes, leader, slot_map, problem)


def status_lines(url: ClusterURL, snap: Snapshot) -> list[str]:
    slot_map = snap.slot_map
    head = f"cluster {url.name} at etcd {url.etcd}: {len(snap.nodes)} nodes, leader {snap.leader or '(none)'}"
    if slot_map is None:
        return [head, snap.problem or "no slot map yet"]
    coverage = "ok" if slot_map.assigned == SLOTS else "INCOMPLETE"
    lines = [head, f"slot map epoch {slot_map.epoch}: {slot_map.assigned}/{SLOTS} slots assigned ({coverage})"]
    for node_id in sorted(snap.nodes.keys() | slot_map.nodes.keys()):
        addr = snap.nodes.get(node_id) or slot_map.nodes.get(node_id)
        ranges = " ".join(f"{s}" if s == e else f"{s}-{e}" for s, e in slot_map.ranges_of(node_id))
        alive = "" if node_id in snap.nodes else " (gone: lease expired or left)"
        lines.append(f"  {node_id} {addr}{alive} slots={slot_map.counts.get(node_id, 0)} {ranges}".rstrip())
    for slot, (source, target) in sorted(slot_map.migrating.items()):
        lines.append(f"  slot {slot} moving {source} -> {target}")
    return lines


def cmd_status(args: argparse.Namespace) -> int:
    try:
        url = ClusterURL.parse(args.url)
        snap = asyncio.run(read_snapshot(url))
    except (ClusterError, Unavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n".join(status_lines(url, snap)))
    return 0


# ---------------------------------------------------------------------- up


def node_epoch(addr: str) -> int:
    """The map epoch node ``addr`` has applied (CLUSTER INFO), -1 while it cannot say.

    A map in etcd is not yet a map the nodes serve: each applies it from its
    watch a moment later, and until then a node answers CLUSTERDOWN or MOVED
    from the map before. A node that refuses the question (a password, TLS
    only) cannot be asked, so it counts as applied: etcd's map is all we know.
    """
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0) as s:
            s.sendall(b"*2\r\n$7\r\nCLUSTER\r\n$4\r\nINFO\r\n")
            reply = b""
            while not reply.endswith(b"\r\n") or (reply[:1] == b"$" and len(reply) < _bulk_end(reply)):
                chunk = s.recv(65536)
                if not chunk:
                    return -1
                reply += chunk
    except (OSError, ValueError):
        return -1
    if reply[:1] == b"-":
        return 1 << 62
    for line in reply.decode("latin-1").splitlines():
        if line.startswith("cluster_current_epoch:"):
            return int(line.partition(":")[2])
    return -1


def _bulk_end(reply: bytes) -> int:
    """Where a RESP bulk string whose header has arrived ends (header, payload, CRLF)."""
    header, sep, _ = reply.partition(b"\r\n")
    return len(header) + 2 + int(header[1:]) + 2 if sep else len(reply) + 1


class LocalCluster:
    """The etcd (when ours) and node processes `up` started, and how to stop them."""

    def __init__(self, args: argparse.Namespace, stopping: threading.Event):
        self.args = args
        self.stopping = stopping
        self.etcd: ThrowawayEtcd | None = None
        self.etcd_url = args.etcd
        self.log_dir = tempfile.mkdtemp(prefix="kvstore-cluster-")
        self.nodes: list[tuple[str, subprocess.Popen]] = []        # (addr, process)
        self.node_tries: list[int] = []                             # starts so far, per node
        self.lab: HostLab | None = None

    def start(self) -> None:
        etcd_host = "127.0.0.1"
        if self.args.netns:
            self.lab = HostLab(self.args.nodes, self.args.nic_rate).up()
            etcd_host = self.lab.gateway
        if self.etcd_url is None:
            self.etcd = ThrowawayEtcd(os.path.join(self.log_dir, "etcd"), host=etcd_host).start()
            self.etcd_url = self.etcd.url
        self.url = ClusterURL.parse(self.etcd_url, self.args.name)
        for i, port in enumerate(free_ports(self.args.nodes)):       # distinct: all probed together
            self.nodes.append(self._start_node(i, port))
            self.node_tries.append(1)

    def _start_node(self, i: int, port: int) -> tuple[str, subprocess.Popen]:
        host, prefix = ("127.0.0.1", []) if self.lab is None else (self.lab.address(i), self.lab.prefix(i))
        command = [*prefix, sys.executable, "-m", "kvstore", "serve", "--bind", host, "--port", str(port),
                   "--cluster", str(self.url)]
        if self.lab is not None:
            # The lab's hosts sit on a private bridge of this machine: its clients are ours.
            command += ["--protected-mode", "no"]
        if self.args.dram_size:
            command += ["--dram-size", self.args.dram_size]
        if self.args.node_timeout:
            command += ["--cluster-node-timeout", str(self.args.node_timeout)]
        if self.args.ssd_dir:
            command += ["--ssd-dir", os.path.join(self.args.ssd_dir, f"node-{i}")]
        command += self.args.serve_flags
        with open(os.path.join(self.log_dir, f"node-{port}.log"), "ab") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)         # signals reach them through `stop` only
        return f"{host}:{port}", proc

    def wait_formed(self) -> list[dict]:
        """Block until the map covers every slot with exactly our nodes, none moving; their ids, addresses, pids."""
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            for i, (addr, proc) in enumerate(self.nodes):
                if proc.poll() is not None:
                    self._restart_if_port_taken(i)
            wanted = {addr for addr, _ in self.nodes}
            snap = self._snapshot()
            if snap is not None and snap.slot_map is not None and snap.slot_map.assigned == SLOTS \
                    and not snap.slot_map.migrating and set(snap.slot_map.nodes.values()) == wanted \
                    and all(node_epoch(addr) >= snap.slot_map.epoch for addr in wanted):
                ids = {addr: node_id for node_id, addr in snap.slot_map.nodes.items()}
                return [{"id": ids[addr], "addr": addr, "pid": proc.pid} for addr, proc in self.nodes]
            if time.monotonic() > deadline:
                raise ClusterError(f"the cluster did not form within {START_TIMEOUT:.0f} s (logs in {self.log_dir})")
            if self.stopping.wait(0.1):
                raise ClusterError("interrupted while the cluster was forming")

    def _restart_if_port_taken(self, i: int) -> None:
        """Node ``i`` exited: when its port was taken by another process after it was picked, start it
        again on a fresh port (NODE_START_TRIES starts in all); any other exit fails the start."""
        addr, proc = self.nodes[i]
        tail = self._log_tail(addr)
        if not port_was_taken(tail) or self.node_tries[i] >= NODE_START_TRIES:
            raise ClusterError(f"node {addr} exited with {proc.returncode}:\n{tail}")
        print(f"node {addr} found its port taken: starting it on another", file=sys.stderr)
        ours = {int(a.rpartition(":")[2]) for a, _ in self.nodes}
        port = next(p for p in free_ports(len(ours) + 1) if p not in ours)  # n+1 distinct: one is not ours
        self.nodes[i] = self._start_node(i, port)
        self.node_tries[i] += 1

    def _snapshot(self) -> Snapshot | None:
        try:
            return asyncio.run(read_snapshot(self.url))
        except Unavailable:
            return None

    def _log_tail(self, addr: str) -> str:
        path = os.path.join(self.log_dir, f"node-{addr.rpartition(':')[2]}.log")
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-15:])

    def stop(self) -> None:
        for _, proc in self.nodes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in self.nodes:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.etcd is not None:
            self.etcd.discard_data()
        if self.lab is not None:
            self.lab.close()


def cmd_up(args: argparse.Namespace) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = LocalCluster(args, stop)
    try:
        cluster.start()
        nodes = cluster.wait_formed()
        lab = cluster.lab
        print(json.dumps({"etcd": str(cluster.url), "name": cluster.url.name, "nodes": nodes,
                          **({} if cluster.etcd is None else {"etcd_pid": cluster.etcd.proc.pid}),
                          **({} if lab is None else {"netns": lab.namespaces, "nic_rate": args.nic_rate})}),
              flush=True)
        print(f"cluster {args.name} is up (logs in {cluster.log_dir}); Ctrl-C stops it", file=sys.stderr)
        stop.wait()
    except (ClusterError, EtcdError, NetnsUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    return 0


def cluster_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvstore cluster", description="Run or inspect a kvstore cluster.")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="start an etcd and N nodes on this machine",
                        description="Start a throwaway etcd (unless --etcd) and N nodes on free loopback ports; "
                        "print one JSON line with their ids, addresses and pids; stop all on SIGINT/SIGTERM.")
    up.add_argument("--nodes", type=int, required=True, metavar="N", help="how many nodes")
    up.add_argument("--dram-size", metavar="SIZE", help="each node's DRAM arena, e.g. 256mb")
    up.add_argument("--etcd", metavar="URL", help="use this etcd (etcd://HOST:PORT[/NAME] or http://HOST:PORT) instead of starting one")
    up.add_argument("--name", default="kvstore", help="cluster name in etcd (default kvstore)")
    up.add_argument("--node-timeout", type=float, metavar="S", help="passed to each node as --cluster-node-timeout")
    up.add_argument("--ssd-dir", metavar="DIR", help="each node's SSD tier in DIR/node-I (I from 0)")
    up.add_argument("serve_flags", nargs="*", metavar="-- SERVE-FLAG",
                    help="flags after -- are passed to every node's kvstore serve (e.g. -- --hot-reads 50)")
    up.add_argument("--netns", action="store_true", help="run each node in its own network namespace "
                    "(a host of its own on a bridge; needs root and iproute2)")
    up.add_argument("--nic-rate", metavar="RATE", help="with --netns: cap each node's link (tc tbf), e.g. 1gbit")
    status = sub.add_parser("status", help="print a cluster's nodes, slot ranges, epoch and coverage")
    status.add_argument("url", metavar="etcd://HOST:PORT/NAME")
    args = parser.parse_args(argv)
    if args.action == "up":
        if args.nodes < 1:
            parser.error("--nodes must be at least 1")
        if args.nic_rate and not args.netns:
            parser.error("--nic-rate caps the links of --netns hosts: give --netns too")
        return cmd_up(args)
    return cmd_status(args)
