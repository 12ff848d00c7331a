"""Slot moves: the leader's step and final maps, and values moving with their slots between real nodes.

The first tests run the real membership and leader logic over the in-process
etcd on virtual time (no processes). The others start `kvstore cluster up`
(a throwaway etcd and 3 node processes) plus, for a join, a 4th
`kvstore serve --cluster` process, and read INFO, logs and values.
"""
from __future__ import annotations

import asyncio
import re
import signal
import threading
import time

import numpy as np
import pytest
import redis
from redis.cluster import RedisCluster

from kvstore.admin.config import Config
from kvstore.cluster.assign import finish_moves, plan_moves, rebalance
from kvstore.cluster.fake_etcd import FakeEtcd
from kvstore.cluster.membership import InMemoryMembership
from kvstore.cluster.migration import KV_IMPORT, Migrator
from kvstore.cluster.moved_links import KV_IMPORTLINK
from kvstore.cluster.node import MOVE_GRACE, ClusterState, new_node_id
from kvstore.cluster.simclock import run_simulated
from kvstore.cluster.slots import SLOTS, SlotMap, keyslot
from kvstore.store.engine import Engine
from tests.cluster_client import SlotReader
from tests.cluster_procs import ClusterUp
from tests.conftest import wait_until

TTL = 5
BUDGET = 5.0
A, B, C = "a" * 40, "b" * 40, "c" * 40
ADDRS = {A: "127.0.0.1:7001", B: "127.0.0.1:7002", C: "127.0.0.1:7003"}


# ------------------------------------------------------------------ step and final maps


def test_a_join_plans_moves_from_live_owners_and_finishing_hands_them_over():
    two = rebalance(SlotMap.empty(), {A: ADDRS[A], B: ADDRS[B]})
    target = rebalance(two, ADDRS)
    step = plan_moves(two, target, ADDRS.keys())
    assert step.epoch == target.epoch and step.owner_list == two.owner_list     # owners keep serving
    assert step.migrating and all(dst == C for _, dst in step.migrating.values())
    assert {src for src, _ in step.migrating.values()} == {A, B}
    assert set(step.migrating) == {s for s in range(SLOTS) if two.owner(s) != target.owner(s)}
    final = finish_moves(step, ADDRS)
    assert final.epoch == step.epoch + 1 and not final.migrating
    assert final.owner_list == target.owner_list and final.nodes == target.nodes


def test_slots_of_a_dead_owner_go_at_once_and_a_draining_node_leaves_the_final_map():
    three = rebalance(SlotMap.empty(), ADDRS)
    without_c = {A: ADDRS[A], B: ADDRS[B]}
    target = rebalance(three, without_c)
    assert plan_moves(three, target, without_c.keys()) is target           # C is dead: nothing to move
    step = plan_moves(three, target, ADDRS.keys())                          # C drains: it is alive
    assert C in step.nodes and {src for src, _ in step.migrating.values()} == {C}
    final = finish_moves(step, without_c)
    assert C not in final.nodes and final.owner_list == target.owner_list
    assert SlotMap.from_json(step.to_json()).same_as(step)                  # the step is a valid map


class Sim:
    """Nodes with clean moves on an in-process etcd; ``reporting`` sources tell the leader at once."""

    def __init__(self, reporting: bool = True):
        self.store = FakeEtcd()
        self.live: list[ClusterState] = []
        self.maps: dict[int, SlotMap] = {}      # every map any node applied, by epoch
        self.reporting = reporting

    async def join(self, count: int = 1) -> list[ClusterState]:
        states = []
        for _ in range(count):
            state = ClusterState(new_node_id(), f"10.0.0.{len(self.live) + len(states) + 1}:7000",
                                 InMemoryMembership(self.store, "sim", TTL, connect_timeout=3), move_budget=BUDGET)
            state.add_listener(lambda old, new, state=state: self._seen(state, new))
            states.append(state)
        await asyncio.gather(*(s.start() for s in states))
        self.live += states
        return states

    def _seen(self, state: ClusterState, new: SlotMap) -> None:
        self.maps[new.epoch] = new
        if self.reporting and any(src == state.my_id for src, _ in new.migrating.values()):
            asyncio.get_running_loop().call_soon(self._report, state.my_id, new.epoch)

    def _report(self, node_id: str, epoch: int) -> None:
        for state in self.live:
            if state.is_leader:
                state.moves_done(node_id, epoch)

    @property
    def leader(self) -> ClusterState:
        return next(s for s in self.live if s.is_leader)

    async def until(self, predicate, limit: float) -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not predicate():
            assert loop.time() - start < limit, "timed out"
            await asyncio.sleep(0.05)
        return loop.time() - start

    def settled(self, count: int) -> bool:
        maps = [s.map for s in self.live]
        return all(m.epoch == maps[0].epoch and m.assigned == SLOTS and not m.migrating for m in maps) \
            and len(maps[0].nodes) == count

    async def close(self) -> None:
        for state in self.live:
            await state.stop()
        self.store.close()


@pytest.mark.parametrize("reporting", [True, False])
def test_a_join_goes_through_a_step_map_ended_by_the_sources_or_the_budget(reporting):
    async def scenario():
        sim = Sim(reporting)
        await sim.join(3)
        await sim.until(lambda: sim.settled(3), 2.0)
        before = sim.live[0].map
        await sim.join()
        took = await sim.until(lambda: sim.settled(4), BUDGET + MOVE_GRACE + 2)
        step, final = sim.maps[before.epoch + 1], sim.maps[before.epoch + 2]
        assert step.migrating and step.owner_list == before.owner_list and final.epoch == step.epoch + 1
        newcomer = sim.live[-1].my_id
        assert {dst for _, dst in step.migrating.values()} == {newcomer}
        assert final.counts[newcomer] == SLOTS // 4
        if reporting:
            assert took < 1.0
        else:
            assert BUDGET + MOVE_GRACE - 0.5 < took < BUDGET + MOVE_GRACE + 1.0
        await sim.close()
    run_simulated(scenario())


def test_a_drain_moves_every_slot_away_and_the_last_node_is_told_nobody_takes_them():
    async def scenario():
        sim = Sim()
        await sim.join(3)
        await sim.until(lambda: sim.settled(3), 2.0)
        leaving = next(s for s in sim.live if not s.is_leader)
        assert sim.leader.drain_node(leaving.my_id) == 2
        assert leaving.drain_node(leaving.my_id) is None                   # only the leader answers
        await sim.until(lambda: leaving.map.counts.get(leaving.my_id, 0) == 0 and not leaving.map.migrating, 1.0)
        assert leaving.my_id not in leaving.map.nodes
        sim.live.remove(leaving)
        await leaving.stop()
        await asyncio.sleep(0.5)
        assert sim.settled(2)
        others = [s for s in sim.live if not s.is_leader]
        assert sim.leader.drain_node(others[0].my_id) == 1
        assert sim.leader.drain_node(sim.leader.my_id) == 0                # the last one left to take slots
        await sim.close()
    run_simulated(scenario())


def test_a_node_dying_during_a_step_ends_it_and_its_slots_are_reassigned():
    async def scenario():
        sim = Sim(reporting=False)
        await sim.join(3)
        await sim.until(lambda: sim.settled(3), 2.0)
        (newcomer,) = await sim.join()
        await sim.until(lambda: bool(sim.live[0].map.migrating), 1.0)
        sim.live.remove(newcomer)
        await newcomer.stop(clean=False)
        took = await sim.until(lambda: sim.settled(3), TTL + 3.0)
        assert took < TTL + 1.5                 # the lease expiry ends the step, not the budget
        assert newcomer.my_id not in sim.live[0].map.nodes
        await sim.close()
    run_simulated(scenario())


# ------------------------------------------------------------------ the source and the target, in process


class ImportLinks:
    """Peer links that record KV.IMPORT batches (and the chain links pushed with them) and store everything."""

    def __init__(self):
        self.batches: list[list[bytes]] = []
        self.links: list[tuple[bytes, bytes]] = []

    def link(self, addr: str):
        links = self

        class Link:
            async def pipeline(self, commands):
                (command, epoch, *args), *rest = commands
                assert command == KV_IMPORT and all(c[0] == KV_IMPORTLINK for c in rest)
                links.batches.append([bytes(a) for a in args])
                for _, *pairs in rest:
                    links.links += [(bytes(p), bytes(c)) for p, c in zip(pairs[0::2], pairs[1::2])]
                values = args[3::4]
                return [[len(values), sum(len(v) for v in values)], *(len(c) // 2 for c in rest)]
        return Link()


def source(budget: float = 5.0, heat=None):
    engine = Engine(8 * 1024 * 1024, prefault=False)
    cluster = ClusterState(A, ADDRS[A])
    cluster.apply(SlotMap.build(1, ADDRS, [A] * SLOTS))
    links = ImportLinks()
    moves = Migrator(engine, cluster, links, lambda: Config(cluster_move_budget=budget),
                     lambda: heat or {})
    moves.attach()
    return engine, cluster, moves, links


def step_to(cluster: ClusterState, target: str) -> None:
    cluster.apply(SlotMap.build(2, ADDRS, [A] * SLOTS, {slot: (A, target) for slot in range(SLOTS)}))


def test_a_source_sends_the_hottest_values_first_then_the_newest_and_forgets_them():
    async def scenario():
        keys = [b"key-%02d" % i for i in range(20)]
        engine, cluster, moves, links = source(heat={keys[5]: 3, keys[12]: 9, b"not-here": 50})
        for key in keys:
            engine.put(key, key * 10, parent=keys[0] if key != keys[0] else None)
        step_to(cluster, B)
        await asyncio.sleep(0.1)
        sent = [args[0::4] for args in links.batches]
        assert sent == [[keys[12], keys[5]] + [k for k in reversed(keys) if k not in (keys[5], keys[12])]]
        batch = links.batches[0]
        assert batch[3] == keys[12] * 10 and batch[1] == keys[0]            # value and chain parent
        assert batch[2] == b""                                              # written to the shared pool
        assert engine.index == {} and moves.stats.moved_keys == 20 and moves.stats.dropped_keys == 0
        assert moves.stats.moved_bytes == sum(len(k) * 10 for k in keys)
    run_simulated(scenario())


def test_values_past_the_budget_are_dropped_and_counted_not_sent():
    async def scenario():
        engine, cluster, moves, links = source(budget=0.0)
        for i in range(10):
            engine.put(b"k%d" % i, b"v" * 100)
        step_to(cluster, B)
        await asyncio.sleep(0.1)
        assert links.batches == [] and engine.index == {}
        assert (moves.stats.dropped_keys, moves.stats.dropped_bytes, moves.stats.moved_bytes) == (10, 1000, 0)
    run_simulated(scenario())


def test_a_target_takes_pushed_values_only_where_nothing_newer_was_written():
    async def scenario():
        engine = Engine(8 * 1024 * 1024, prefault=False)
        cluster = ClusterState(B, ADDRS[B])
        cluster.apply(SlotMap.build(1, ADDRS, [A] * SLOTS))
        moves = Migrator(engine, cluster, ImportLinks(), lambda: Config(cluster_move_budget=5), dict)
        moves.attach()
        assert not moves.accepts(b"k")                                   # nothing is coming in yet
        step_to(cluster, B)
        engine.put(b"written", b"new")                                   # a write that came with ASKING
        engine.put(b"deleted", b"x")
        engine.delete(b"deleted")
        with moves.storing():
            engine.put(b"pushed", b"p")
        assert moves.accepts(b"fresh") and moves.accepts(b"pushed") is False   # present (already pushed)
        assert not moves.accepts(b"written") and not moves.accepts(b"deleted")
        cluster.apply(finish_moves(cluster.map, ADDRS))                  # the slots are ours now
        assert moves.accepts(b"fresh") and not moves.accepts(b"deleted")
        moves.guard.expire(time.monotonic() + 60)
        assert not moves.accepts(b"fresh")                               # the window closed
    run_simulated(scenario())


# ------------------------------------------------------------------ real nodes


def owner_of(conn: redis.Redis, key: bytes) -> str:
    slot = keyslot(key)
    for first, last, node, *_ in conn.execute_command("CLUSTER SLOTS"):
        if first <= slot <= last:
            return f"{node[0].decode()}:{node[1]}"
    raise AssertionError("slot not served")


def connect(addr: str, **kw) -> redis.Redis:
    host, port = addr.rsplit(":", 1)
    return redis.Redis(host=host, port=int(port), socket_timeout=10, **kw)


def value_of(key: bytes, size: int = 64 * 1024) -> bytes:
    seed = int.from_bytes(key[-4:].rjust(4, b"0"), "big")
    return np.random.default_rng(seed).bytes(size)


def write_keys(cluster: RedisCluster, count: int) -> list[bytes]:
    keys = [b"blk:%05d" % i for i in range(count)]
    for key in keys:
        cluster.set(key, value_of(key))
    return keys


def info(addr: str) -> dict:
    return connect(addr).info("cluster")


def joined(addr: str, nodes: int) -> bool:
    """The node at ``addr`` serves slots of a map of ``nodes`` nodes with no slot moving."""
    fields = info(addr)
    if not fields["cluster_enabled"]:
        return False                    # still joining
    known = connect(addr).execute_command("CLUSTER NODES")         # redis-py parses it: addr -> fields
    return len(known) == nodes and not any(node["migrations"] for node in known.values()) \
        and fields["cluster_imported_keys"] > 0


def cluster_client(up: ClusterUp) -> RedisCluster:
    host, port = up.addrs[0]
    return RedisCluster(host=host, port=port, socket_timeout=10)


def test_a_joining_node_receives_the_values_of_its_slots_hottest_first(cluster_factory):
    """... and each value still counts against the quota of the tenant that wrote it."""
    up = cluster_factory(3, extra=("--node-timeout", "2", "--", "--hot-reads", "0"))
    for h, p in up.addrs:
        connect(f"{h}:{p}").execute_command("ACL", "SETUSER", "alice", "on", ">pa", "~alice:*", "+@all")
        connect(f"{h}:{p}").execute_command("ACL", "SETUSER", "alice", "quota-dram=1mb")
    rc = cluster_client(up)
    keys = write_keys(rc, 300)
    alice_keys = [b"alice:%05d" % i for i in range(60)]
    alice = RedisCluster(host=up.addrs[0][0], port=up.addrs[0][1], username="alice", password="pa", socket_timeout=10)
    for key in alice_keys:
        alice.set(key, value_of(key))
    hot = keys[:20]
    for _ in range(3):
        for key in hot:
            rc.get(key)
    joiner = cluster_factory.join(up, "--cluster-node-timeout", "2", "--hot-reads", "0")
    addr = f"127.0.0.1:{joiner.port}"
    wait_until(lambda: joined(addr, 4), what="the join")
    mine = [k for k in keys if owner_of(connect(addr), k) == addr]
    alices = [k for k in alice_keys if owner_of(connect(addr), k) == addr]
    assert len(mine) > 30 and alices
    got = connect(addr).info("cluster")
    moved = sum(info(f"{h}:{p}")["cluster_moved_bytes"] for h, p in up.addrs)
    assert got["cluster_imported_keys"] == len(mine) + len(alices) and got["cluster_imported_bytes"] == moved
    assert sum(info(f"{h}:{p}")["cluster_dropped_bytes"] for h, p in up.addrs) == 0
    plain = connect(addr)
    assert all(plain.get(k) == value_of(k) for k in mine)      # every value came along, intact
    rc2 = cluster_client(up)
    assert all(rc2.get(k) == value_of(k) for k in keys)
    everywhere = [addr] + [f"{h}:{p}" for h, p in up.addrs]     # moved values left their sources
    assert sum(connect(a).dbsize() for a in everywhere) == len(keys) + len(alice_keys)
    assert connect(addr).info("tenants")["tenant_alice"]["used_dram"] == len(alices) * 64 * 1024
    assert sum(connect(a).info("tenants")["tenant_alice"]["used_dram"] for a in everywhere) \
        == len(alice_keys) * 64 * 1024


def test_readers_during_a_join_and_a_drain_see_right_values_or_misses_never_errors(cluster_factory):
    up = cluster_factory(3, extra=("--node-timeout", "2", "--", "--hot-reads", "0"))
    keys = write_keys(cluster_client(up), 200)
    stop, wrong, errors, reads = threading.Event(), [], [], [0]

    def read_loop():
        reader = SlotReader([f"{h}:{p}" for h, p in up.addrs])
        while not stop.is_set():
            for key in keys:
                try:
                    value = reader.get(key)
                except redis.ConnectionError:
                    # The node that left: a cluster client forgets what it knew and asks again.
                    reader.owners.clear()
                    try:
                        value = reader.get(key)
                    except Exception as e:
                        errors.append(repr(e))
                        continue
                except Exception as e:          # any other failure counts (a dead reader would hide it)
                    errors.append(repr(e))
                    continue
                reads[0] += 1
                if value is not None and value != value_of(key):
                    wrong.append(key)

    reader = threading.Thread(target=read_loop)
    reader.start()
    try:
        joiner = cluster_factory.join(up, "--cluster-node-timeout", "2")
        addr = f"127.0.0.1:{joiner.port}"
        wait_until(lambda: joined(addr, 4), what="the join")
        time.sleep(0.5)
        assert joiner.stop(signal.SIGTERM, 20) == 0
    finally:
        stop.set()
        reader.join()
    assert reads[0] > len(keys) and wrong == [] and errors == []
    log = joiner.log()
    moved = re.search(r"Drained in [\d.]+ s: (\d+) bytes moved, (\d+) bytes dropped", log)
    assert moved and int(moved[1]) > 0 and int(moved[2]) == 0, log[-2000:]
    assert "Left cluster" in log
    rc = cluster_client(up)
    assert all(rc.get(k) == value_of(k) for k in keys)          # all back on the three, intact


def test_a_drained_node_moves_the_values_it_had_demoted_to_ssd(tmp_path, cluster_factory):
    """A node with 2 MB of DRAM and an SSD tier holds values that went down to SSD; drained with
    SIGTERM, it sends them too: each is read back from its new owner, byte for byte."""
    up = cluster_factory(3, extra=("--node-timeout", "2", "--", "--hot-reads", "0"))
    write_keys(cluster_client(up), 100)
    joiner = cluster_factory.join(up, "--cluster-node-timeout", "2", "--hot-reads", "0",
                                  "--dram-size", "2mb", "--ssd-dir", str(tmp_path / "ssd"))
    addr = f"127.0.0.1:{joiner.port}"
    wait_until(lambda: joined(addr, 4), what="the join")
    node = connect(addr)
    mine = [k for k in (b"ssd:%05d" % i for i in range(400)) if owner_of(node, k) == addr][:60]
    for key in mine:
        node.set(key, value_of(key))
    wait_until(lambda: node.info("ssd")["ssd_values"] >= len(mine) // 2, what="demotion to SSD")
    assert joiner.stop(signal.SIGTERM, 20) == 0
    log = joiner.log()
    moved = re.search(r"Drained in [\d.]+ s: (\d+) bytes moved, (\d+) bytes dropped", log)
    assert moved and int(moved[1]) >= len(mine) * 64 * 1024 and int(moved[2]) == 0, log[-2000:]
    rc = cluster_client(up)
    assert [k for k in mine if rc.get(k) != value_of(k)] == []


def test_a_moves_budget_is_a_dram_over_the_configured_nic_and_at_least_the_setting():
    """1.5 x DRAM / NIC (--cluster-nic-gbps, read live as CONFIG SET changes it), at least
    --cluster-move-budget, and nothing moves with a budget of 0."""
    config = Config(cluster_move_budget=5.0, cluster_nic_gbps=100.0)
    engine = Engine(64 * 1024 * 1024, prefault=False)
    moves = Migrator(engine, ClusterState(A, ADDRS[A]), ImportLinks(), lambda: config, dict)
    assert moves.budget == 5.0                              # 64 MiB over 100 Gbit/s: far under 5 s
    config.cluster_nic_gbps = 0.1                           # 64 MiB at 12.5 MB/s: 5.4 s, times 1.5
    assert moves.budget == pytest.approx(1.5 * 64 * 1024 * 1024 / 12.5e6)
    config.cluster_move_budget = 0
    assert moves.budget == 0.0


def test_pushed_values_keep_the_sources_order_of_heat_when_the_receiver_fills():
    """A move pushes the hottest first; the receiver's LRU must then evict the last pushed
    first, not the first (ImportStamps), and keep what is written during the step newest."""
    from kvstore.cluster.migration import ImportStamps
    engine = Engine(16 * 2**20, prefault=False)
    try:
        engine.put(b"before", b"b" * 2**20)
        stamps = ImportStamps(engine.eviction)
        pushed = [b"pushed-%02d" % i for i in range(12)]            # hottest first
        for key in pushed:
            engine.put(key, b"p" * 2**20)
            stamps.stamp(7, engine.lookup(key))
        engine.put(b"written", b"w" * 2**20)
        for i in range(4):                                          # the receiver overflows
            engine.put(b"later-%d" % i, b"l" * 2**20)
        left = set(engine.index)
        assert b"before" not in left and b"written" in left
        kept = [key in left for key in pushed]
        assert kept[0] and not kept[-1] and kept == sorted(kept, reverse=True)     # the last pushed went
    finally:
        engine.close()
