"""The real membership and leader logic over the in-process etcd, on virtual time.

Every test runs nodes with production ttls (5 s) on `VirtualClockLoop`: lease
expiries and elections take simulated seconds and real milliseconds.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from kvstore.cluster.assign import moved_slots
from kvstore.cluster.fake_etcd import FakeEtcd
from kvstore.cluster.kv import Put, Unavailable
from kvstore.cluster.membership import ClusterError, InMemoryMembership
from kvstore.cluster.node import ClusterState, new_node_id
from kvstore.cluster.simclock import run_simulated
from kvstore.cluster.slots import SLOTS, SlotMap

TTL = 5


class Sim:
    """A fake etcd and the nodes joined to it; checks that no epoch ever means two maps."""

    def __init__(self, store: FakeEtcd | None = None):
        self.store = store or FakeEtcd()
        self.live: list[ClusterState] = []
        self.maps_by_epoch: dict[int, SlotMap] = {}
        self.conflicts: list[int] = []          # epochs seen with two different maps
        self.address = 0

    def node(self, announce: str | None = None) -> ClusterState:
        self.address += 1
        state = ClusterState(new_node_id(), announce or f"10.0.0.{self.address}:7000",
                             InMemoryMembership(self.store, "sim", TTL, connect_timeout=3))
        state.add_listener(self._record)
        return state

    def _record(self, old: SlotMap, new: SlotMap) -> None:
        if not self.maps_by_epoch.setdefault(new.epoch, new).same_as(new):
            self.conflicts.append(new.epoch)

    async def join(self, count: int = 1) -> list[ClusterState]:
        states = [self.node() for _ in range(count)]
        await asyncio.gather(*(s.start() for s in states))
        self.live += states
        return states

    async def remove(self, state: ClusterState, clean: bool) -> None:
        self.live.remove(state)
        await state.stop(clean=clean)

    def converged(self) -> bool:
        ids = {s.my_id for s in self.live}
        epochs = {s.map.epoch for s in self.live}
        return (len(epochs) == 1 and all(s.ok and set(s.map.nodes) == ids for s in self.live)
                and sum(s.is_leader for s in self.live) == 1)

    async def settle(self, limit: float) -> float:
        """Simulated seconds until every live node holds the same full map of the live nodes."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not self.converged():
            assert loop.time() - start < limit, "the cluster did not converge in time"
            await asyncio.sleep(0.05)
        return loop.time() - start

    async def close(self) -> None:
        for state in list(self.live):
            await self.remove(state, clean=True)
        self.store.close()
        assert self.conflicts == []


def test_nodes_starting_together_get_one_even_map():
    async def scenario():
        sim = Sim()
        await sim.join(16)
        await sim.settle(1.0)
        states = sim.live
        assert {s.map.epoch for s in states} == {1}                 # one map for the whole burst
        counts = states[0].map.counts.values()
        assert max(counts) - min(counts) <= 1
        assert sum(s.mine.count(1) for s in states) == SLOTS        # every slot served exactly once
        await sim.close()
    run_simulated(scenario())


def test_churn_keeps_one_map_per_epoch_and_minimal_moves():
    async def scenario():
        sim = Sim()
        rng = random.Random(5)
        await sim.join(8)
        await sim.settle(1.0)
        for _ in range(30):
            before = sim.live[0].map
            size = len(sim.live)
            action = rng.choice(["join", "leave", "crash"] if size > 3 else ["join"])
            if action == "join":
                await sim.join()
            else:
                await sim.remove(rng.choice(sim.live), clean=action == "leave")
            took = await sim.settle(TTL + 2.0)
            if action != "crash":
                assert took < 1.0                   # joins and clean leaves need no lease expiry
            after = sim.live[0].map
            assert after.epoch > before.epoch
            assert moved_slots(before, after) <= 1.2 * SLOTS / max(size, len(sim.live))
        await sim.close()
    run_simulated(scenario())


def test_leader_crash_elects_another_that_reassigns():
    async def scenario():
        sim = Sim()
        await sim.join(5)
        await sim.settle(1.0)
        leader = next(s for s in sim.live if s.is_leader)
        await sim.remove(leader, clean=False)
        took = await sim.settle(TTL + 2.0)
        assert TTL - 2 < took <= TTL + 1.0          # the lease had to expire first
        assert leader.my_id not in sim.live[0].map.nodes
        await sim.close()
    run_simulated(scenario())


def test_a_leader_change_costs_a_campaign_or_two_not_one_per_node():
    """Nodes campaign in turn (rank x CAMPAIGN_STEP after the key went), so 40 nodes do not all try."""
    async def scenario():
        sim = Sim()
        await sim.join(40)
        await sim.settle(1.0)
        leader = next(s for s in sim.live if s.is_leader)
        txns, failed = sim.store.stats.txns, sim.store.stats.txns_failed
        await sim.remove(leader, clean=False)
        took = await sim.settle(TTL + 2.0)
        assert took <= TTL + 1.0                               # the first in line campaigns at once
        assert sim.store.stats.txns - txns <= 3                # its campaign and the map
        assert sim.store.stats.txns_failed - failed <= 1
        await sim.close()
    run_simulated(scenario())


def test_outage_freezes_the_map_and_nodes_catch_up_after():
    async def scenario():
        sim = Sim()
        await sim.join(4)
        await sim.settle(1.0)
        epoch = sim.live[0].map.epoch
        sim.store.set_available(False)
        victim = sim.live[-1]
        await sim.remove(victim, clean=False)        # dies while etcd is down
        await asyncio.sleep(3 * TTL)
        assert all(s.map.epoch == epoch and s.ok for s in sim.live)
        assert not any(s.membership.reachable for s in sim.live)
        sim.store.set_available(True)
        took = await sim.settle(TTL + 3.0)            # its lease restarts its ttl when etcd is back
        assert took >= TTL - 1
        assert all(s.membership.reachable for s in sim.live)
        assert victim.my_id not in sim.live[0].map.nodes
        await sim.close()
    run_simulated(scenario())


async def staggered(sim: Sim, count: int) -> None:
    """Nodes joined apart, so their keep-alives (and their returns after a stall) are out of phase."""
    for _ in range(count):
        await sim.join()
        await asyncio.sleep(0.55)
    await sim.settle(1.0)


@pytest.mark.parametrize("dies", [False, True])
def test_an_etcd_stall_past_every_lease_moves_no_slot(dies):
    """A paused etcd lets every lease lapse and deletes every registration when it resumes: nodes
    register again within the grace and keep their slots; a node that died meanwhile loses its own
    once the grace is over."""
    async def scenario():
        sim = Sim()
        await staggered(sim, 5)
        loop = asyncio.get_running_loop()
        before, epochs = sim.live[0].map, set(sim.maps_by_epoch)
        sim.store.set_available(False)
        if dies:
            victim = sim.live[2]
            await sim.remove(victim, clean=False)
        await asyncio.sleep(3 * TTL)
        sim.store.set_available(True, lapse=True)
        resumed = loop.time()
        await asyncio.sleep(0.6)
        assert sim.store.stats.expired >= 5                  # every lease lapsed, no node failed
        grace = sim.live[0].membership.grace
        if not dies:
            await asyncio.sleep(grace + TTL)
            assert all(s.map is before or s.map.same_as(before) for s in sim.live)
            assert set(sim.maps_by_epoch) == epochs             # no map written meanwhile
            assert sim.converged()
        else:
            took = await sim.settle(grace + TTL + 2.0)
            after = sim.live[0].map
            assert victim.my_id not in after.nodes
            assert moved_slots(before, after) == before.counts[victim.my_id]     # its slots only
            assert loop.time() - resumed >= grace - 1.0      # not before the others could return
            assert took <= grace + TTL / 3 + 2.0
        await sim.close()
    run_simulated(scenario())


@pytest.mark.parametrize("history", [1000, 3])
def test_a_broken_watch_resumes_without_missing_events(caplog, history):
    """With history kept the watch resumes at the next revision; once compacted the node reads everything."""
    async def scenario():
        sim = Sim(FakeEtcd(history=history))
        await sim.join(3)
        await sim.settle(1.0)
        deaf = sim.live[0]
        for watch in [w for w in sim.store.watches if w.client is deaf.membership.kv]:
            sim.store.watches.discard(watch)                        # one node's stream breaks
            watch.queue.put_nowait(Unavailable("stream reset"))
        await sim.join(4)                                           # history moves past what it saw
        await sim.settle(2.0)
        assert deaf.map.epoch == sim.live[-1].map.epoch and len(deaf.nodes) == 7
        await sim.close()
    run_simulated(scenario())
    assert ("Watch history is compacted" in caplog.text) == (history == 3)


def test_a_second_node_on_a_live_address_is_refused():
    async def scenario():
        sim = Sim()
        (first,) = await sim.join()
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(ClusterError, match=f"address {first.announce} is already announced by node {first.my_id}"):
            await sim.node(first.announce).start()
        assert loop.time() - start <= TTL + 2
        await sim.close()
    run_simulated(scenario())


def test_a_restarted_node_gets_its_address_back_once_the_old_lease_expires():
    async def scenario():
        sim = Sim()
        (old,) = await sim.join()
        await sim.remove(old, clean=False)
        again = sim.node(old.announce)
        await again.start()
        sim.live.append(again)
        await sim.settle(TTL + 2.0)
        assert set(again.map.nodes) == {again.my_id}
        await sim.close()
    run_simulated(scenario())


def test_unreachable_etcd_at_start_fails_after_the_connect_timeout():
    async def scenario():
        sim = Sim()
        sim.store.set_available(False)
        loop = asyncio.get_running_loop()
        with pytest.raises(ClusterError, match="cannot reach in-memory etcd for cluster 'sim' within 3 s"):
            await sim.node().start()
        assert 3 <= loop.time() < 4
    run_simulated(scenario())


@pytest.mark.parametrize("bad", [b"garbage", "lower epoch"])
def test_a_bad_map_in_etcd_is_refused_and_the_leader_writes_a_newer_one(bad):
    async def scenario():
        sim = Sim()
        await sim.join(3)
        await sim.settle(1.0)
        good = sim.live[0].map
        raw = SlotMap.build(0, {}, [None] * SLOTS).to_json() if bad == "lower epoch" else bad
        await sim.store.client().txn([], [Put(b"/kvstore/sim/slotmap", raw),
                                          Put(b"/kvstore/sim/mapchange", b"not a record for it")])
        await sim.settle(1.0)
        await asyncio.sleep(0.5)
        repaired = sim.live[0].map
        assert repaired.epoch == good.epoch + 1 and repaired.owner_list == good.owner_list
        assert all(s.refused == 1 for s in sim.live)
        await sim.close()
    run_simulated(scenario())


def test_node_entries_written_by_others_are_checked():
    async def scenario():
        sim = Sim()
        await sim.join(2)
        await sim.settle(1.0)
        client = sim.store.client()
        await client.txn([], [Put(b"/kvstore/sim/nodes/not-an-id", b"10.9.9.9:1"),
                              Put(b"/kvstore/sim/nodes/" + b"f" * 40, b"no port")])
        await asyncio.sleep(1.0)
        assert sim.converged() and len(sim.live[0].map.nodes) == 2
        await sim.close()
    run_simulated(scenario())


def test_a_join_reaches_the_leader_and_then_every_node_once_through_the_map():
    """Followers watch the map's change record and the leader key; only the leader watches the
    registrations, so a join costs O(N) watch events across the cluster (its node key to the
    leader, the record of the map's change to all), each under 200 bytes."""
    async def scenario():
        sim = Sim()
        await sim.join(20)
        await sim.settle(1.0)
        leader = next(s for s in sim.live if s.is_leader)
        watching = {}
        for watch in sim.store.watches:
            watching.setdefault(watch.client, set()).add(watch.prefix.rpartition(b"/sim/")[2])
        for state in sim.live:
            expected = {b"mapchange", b"leader"} | ({b"nodes/"} if state is leader else set())
            assert watching[state.membership.kv] == expected
        events, delivered = sim.store.stats.watch_events, sim.store.stats.watch_bytes
        await sim.join()
        await sim.settle(1.0)
        await asyncio.sleep(0.5)
        assert sim.store.stats.watch_events - events <= 1 + len(sim.live)   # was 3 per node
        assert sim.store.stats.watch_bytes - delivered <= 200 * (1 + len(sim.live))  # a record, not the map
        assert all(s.map.same_as(leader.map) for s in sim.live)
        assert all(s.nodes == s.map.nodes for s in sim.live if s is not leader)
        assert leader.nodes.keys() == leader.map.nodes.keys()
        await sim.close()
    run_simulated(scenario())
