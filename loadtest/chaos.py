"""A cluster under load, faults injected one after another, one row per fault.

    python -m loadtest.chaos [--nodes 3] [--duration 10] [--faults none,kill,stop,cut,etcd,disk,stall]

It starts ``kvstore cluster up`` (``--netns`` when this machine can make
network namespaces), keeps engines replaying the conversation trace on it
(`loadtest.chaos_load`), and injects each fault (`loadtest.faults`) for
``--duration`` seconds, then gives the cluster a recovery period (the
first row, "none", is the load alone, as the reference):

- kill -9 a node and restart it with its own command line;
- SIGSTOP a node;
- cut a node's link (``--netns`` only);
- SIGSTOP etcd;
- fill the filesystem under a node's SSD tier (a tmpfs of its own);
- clients that send half of a value and stall.

Each row: the load's client errors (of its operations) during the fault and
its recovery; wrong bytes served, from the load, the slot probe, the ledger
and the fault's own checks (must be 0: a cache may lose a value, never serve
a wrong one); seconds from the fault's end until every slot is served again
(`loadtest.chaos_checks.SlotProbe`; target: node timeout + 2 s); ledger
values lost; nodes up (alive and answering PING) and owning slots at the end
of the recovery period. The exit code is 1 when any byte was wrong or a node
is down at the end.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field

from client import KVClusterClient
from kvstore.cluster.netns import netns_available
from loadtest.chaos_checks import Ledger, SlotProbe
from loadtest.chaos_cluster import ChaosCluster
from loadtest.chaos_load import TraceLoad
from loadtest.faults import FAULTS, Fault
from loadtest.kv_workload import TraceCursor, default_trace, load_trace
from loadtest.report import log, machine_info

VICTIMS = {"none": 0, "kill": 1, "stop": 2, "cut": 1, "etcd": 0, "disk": 0, "stall": 0}


@dataclass
class Settings:
    nodes: int = 3
    duration: float = 10.0
    recovery: float = 8.0
    node_timeout: float = 2.0
    threads: int = 4
    block_bytes: int = 2 << 10       # the whole trace fits in the nodes' DRAM: a value lost is the fault's doing
    ledger: int = 2000
    netns: bool = False
    faults: list[str] = field(default_factory=lambda: list(FAULTS))        # "none" first: the reference
    json_path: str | None = None


@dataclass
class Row:
    fault: str
    held_s: float = 0.0
    ops: int = 0
    errors: int = 0
    wrong_bytes: int = 0
    served_after_s: float | None = None
    lost: int = 0
    written: int = 0
    nodes_up: int = 0
    owners: int = 0
    note: str = ""


class Run:
    """The cluster, its load and its checks, and one row per fault."""

    def __init__(self, s: Settings, cluster: ChaosCluster, load: TraceLoad):
        self.s, self.cluster, self.load = s, cluster, load
        self.probe = SlotProbe(cluster.addrs)
        self.ledger_kv = KVClusterClient(cluster.addrs, fast_path="off", timeout=2, retries=1)

    def fault(self, key: str) -> Row:
        """Inject one fault under the load, wait for recovery, and measure its row."""
        fault = FAULTS[key](VICTIMS[key] % self.s.nodes)
        row = Row(fault.name)
        why = fault.unavailable(self.cluster)
        if why:
            row.note = f"not run: {why}"
            return row
        ledger = Ledger(self.ledger_kv, self.s.ledger)
        ledger.write(key + str(time.monotonic_ns()))
        self.load.take()
        wrong_before = self.probe.wrong_bytes
        started, ended = self._inject(fault)
        row.held_s = ended - started
        row.served_after_s = self.probe.served_after(ended, limit_s=60.0)
        self._settle(ended)
        row.lost, ledger_wrong = ledger.check()
        row.written = len(ledger.keys)
        window = self.load.take()
        row.ops, row.errors, row.note = window.ops, window.errors, window.first_error
        row.wrong_bytes = window.wrong_bytes + ledger_wrong + fault.wrong_bytes + self.probe.wrong_bytes - wrong_before
        row.nodes_up = sum(self.cluster.node_up(i) for i in range(self.s.nodes))
        row.owners = len(self.cluster.owners() & set(self.cluster.addrs))
        if row.served_after_s is None or row.served_after_s > self.s.node_timeout + 2.0:
            log("probe rounds after the fault (start+length): " + "; ".join(self.probe.rounds))
        return row

    def _inject(self, fault: Fault) -> tuple[float, float]:
        """Start the fault, hold it for the run's duration when it is held, end it; when it started and ended."""
        log(f"{fault.name} (node {fault.victim})")
        started = time.monotonic()
        fault.start(self.cluster)
        try:
            if fault.held:
                time.sleep(self.s.duration)
        finally:
            fault.end(self.cluster)
        return started, time.monotonic()

    def _settle(self, ended: float, extra_s: float = 30.0) -> None:
        """The recovery period, stretched (up to ``extra_s``) until every node is up and owns slots again."""
        time.sleep(max(0.0, ended + self.s.recovery - time.monotonic()))
        deadline = time.monotonic() + extra_s
        while time.monotonic() < deadline and not self._whole():
            time.sleep(0.5)

    def _whole(self) -> bool:
        return all(self.cluster.node_up(i) for i in range(self.s.nodes)) and \
            self.cluster.owners() >= set(self.cluster.addrs)

    def close(self) -> None:
        self.probe.close()
        self.ledger_kv.close()


def markdown(rows: list[Row], s: Settings) -> str:
    target = s.node_timeout + 2.0
    lines = ["| fault | held s | client errors / ops | wrong bytes | every slot served again after s "
             f"(target <= {target:g}) | values lost / written | nodes up | nodes owning slots | first error |",
             "|---|--:|--:|--:|--:|--:|--:|--:|---|"]
    for r in rows:
        served = "-" if r.served_after_s is None and r.note.startswith("not run") else (
            "never" if r.served_after_s is None else f"{r.served_after_s:.2f}")
        lines.append(f"| {r.fault} | {r.held_s:.1f} | {r.errors:,} / {r.ops:,} | {r.wrong_bytes:,} | {served} "
                     f"| {r.lost:,} / {r.written:,} | {r.nodes_up}/{s.nodes} | {r.owners}/{s.nodes} "
                     f"| {r.note.replace('|', '/')} |")
    return "\n".join(lines)


def verdict(rows: list[Row], s: Settings) -> list[str]:
    """What missed its target (empty when all is well): wrong bytes, slots served late, nodes down."""
    missed = []
    for r in rows:
        if r.note.startswith("not run"):
            continue
        if r.wrong_bytes:
            missed.append(f"{r.fault}: {r.wrong_bytes} wrong bytes served")
        if r.served_after_s is None or r.served_after_s > s.node_timeout + 2.0:
            missed.append(f"{r.fault}: slots served again after {r.served_after_s} s")
        if r.nodes_up < s.nodes:
            missed.append(f"{r.fault}: {s.nodes - r.nodes_up} nodes down at the end")
    return missed


def run(s: Settings) -> list[Row]:
    cursor = TraceCursor(load_trace(default_trace()))
    with ChaosCluster(s.nodes, netns=s.netns, node_timeout=s.node_timeout) as cluster:
        log(f"cluster up: {', '.join(cluster.addrs)}" + (" (network namespaces)" if cluster.lab else ""))
        load = TraceLoad(cluster.addrs, cursor, threads=s.threads, block_bytes=s.block_bytes).start()
        chaos = Run(s, cluster, load)
        try:
            rows = []
            for key in s.faults:
                rows.append(chaos.fault(key))
                log(markdown(rows[-1:], s).splitlines()[-1])
        finally:
            load.stop()
            chaos.close()
    return rows


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(prog="python -m loadtest.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds each fault lasts (default 10)")
    parser.add_argument("--recovery", type=float, default=8.0, help="seconds after a fault before the next")
    parser.add_argument("--node-timeout", type=float, default=2.0, help="the nodes' --cluster-node-timeout")
    parser.add_argument("--threads", type=int, default=4, help="engines replaying the trace")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"which, in order (of {','.join(FAULTS)})")
    parser.add_argument("--json", metavar="FILE", help="also write the rows to FILE as JSON")
    netns = parser.add_mutually_exclusive_group()
    netns.add_argument("--netns", dest="netns", action="store_true", default=None, help="nodes in namespaces")
    netns.add_argument("--no-netns", dest="netns", action="store_false")
    args = parser.parse_args(argv)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown or args.nodes < 1:
        parser.error(f"unknown faults {unknown}" if unknown else "--nodes must be at least 1")
    use_netns = netns_available()[0] if args.netns is None else args.netns
    return Settings(nodes=args.nodes, duration=args.duration, recovery=args.recovery, node_timeout=args.node_timeout,
                    threads=args.threads, netns=use_netns, faults=faults, json_path=args.json)


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    info = machine_info()
    rows = run(s)
    print(f"\nChaos run (`python -m loadtest.chaos --nodes {s.nodes} --duration {s.duration:g}`), "
          f"{'nodes in network namespaces' if s.netns else 'nodes on loopback'}, node timeout "
          f"{s.node_timeout:g} s, {s.threads} engines replaying the conversation trace.\n"
          f"Measured date: {info['date']}, nproc: {info['nproc']}, "
          f"load average at start: {info['load average at start']}.\n")
    print(markdown(rows, s))
    if s.json_path:
        with open(s.json_path, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "settings": asdict(s), "rows": [asdict(r) for r in rows]}, f, indent=1)
    missed = verdict(rows, s)
    print("\n" + ("\n".join(f"MISSED {m}" for m in missed) if missed else "every target met"))
    return 1 if any("wrong bytes" in m or "nodes down" in m for m in missed) else 0


if __name__ == "__main__":
    sys.exit(main())
