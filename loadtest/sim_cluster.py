"""The store cluster at 16-256 nodes in one process, on virtual time: the real slot assignment,
leader election, hot-block replication and slot migration under a trace-shaped load with nodes
joining, leaving cleanly and crashing.

What is real. Every node is the code a `kvstore serve --cluster` process runs: a `ClusterState`
with `InMemoryMembership` (the etcd membership logic over `FakeEtcd`, whose `stats` count what a
real etcd would see), the `ClusterServices` a server starts (`HotCopies`, `Migrator`, their heat
window), an `Engine` with the store's eviction, and the node-to-node commands' own handlers
(sim_network.py). A clean leave is the server's SIGTERM path (drain, leave, close); a crash
stops the node without a word and its values are gone. Clients route each block as a cluster
client does, through the real `routing.redirect` (MOVED, ASK, CLUSTERDOWN), and read a hot
block from its owner or one of its copies (READONLY, when the holder's lease serves it).

What is modelled. Time is virtual (`simclock`): leases, elections and move budgets take the
seconds they take, the code runs as fast as it can. Values are 64 bytes standing for blocks of
`block_bytes`; node-to-node traffic crosses modelled NICs (sim_network.py), so a move budget
cuts a slow move short as it would. The load is the conversation preset of the trace generator
at `rate_per_node` requests per second per node, with exact request times (the preset rounds
them to 3 s ticks as the public trace was logged; served at once, a tick's requests would read a
hot block before any copy of it could exist): each request reads its prompt's blocks from
the first until one is missing (its prefix hit) and writes the rest, each block under its chain
parent.

`simulate` runs: all nodes start together, a warm-up, then one churn event every `gap_s`
(join, clean leave, crash of a node, crash of the leader), and returns a `SimReport`
(sim_report.py: per event, slots and bytes moved, coverage, hit ratio before and after, etcd
load). Every map any node applies is checked: no epoch may mean two maps, and no slot may be
served by two nodes at one epoch.
"""
from __future__ import annotations

import asyncio
import math
import random
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import xxhash

from conductor.tracegen import generate, spec_from
from kvstore.cluster import outgoing
from kvstore.cluster.assign import moved_slots
from kvstore.cluster.fake_etcd import FakeEtcd
from kvstore.cluster.membership import InMemoryMembership
from kvstore.cluster.node import ClusterState
from kvstore.cluster.routing import redirect
from kvstore.cluster.services import ClusterServices
from kvstore.cluster.simclock import run_simulated
from kvstore.cluster.slots import SLOTS, SlotMap, keyslot
from kvstore.admin.config import Config
from kvstore.store.engine import Engine, OutOfMemory
from loadtest.sim_network import NicModel, SimNetwork
from loadtest.sim_report import EventReport, SimReport, etcd_rates

EVENTS = ("join", "leave", "crash", "crash-leader")
POLL_S = 0.05
CHAINS_CHECKED = 2000           # the latest prompts whose cached blocks are checked for being a prefix


@dataclass(frozen=True)
class SimSettings:
    nodes: int = 16
    seed: int = 1
    blocks_per_node: int = 1024         # DRAM per node, in blocks (1024 x 160 MiB = 160 GiB)
    nic: NicModel = NicModel()
    rate_per_node: float = 3.4 / 8      # requests/s per node: the conversation trace on 8 nodes
    node_timeout: float = 5.0
    move_budget: float = 5.0
    hot_reads: float = 100.0
    hot_replicas: int = 2
    warmup_s: float = 150.0             # long enough to fill the DRAM at the default rate
    gap_s: float = 60.0
    window_s: float = 30.0
    events: tuple[str, ...] = ("join", "leave", "crash", "crash-leader", "join", "leave")

    def __post_init__(self) -> None:
        unknown = set(self.events) - set(EVENTS)
        if unknown or self.nodes < 3 or self.window_s > self.gap_s:
            raise ValueError("events must be among join, leave, crash, crash-leader; at least 3 "
                             "nodes; window_s at most gap_s")


class SimNode:
    """One store node: engine, cluster state, services; what `kvstore serve --cluster` holds."""

    def __init__(self, sim: ClusterSim, node_id: str, addr: str):
        s = sim.settings
        self.addr = addr
        self.config = Config(cluster_node_timeout=s.node_timeout, cluster_move_budget=s.move_budget,
                             hot_reads=s.hot_reads, hot_replicas=s.hot_replicas)
        self.engine = Engine(s.blocks_per_node * s.nic.value_bytes, prefault=False)
        self.tiers = None                   # DRAM only
        membership = InMemoryMembership(sim.etcd, "sim", s.node_timeout, connect_timeout=30)
        self.cluster = ClusterState(node_id, addr, membership, move_budget=s.move_budget)
        self.cluster.add_listener(lambda old, new: sim.audit(self, new))
        self.services: ClusterServices | None = None
        self.reads = 0
        sim.network.add(addr, self)

    async def start(self, network: SimNetwork) -> None:
        await self.cluster.start()
        model = network.model       # the arena holds values value_bytes / block_bytes of their size: so does the NIC
        nic = model.nic_bytes_per_s * model.value_bytes / model.block_bytes
        self.services = ClusterServices(self, self.cluster, network.peers_of(self.addr), nic)

    async def leave(self) -> None:
        """The server's SIGTERM path: move the slots away, leave, stop the services."""
        await self.services.drain()
        await self.cluster.stop()
        self.services.close()

    async def crash(self) -> None:
        await self.cluster.stop(clean=False)
        self.services.close()


class ClusterSim:
    """The nodes, the fake etcd, the network, the load, and the checks on every applied map."""

    def __init__(self, settings: SimSettings):
        self.settings = settings
        self.rng = random.Random(settings.seed)
        self.etcd = FakeEtcd()
        self.network = SimNetwork(settings.nic)
        self.live: list[SimNode] = []
        self.every: list[SimNode] = []
        self.claims: dict[int, np.ndarray] = {}
        self.maps: dict[int, SlotMap] = {}
        self.double_owned = self.conflicts = 0
        self.client_map = SlotMap.empty()
        self.log: list[tuple[float, int, int, int]] = []     # (time, blocks, hits, errors) per request
        self.key_reads: Counter[bytes] = Counter()              # block reads per key (the hottest block)
        self.chains: deque[list[bytes]] = deque(maxlen=CHAINS_CHECKED)
        self.moving_keys: set[bytes] = set()                    # values of the moving slots at a step's start
        self.predecessor: dict[bytes, bytes] = {}               # block -> the block before it in its chain
        self._value = bytes(settings.nic.value_bytes)

    # ------------------------------------------------------------ nodes

    def new_node(self) -> SimNode:
        i = len(self.every)
        node_id = "%040x" % self.rng.getrandbits(160)
        node = SimNode(self, node_id, f"10.{i // 250}.{i % 250}.1:7000")
        self.every.append(node)
        return node

    async def add_nodes(self, count: int) -> None:
        nodes = [self.new_node() for _ in range(count)]
        await asyncio.gather(*(n.start(self.network) for n in nodes))
        self.live += nodes

    def audit(self, node: SimNode, new: SlotMap) -> None:
        """Every map a node applies: one map per epoch, no slot claimed twice at one epoch."""
        if not self.maps.setdefault(new.epoch, new).same_as(new):
            self.conflicts += 1
        claimed = self.claims.setdefault(new.epoch, np.zeros(SLOTS, dtype=bool))
        mine = np.frombuffer(node.cluster.mine, dtype=np.uint8).astype(bool)
        self.double_owned += int(np.count_nonzero(claimed & mine))     # another node serves it at this epoch
        claimed |= mine
        moving = {slot for slot, (source, _) in new.migrating.items() if source == node.cluster.my_id}
        if moving:                  # a step map: what its sources hold of their moving slots
            self.moving_keys.update(key for key in node.engine.index if keyslot(key) in moving)

    def leader(self) -> SimNode:
        return next(n for n in self.live if n.cluster.is_leader)

    def up(self, addr: str | None) -> SimNode | None:
        """The node at ``addr`` if it answers."""
        if addr is None or addr in self.network.down:
            return None
        return self.network.nodes.get(addr)

    def covered(self) -> bool:
        """Every live node's map gives every slot to a node that answers."""
        for m in {id(n.cluster.map): n.cluster.map for n in self.live}.values():
            if m.assigned != SLOTS or any(c and self.up(m.nodes[i]) is None for i, c in m.counts.items()):
                return False
        return True

    def settled(self) -> bool:
        """Every live node holds the same final map of exactly the live nodes, under one leader."""
        maps = {n.cluster.map.epoch for n in self.live}
        m = self.live[0].cluster.map
        return (len(maps) == 1 and m.assigned == SLOTS and not m.migrating
                and set(m.nodes) == {n.cluster.my_id for n in self.live}
                and sum(n.cluster.is_leader for n in self.live) == 1)

    async def until(self, predicate, limit: float = 120.0) -> float:
        """Simulated seconds until ``predicate()`` holds (inf past ``limit``)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not predicate():
            if loop.time() - start > limit:
                return float("inf")
            await asyncio.sleep(POLL_S)
        return loop.time() - start

    # ------------------------------------------------------------ the load

    async def run_load(self, requests) -> None:
        loop = asyncio.get_running_loop()
        for req in requests:
            wait = req.arrival_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self.serve(req.hash_ids)

    def serve(self, hash_ids) -> None:
        """A prompt: read its blocks from the first until one is missing, write the rest."""
        keys = [xxhash.xxh3_128_digest(h.to_bytes(8, "little")) for h in hash_ids]
        hits = errors = 0
        for key in keys:
            found = self.read(key)
            if not found:
                errors += found is None
                break
            hits += 1
        errors += self.write_chain(keys, hits)
        self.chains.append(keys)
        self.predecessor.update(zip(keys[1:], keys))
        self.log.append((asyncio.get_running_loop().time(), len(keys), hits, errors))

    def route(self, key: bytes) -> SimNode | None:
        """The node that serves ``key`` now, found as a cluster client finds it; None when none
        does (a dead owner, CLUSTERDOWN)."""
        slot = keyslot(key)
        for _ in range(3):
            node = self.up(self.client_map.nodes.get(self.client_map.owner(slot)))
            if node is None:
                self.client_map = self.live[0].cluster.map       # ask a node for the topology
                node = self.up(self.client_map.nodes.get(self.client_map.owner(slot)))
                if node is None:
                    return None
            reply = redirect(node.cluster, [key], False, lambda k, n=node: n.engine.lookup(k) is not None)
            if reply is None:
                return node
            if reply.startswith(b"-MOVED"):
                self.client_map = node.cluster.map
            elif reply.startswith(b"-ASK"):
                target = self.up(reply.split()[2].decode())
                if target is None or redirect(target.cluster, [key], True, lambda k: True) is not None:
                    return None
                return target
            else:
                return None
        return None

    def read(self, key: bytes) -> bool | None:
        """Whether ``key`` was read (None: no node serves it); a hot block may come from a copy."""
        node = self.route(key)
        if node is None:
            return None
        self.key_reads[key] += 1
        holders = node.services.copies.replicated.get(key) if node.services else None
        if holders:
            pick = self.rng.randrange(len(holders) + 1)
            holder = self.up(node.cluster.addr_of(holders[pick - 1])) if pick else None
            if holder is not None and holder.services and holder.services.copies.held.serves([key]):
                node = holder
        hit = node.engine.get_entry(key) is not None
        node.reads += hit
        return hit

    def write_chain(self, keys: list[bytes], hits: int) -> int:
        """Write ``keys[hits:]`` as a cluster client's batch put does: each block under its nearest
        ancestor on the same node, and a link at its predecessor's node when that is another one
        (KV.LINK, which the client pipelines after that node's puts). Returns the blocks not written:
        after one that could not be, none is kept (the client gives back what it stored past it,
        `KVClusterClient._give_back`)."""
        nearest: dict[str, bytes] = {}              # node address -> the chain's last block there
        before: SimNode | None = None
        errors = 0
        for i, key in enumerate(keys):
            node = self.route(key)
            if errors:
                errors += 1
                continue
            if i >= hits and not self.write(node, key, nearest.get(node.addr) if node else None):
                errors += 1
            elif i >= hits and before is not None and before is not node and before.services:
                before.services.cascade.link(keys[i - 1], key)
            if node is not None:
                nearest[node.addr] = key
            before = node
        return errors

    def write(self, node: SimNode | None, key: bytes, parent: bytes | None) -> bool:
        if node is None:
            return False
        try:
            node.engine.put(key, self._value, parent)
        except OutOfMemory:
            return False
        return True

    def owner_holds(self, key: bytes) -> bool:
        """Whether the node the leader's map gives ``key`` to holds it (no LRU touch)."""
        m = self.leader().cluster.map
        node = self.up(m.nodes.get(m.owner(keyslot(key))))
        return node is not None and key in node.engine.index

    def chain_held_before(self, key: bytes) -> bool:
        """Whether every block before ``key`` in its chain is at its owner: a prefix match would
        reach ``key`` (the trace's hash ids are prefix-chained: a block has one predecessor)."""
        seen = {key}                                 # a trace whose ids repeat in one prompt loops
        while (key := self.predecessor.get(key)) is not None and key not in seen:
            if not self.owner_holds(key):
                return False
            seen.add(key)
        return True

    def not_prefix(self) -> float:
        """The share of the latest chains whose cached blocks are not a prefix of them (a block
        cached after one that is not: unreachable by a prefix match)."""
        broken = 0
        for keys in self.chains:
            held = [self.owner_holds(key) for key in keys]
            broken += False in held and True in held[held.index(False):]
        return broken / max(len(self.chains), 1)

    # ------------------------------------------------------------ churn

    def moves(self) -> tuple[int, int]:
        """Values moved and dropped by every node that ever ran, as blocks."""
        stats = [n.services.moves.stats for n in self.every if n.services]
        value = self.settings.nic.value_bytes
        return (sum(s.moved_bytes for s in stats) // value, sum(s.dropped_bytes for s in stats) // value)

    def hit_ratio(self, start: float, end: float) -> tuple[float, int]:
        rows = [r for r in self.log if start <= r[0] < end]
        blocks = sum(r[1] for r in rows)
        return (sum(r[2] for r in rows) / blocks if blocks else float("nan"), sum(r[3] for r in rows))

    async def churn(self, kind: str) -> EventReport:
        """One event, measured until its after-window ends."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        before = self.leader().cluster.map
        report = EventReport(kind, t0, len(self.live), len(self.live) + (1 if kind == "join" else -1))
        etcd0, (moved0, dropped0) = replace(self.etcd.stats), self.moves()
        report.not_prefix_before = self.not_prefix()
        self.moving_keys.clear()
        if kind == "join":
            node = self.new_node()
            await node.start(self.network)
            self.live.append(node)
        else:
            node = self.leader() if kind == "crash-leader" else self.rng.choice(
                [n for n in self.live if not n.cluster.is_leader])
            self.live.remove(node)
            if kind == "leave":
                asyncio.get_running_loop().create_task(self._leave(node))
            else:
                self.network.kill(node.addr)
                report.lost_bytes = len(node.engine.index) - len(node.services.copies.held)
                await node.crash()
        report.coverage_s = await self.until(self.covered)
        report.settled_s = max(report.coverage_s, await self.until(self.settled))
        block = self.settings.nic.block_bytes
        report.to_move_bytes = len(self.moving_keys) * block
        report.kept_bytes = sum(map(self.owner_holds, self.moving_keys)) * block
        report.reachable_lost_bytes = sum(not self.owner_holds(key) and self.chain_held_before(key)
                                          for key in self.moving_keys) * block
        report.etcd = etcd_rates(etcd0, self.etcd.stats, max(report.settled_s, POLL_S))
        after = self.leader().cluster.map
        report.slots_moved = moved_slots(before, after)
        report.ideal_slots = SLOTS / max(report.nodes_before, report.nodes_after)
        report.map_bytes = len(after.to_json())
        await asyncio.sleep(max(0.0, t0 + self.settings.window_s - loop.time()))
        moved, dropped = self.moves()
        report.not_prefix_after = self.not_prefix()
        report.moved_bytes, report.dropped_bytes = (moved - moved0) * block, (dropped - dropped0) * block
        report.lost_bytes *= block
        report.hit_before, _ = self.hit_ratio(t0 - self.settings.window_s, t0)
        report.hit_after, report.errors_after = self.hit_ratio(t0, t0 + self.settings.window_s)
        return report

    async def _leave(self, node: SimNode) -> None:
        await node.leave()
        self.network.kill(node.addr)

    async def stop(self) -> None:
        for node in self.live:
            await node.crash()
        self.etcd.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@contextmanager
def scaled_batches(model: NicModel):
    """Values are stored ``block_bytes / value_bytes`` times smaller than they stand for: scale
    the move batch's byte limit alike, so a batch holds as many values as it would."""
    saved = outgoing.BATCH_BYTES
    outgoing.BATCH_BYTES = max(1, saved * model.value_bytes // model.block_bytes)
    try:
        yield
    finally:
        outgoing.BATCH_BYTES = saved


async def _simulate(settings: SimSettings) -> SimReport:
    sim = ClusterSim(settings)
    loop = asyncio.get_running_loop()
    await sim.add_nodes(settings.nodes)
    await sim.until(sim.settled)
    sim.client_map = sim.live[0].cluster.map
    total_s = settings.warmup_s + settings.gap_s * len(settings.events)
    rate = settings.rate_per_node * settings.nodes
    spec = spec_from("conversation", requests=int(rate * total_s * 1.1) + 100, rate=rate, seed=settings.seed,
                     tick_s=0.0)         # exact times: a logged trace's 3 s ticks would come as one burst
    start = loop.time()
    requests = (replace(r, arrival_s=start + r.arrival_s) for r in generate(spec))
    load = loop.create_task(sim.run_load(requests))
    await asyncio.sleep(settings.warmup_s - settings.window_s)
    steady0 = replace(sim.etcd.stats)
    await asyncio.sleep(settings.window_s)
    steady = etcd_rates(steady0, sim.etcd.stats, settings.window_s)
    steady_hit, _ = sim.hit_ratio(loop.time() - settings.window_s, loop.time())
    written = sum(r[1] - r[2] for r in sim.log if r[0] >= loop.time() - settings.window_s)
    retention_s = settings.nodes * settings.blocks_per_node * settings.window_s / max(written, 1)
    events = []
    for kind in settings.events:
        t0 = loop.time()
        events.append(await sim.churn(kind))
        await asyncio.sleep(max(0.0, t0 + settings.gap_s - loop.time()))
    load.cancel()
    sim_s = loop.time() - start
    reads = np.array([n.reads for n in sim.every], dtype=float) * settings.nic.block_bytes / sim_s / 1e9
    top = np.sort(reads)[-math.ceil(len(reads) / 100):]             # the busiest 1 % of the nodes
    hottest = sim.key_reads.most_common(1)[0][0] if sim.key_reads else b""
    report = SimReport(settings, events, steady, len(sim.log), sum(r[1] for r in sim.log),
                       sum(r[2] for r in sim.log), sum(r[3] for r in sim.log), steady_hit, retention_s,
                       (float(reads.sum() / len(sim.live)), float(reads.max()), float(top.mean())),
                       sum(n.services.copies.stats.copies_made for n in sim.every if n.services),
                       sum(n.services.copies.held.shed for n in sim.every if n.services),
                       sim.network.copies_sent[hottest], sim.key_reads[hottest] / sim_s,
                       sim.double_owned, sim.conflicts, sim_s)
    await sim.stop()
    return report


def simulate(settings: SimSettings) -> SimReport:
    """Run the whole simulation on a virtual clock; see the module docstring."""
    with scaled_batches(settings.nic):
        return run_simulated(_simulate(settings))
