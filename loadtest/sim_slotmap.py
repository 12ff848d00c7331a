"""The slot map's size as nodes join one at a time: the real leader over the in-process etcd.

The leader moves as few slots as it can, and a joining node takes whole runs (each donor's
highest slots, a node may sit up to 1/8 of its share below or above it), so each join adds a few
ranges, not one per node. The map is written with owners as runs of node indexes. Every node
watches the map's change record (a node reads the whole map only when it missed an epoch), and
only the leader watches the registrations, so a join's node key reaches one watcher. Each row
also gives what etcd delivered to all watchers for the join that reached that size (events, and
bytes as a multiple of the map), beside what delivering the whole map to every node would cost.
"""
from __future__ import annotations

import asyncio
import random

from kvstore.cluster.assign import rebalance
from kvstore.cluster.fake_etcd import FakeEtcd
from kvstore.cluster.membership import InMemoryMembership
from kvstore.cluster.node import ClusterState
from kvstore.cluster.simclock import run_simulated
from kvstore.cluster.slots import SlotMap

POLL_S = 0.05


async def _grow(nodes: int, seed: int) -> list[tuple[int, int, int, int, int]]:
    """(nodes, ranges, map bytes, watch events, watch bytes) after each join, every node waited for
    before the next joins; the last two are what etcd delivered to all watchers for that join."""
    rng = random.Random(seed)
    etcd = FakeEtcd()
    states: list[ClusterState] = []
    rows = []
    for i in range(nodes):
        events, delivered = etcd.stats.watch_events, etcd.stats.watch_bytes
        state = ClusterState("%040x" % rng.getrandbits(160), f"10.{i // 250}.{i % 250}.1:7000",
                             InMemoryMembership(etcd, "grow", 5.0))
        await state.start()
        states.append(state)
        ids = {s.my_id for s in states}
        while not all(set(s.map.nodes) == ids and s.ok for s in states):
            await asyncio.sleep(POLL_S)
        m = states[0].map
        await asyncio.sleep(0.5)        # past the settle time: a join's every write is in
        rows.append((i + 1, len(m.ranges), len(m.to_json()), etcd.stats.watch_events - events,
                     etcd.stats.watch_bytes - delivered))
    for state in states:
        await state.stop()
    etcd.close()
    return rows


def map_growth(nodes: int, seed: int = 1) -> None:
    """Print the slot map's size as ``nodes`` join one at a time (beside the map of the same nodes
    started together) and what one write of it costs the watchers."""
    rows = run_simulated(_grow(nodes, seed))
    print(f"\nSlot map as {nodes} nodes join one at a time (the leader's own assignment, clean moves off)")
    print("| nodes | ranges | map bytes | started together: ranges, bytes | the whole map to every node "
          "| this join: watch events | this join: bytes to watchers (x map) |")
    print("|---|---|---|---|---|---|---|")
    for n, ranges, size, events, delivered in rows:
        if n & (n - 1) == 0 or n == nodes:
            together = rebalance(SlotMap.empty(), {"%040x" % i: f"10.0.{i // 250}.{i % 250}:1"
                                                   for i in range(n)})
            print(f"| {n} | {ranges} | {size:,} | {len(together.ranges)}, {len(together.to_json()):,} "
                  f"| {n * size / 2**20:.2f} MiB | {events:,} | {delivered:,} ({delivered / size:.1f}) |")
