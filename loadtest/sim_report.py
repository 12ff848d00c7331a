"""What a cluster simulation reports (sim_cluster.py), and the table it prints.

Per churn event: slots moved against the ideal 16384/N, bytes moved, dropped and lost (values
stand for whole blocks), the simulated seconds until every slot had a live owner again
(coverage) and until every node held the final map (settled), the hit ratio over a window
before and after, block requests that found no node to serve them, and what etcd saw until the
cluster settled. Over the run: the etcd load at rest, the hit ratio, the read bandwidth of the
average and the busiest node, and the two safety counts, which must be 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.cluster.fake_etcd import FakeEtcdStats


@dataclass
class EventReport:
    kind: str
    at_s: float
    nodes_before: int
    nodes_after: int
    slots_moved: int = 0
    ideal_slots: float = 0.0
    moved_bytes: int = 0
    dropped_bytes: int = 0
    lost_bytes: int = 0
    coverage_s: float = 0.0
    settled_s: float = 0.0
    hit_before: float = 0.0
    hit_after: float = 0.0
    errors_after: int = 0
    etcd: dict = field(default_factory=dict)
    map_bytes: int = 0
    to_move_bytes: int = 0          # what the sources held of the moving slots when the step began
    kept_bytes: int = 0             # ... of it, held by the slots' owners when the cluster settled
    reachable_lost_bytes: int = 0   # ... of it not held then although every block before it in its chain is
    not_prefix_before: float = 0.0  # share of the latest chains whose cached blocks are not a prefix
    not_prefix_after: float = 0.0   # ... at the end of the window after the event

    @property
    def move_dropped(self) -> float:
        """Of what a clean move would move, the share not at its new owner once settled."""
        return 1 - self.kept_bytes / self.to_move_bytes if self.to_move_bytes else 0.0

    @property
    def move_lost(self) -> float:
        """Of what a clean move would move, the share not at its new owner once settled that a prefix
        match would still reach (the rest followed an earlier block of its chain: no lookup reads it)."""
        return self.reachable_lost_bytes / self.to_move_bytes if self.to_move_bytes else 0.0

    @property
    def move_ratio(self) -> float:
        return self.slots_moved / self.ideal_slots


@dataclass
class SimReport:
    settings: SimSettings
    events: list[EventReport]
    steady_etcd: dict
    requests: int
    blocks: int
    hits: int
    errors: int
    steady_hit: float                            # hit ratio over the last window of the warm-up
    retention_s: float                           # DRAM of all nodes / blocks written per second then
    read_gbps_per_node: tuple[float, float, float]  # mean, busiest node, mean of the busiest 1 %, over the run
    copies_made: int
    copies_shed: int                             # copies a holder dropped to make room
    hottest_copies: int                          # copies made of the block read most
    hottest_reads_per_s: float
    double_owned: int                            # slot claims beyond one per epoch (must be 0)
    conflicts: int                               # epochs seen with two different maps (must be 0)
    sim_s: float


def etcd_rates(before: FakeEtcdStats, after: FakeEtcdStats, seconds: float) -> dict:
    """What etcd saw between two snapshots: per-second rates and totals."""
    return {"keepalives_per_s": (after.keepalives - before.keepalives) / seconds,
            "watch_events": after.watch_events - before.watch_events,
            "watch_events_per_s": (after.watch_events - before.watch_events) / seconds,
            "txns": after.txns - before.txns, "txns_failed": after.txns_failed - before.txns_failed,
            "bytes_written": after.bytes_written - before.bytes_written}


def print_report(r: SimReport, wall_s: float, cpu_s: float) -> None:
    """The events as a markdown table, then the run's totals."""
    s = r.settings
    gib = 2**30
    print(f"\n{s.nodes} nodes, {s.blocks_per_node} blocks of {s.nic.block_bytes / 2**20:.0f} MiB per node, "
          f"{s.rate_per_node * s.nodes:.1f} req/s, NIC {s.nic.nic_bytes_per_s * 8 / 1e9:.0f} Gbit/s, "
          f"move budget max({s.move_budget:g} s, 1.5 x DRAM / NIC), node timeout {s.node_timeout:g} s, hot-reads {s.hot_reads:g}")
    print("| event | nodes | slots moved | ideal | ratio | moved GiB | dropped GiB | lost GiB "
          "| coverage (s) | settled (s) | hit before | hit after | errors | keepalives/s "
          "| watch events | txns (failed) | map bytes | to move GiB | not kept (reachable) | chains not prefix before / after |")
    print("|" + "---|" * 20)
    for e in r.events:
        t = e.etcd
        print(f"| {e.kind} | {e.nodes_before}->{e.nodes_after} | {e.slots_moved} | {e.ideal_slots:.0f} "
              f"| {e.move_ratio:.2f} | {e.moved_bytes / gib:.1f} | {e.dropped_bytes / gib:.1f} "
              f"| {e.lost_bytes / gib:.1f} | {e.coverage_s:.2f} | {e.settled_s:.2f} | {e.hit_before:.3f} "
              f"| {e.hit_after:.3f} | {e.errors_after} | {t['keepalives_per_s']:.0f} | {t['watch_events']} "
              f"| {t['txns']} ({t['txns_failed']}) | {e.map_bytes} | {e.to_move_bytes / gib:.1f} "
              f"| {e.move_dropped:.1%} ({e.move_lost:.1%}) | {e.not_prefix_before:.1%} / {e.not_prefix_after:.1%} |")
    t = r.steady_etcd
    print(f"steady state: hit ratio {r.steady_hit:.3f}, DRAM holds {r.retention_s:.0f} s of writes, "
          f"{t['keepalives_per_s']:.1f} keep-alives/s, {t['watch_events_per_s']:.1f} watch "
          f"events/s, {t['txns'] / s.window_s:.2f} txns/s; requests {r.requests}, overall hit ratio "
          f"{r.hits / max(r.blocks, 1):.3f}, block errors {r.errors}")
    mean, busiest, top = r.read_gbps_per_node
    print(f"reads per node {mean:.2f} GB/s mean, {busiest:.2f} busiest ({busiest / top:.2f} x the mean of the "
          f"busiest 1 %, {top:.2f}; NIC {s.nic.nic_bytes_per_s / 1e9:.1f} GB/s); hot-block copies made "
          f"{r.copies_made}, shed for room {r.copies_shed}; the hottest block ({r.hottest_reads_per_s:.1f} "
          f"reads/s) copied {r.hottest_copies} times")
    print(f"slots served by two nodes at one epoch: {r.double_owned}; epochs with two maps: {r.conflicts}; "
          f"{r.sim_s:.0f} simulated s in {wall_s:.0f} s of wall time ({cpu_s:.0f} s of CPU)")
