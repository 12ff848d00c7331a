"""The eviction cascade across nodes (kvstore/cluster/cascade.py, KV.LINK / KV.CASCADE).

The unit tests run `Cascade` on a real `Engine` and a `ClusterState` fed a map
by hand (this node owns the lower half of the slots, another node the upper
half), with a recording stand-in for the peer links. The integration tests
start `kvstore cluster up` (a throwaway etcd and 3 node processes) and write
chains through `KVClusterClient`, whose batch puts send the links.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest
import redis

from client import KVClusterClient
from kvstore.admin.config import Config
from kvstore.cluster.cascade import DROPS_PER_TICK, KV_CASCADE, KV_UPLINK, LINKS_PER_KEY, Cascade, now_us
from kvstore.cluster.migration import Migrator
from kvstore.cluster.moved_links import MovedLinks
from kvstore.cluster.node import ClusterState
from kvstore.cluster.peer import PeerError
from kvstore.cluster.slots import SLOTS, SlotMap, keyslot
from kvstore.store.engine import Engine
from loadtest.bench_cluster import cascades_settled
from proto.wire import KV_LINK_MAX
from tests.conftest import WAIT_S, wait_until

A, B = "a" * 40, "b" * 40
NODES = {A: "10.0.0.1:7000", B: "10.0.0.2:7000"}
MiB = 1024 * 1024


def keys_of(owner: str, prefix: bytes, count: int) -> list[bytes]:
    """``count`` keys whose slots ``owner`` serves in the map of `node`."""
    half = SLOTS // 2
    found, i = [], 0
    while len(found) < count:
        key = prefix + b"%d" % i
        if (keyslot(key) < half) == (owner == A):
            found.append(key)
        i += 1
    return found


class Links:
    """Peer links that record each pipelined command (KV.UPLINK apart, in ``uplinks``); ``down``
    addresses fail as a dead node does."""

    def __init__(self):
        self.sent: list[tuple[str, tuple]] = []
        self.uplinks: list[tuple[str, tuple]] = []
        self.down: set[str] = set()

    def link(self, addr: str):
        links = self

        class Link:
            async def pipeline(self, commands):
                if addr in links.down:
                    raise PeerError(f"node {addr} is unreachable")
                for command in commands:
                    (links.uplinks if command[0] == KV_UPLINK else links.sent).append((addr, tuple(command)))
                return [len(command) - 2 for command in commands]
        return Link()


def node() -> tuple[Engine, Cascade, Links]:
    """A cascade on node A, which serves the lower half of the slots (B the upper half)."""
    engine = Engine(4 * MiB, prefault=False)
    cluster = ClusterState(A, NODES[A])
    cluster.apply(SlotMap.build(1, NODES, [A] * (SLOTS // 2) + [B] * (SLOTS // 2)))
    links = Links()
    cascade = Cascade(engine, cluster, links)
    cascade.attach()
    return engine, cascade, links


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


# ------------------------------------------------------------------ the engine's final drops


def test_final_drop_listeners_hear_deletes_evictions_and_expiry_but_not_a_replaced_value():
    engine = Engine(2 * MiB, prefault=False)
    heard = []
    engine.final_drop_listeners.append(lambda slot, key: heard.append(key))
    engine.put(b"k", b"v" * 100)
    engine.put(b"k", b"w" * 100)                # in place
    engine.put(b"k", b"x" * 300_000)            # a new extent replaces the old one
    assert heard == []
    engine.delete(b"k")
    engine.put(b"e", b"v")
    engine.expiry.set(b"e", 1)
    assert engine.lookup(b"e") is None
    for i in range(3):                          # 3 x 1 MiB chunks into 2 MiB: the oldest goes
        engine.put(b"big%d" % i, bytes(600_000))
    assert heard == [b"k", b"e", b"big0"]


# ------------------------------------------------------------------ Cascade on a real engine


def test_a_final_drop_sends_its_remote_children_to_their_owner_in_one_batch():
    async def scenario():
        engine, cascade, links = node()
        parents, children = keys_of(A, b"p", 2), keys_of(B, b"c", 3)
        for parent in parents:
            engine.put(parent, b"v" * 100)
        assert [cascade.link(parents[0], c) for c in children[:2]] == [True, True]
        assert cascade.link(parents[0], children[0]) is False          # already there
        assert cascade.link(parents[1], children[2]) is True
        assert cascade.link(b"absent", children[0]) is False
        assert cascade.info()["cluster_cascade_links"] == 3
        before = now_us()
        engine.delete(parents[0])
        engine.delete(parents[1])
        await settle()
        [(addr, command)] = links.sent
        assert addr == NODES[B] and command[0] == KV_CASCADE and command[2:] == tuple(children)
        assert before <= command[1] <= now_us()
        info = cascade.info()
        assert info["cluster_cascade_links"] == 0 and info["cluster_cascade_sent"] == 3
        assert info["cluster_cascade_pending"] == 0
    asyncio.run(scenario())


# ------------------------------------------------------------------ a dead node's links (KV.UPLINK)


C = "c" * 40


def node_of_three() -> tuple[Engine, Cascade, Links, ClusterState]:
    """A cascade on node A in a map of A, B and C: A the first third of the slots, B the second, C the rest."""
    engine = Engine(4 * MiB, prefault=False)
    cluster = ClusterState(A, NODES[A])
    nodes = {**NODES, C: "10.0.0.3:7000"}
    third = SLOTS // 3
    cluster.apply(SlotMap.build(1, nodes, [A] * third + [B] * third + [C] * (SLOTS - 2 * third)))
    links = Links()
    cascade = Cascade(engine, cluster, links)
    cascade.attach()
    return engine, cascade, links, cluster


def key_in(lo: int, hi: int, prefix: bytes) -> bytes:
    return next(key for key in (prefix + b"%d" % i for i in range(100_000)) if lo <= keyslot(key) < hi)


def test_a_link_is_told_to_the_childs_node():
    async def scenario():
        engine, cascade, links = node()
        parent, child = keys_of(A, b"p", 1)[0], keys_of(B, b"c", 1)[0]
        engine.put(parent, b"v" * 100)
        assert cascade.link(parent, child)
        await settle()
        assert links.uplinks == [(NODES[B], (KV_UPLINK, keyslot(parent), child))] and links.sent == []
    asyncio.run(scenario())


def test_children_of_a_dead_nodes_blocks_go_when_the_map_drops_it_and_not_after_a_clean_leave():
    """B died: the map that takes its slots without a move drops what A noted under them (and
    what follows those here); C left cleanly (its slots moved in a step first): nothing goes."""
    async def scenario():
        engine, cascade, links, cluster = node_of_three()
        third = SLOTS // 3
        after_b = [key_in(0, third, b"after-b-%d-" % i) for i in range(2)]
        after_c = key_in(0, third, b"after-c-")
        tail = key_in(0, third, b"tail-")
        for key in (*after_b, after_c, tail):
            engine.put(key, b"v" * 100)
        engine.put(tail, b"v" * 100, parent=after_b[0])                 # a local block after it
        b_slot, c_slot = key_in(third, 2 * third, b"pb"), key_in(2 * third, SLOTS, b"pc")
        assert [cascade.uplink(keyslot(b_slot), k) for k in after_b] == [True, True]
        assert cascade.uplink(keyslot(c_slot), after_c) and not cascade.uplink(keyslot(c_slot), after_c)
        assert cascade.info()["cluster_cascade_uplinks"] == 3
        nodes = dict(cluster.map.nodes)
        step = SlotMap.build(2, nodes, cluster.map.owner_list,
                             migrating={s: (C, A) for s in range(2 * third, SLOTS)})
        cluster.apply(step)                                              # C leaves cleanly: a step
        del nodes[C]
        cluster.apply(SlotMap.build(3, nodes, [A] * third + [B] * third + [A] * (SLOTS - 2 * third)))
        await settle()
        assert engine.lookup(after_c) is not None, "a clean leave moved the block before it"
        del nodes[B]
        cluster.apply(SlotMap.build(4, nodes, [A] * SLOTS))             # B died: no step
        await settle()
        assert [engine.lookup(k) for k in (*after_b, tail)] == [None, None, None]
        assert engine.lookup(after_c) is not None and cascade.info()["cluster_cascade_uplinks"] == 1
        engine.delete(after_c)
        assert cascade.info()["cluster_cascade_uplinks"] == 0            # its note went with it
    asyncio.run(scenario())


def test_a_note_that_comes_before_its_child_waits_for_the_childs_commit():
    async def scenario():
        engine, cascade, links = node()
        child = keys_of(A, b"early", 1)[0]
        assert cascade.uplink(7, child) is False and cascade.info()["cluster_cascade_uplinks"] == 0
        engine.put(child, b"v" * 100)
        assert cascade.uplink_of == {child: 7} and not cascade.pending_up
    asyncio.run(scenario())


def test_a_re_put_of_the_parent_keeps_its_links_and_cascades_nothing():
    async def scenario():
        engine, cascade, links = node()
        parent, child = keys_of(A, b"p", 1)[0], keys_of(B, b"c", 1)[0]
        engine.put(parent, b"v" * 100)
        cascade.link(parent, child)
        engine.put(parent, b"w" * 100)                  # in place
        engine.put(parent, b"x" * 300_000)              # a new value replaces it
        await settle()
        assert links.sent == [] and cascade.link_count == 1
        engine.delete(parent)
        await settle()
        assert [command[2:] for _, command in links.sent] == [(child,)]
    asyncio.run(scenario())


def test_local_descendants_go_too_a_bounded_number_per_loop_tick():
    async def scenario():
        engine, cascade, links = node()
        head, *rest = keys_of(A, b"n", 1 + 3 * DROPS_PER_TICK)
        engine.put(head, b"h")
        chain = rest[:DROPS_PER_TICK]                   # a chain under the head ...
        for parent, key in zip([head, *chain], chain):
            engine.put(key, b"c", parent=parent)
        for key in rest[DROPS_PER_TICK:]:               # ... and many children of it
            engine.put(key, b"w", parent=head)
        engine.delete(head)
        await asyncio.sleep(0)
        assert cascade.stats.dropped <= DROPS_PER_TICK  # the loop serves clients in between
        for _ in range(2 * DROPS_PER_TICK):
            await asyncio.sleep(0)
        assert len(engine.index) == 0 and cascade.stats.dropped == 3 * DROPS_PER_TICK
    asyncio.run(scenario())


def test_a_cascade_never_drops_a_value_written_after_the_drop_that_started_it():
    async def scenario():
        engine, cascade, links = node()
        fresh, stale = keys_of(A, b"k", 2)
        dropped_at = now_us()
        time.sleep(0.002)
        engine.put(fresh, b"rewritten after the drop")
        assert cascade.receive(dropped_at, [fresh]) == 1
        await settle()
        assert engine.lookup(fresh) is not None and cascade.stats.kept_fresh == 1
        engine.put(stale, b"written before the drop")
        assert cascade.receive(now_us() + 1, [stale]) == 1
        await settle()
        assert engine.lookup(stale) is None and cascade.stats.dropped == 1
    asyncio.run(scenario())


def test_a_value_rewritten_in_place_after_the_drop_is_kept_too():
    async def scenario():
        engine, cascade, links = node()
        key = keys_of(A, b"k", 1)[0]
        engine.put(key, b"v" * 100)
        while cascade.commits:                          # its commit time is forgotten ...
            cascade.commits.popitem()
        dropped_at = now_us()
        time.sleep(0.002)
        engine.put(key, b"w" * 100)                     # ... and a re-put of the same size goes in place
        assert cascade.receive(dropped_at, [key]) == 1
        await settle()
        assert engine.lookup(key) is not None and cascade.stats.kept_fresh == 1
    asyncio.run(scenario())


def test_a_batch_carries_its_earliest_drop_time():
    async def scenario():
        engine, cascade, links = node()
        later, earlier = keys_of(B, b"c", 2)
        cascade._send_later(later, 2_000)
        cascade._send_later(earlier, 1_000)           # a cascade received from a node whose drop was earlier
        await settle()
        [(_, command)] = links.sent
        assert command[1] == 1_000
    asyncio.run(scenario())


def test_after_close_queued_drops_and_sends_are_abandoned_and_links_refused():
    async def scenario():
        engine, cascade, links = node()
        mine, theirs = keys_of(A, b"m", 1)[0], keys_of(B, b"t", 1)[0]
        engine.put(mine, b"v")
        cascade.receive(now_us() + 1, [mine])
        cascade._send_later(theirs, now_us())
        cascade.close()
        await settle()
        assert engine.lookup(mine) is not None and links.sent == [] and cascade.pending == 0
        assert cascade.cluster.cascade is None          # KV.LINK answers as on a node without a cascade
    asyncio.run(scenario())


def test_commit_times_are_kept_for_a_bounded_number_of_keys():
    async def scenario():
        engine, cascade, links = node()
        assert cascade.fresh_keys == 1024                  # a 4 MiB node: the floor
        for i in range(3000):
            engine.put(b"k%d" % i, b"v")
        assert len(cascade.commits) == 1024 and next(iter(cascade.commits)) == b"k1976"
    asyncio.run(scenario())


def test_keys_this_node_does_not_serve_are_neither_dropped_nor_forwarded():
    async def scenario():
        engine, cascade, links = node()
        theirs = keys_of(B, b"t", 1)[0]
        engine.put(theirs, b"a copy of B's block")     # as a hot-block copy is held
        assert cascade.receive(now_us() + 1, [theirs]) == 0
        engine.delete(theirs)                          # a copy going is no drop of the block
        await settle()
        assert links.sent == [] and cascade.stats.dropped == 0
    asyncio.run(scenario())


# ------------------------------------------------------------------ while a slot move's step lasts


def mover(me: str) -> tuple[Engine, Cascade, Links, Migrator | MovedLinks]:
    """A node ``me`` with a cascade in a step map that moves A's half of the slots to B; B, the
    target, runs a migrator (the guard of what it imports), A only what takes a value's links."""
    engine = Engine(4 * MiB, prefault=False)
    cluster = ClusterState(me, NODES[me])
    cluster.apply(SlotMap.build(1, NODES, [A] * (SLOTS // 2) + [B] * (SLOTS // 2)))
    links = Links()
    if me == B:
        moves = Migrator(engine, cluster, links, lambda: Config(cluster_move_budget=5), dict)
        moves.attach()
    else:
        moves = MovedLinks(engine, cluster)
    cascade = Cascade(engine, cluster, links)
    cascade.attach()
    cluster.apply(SlotMap.build(2, NODES, [A] * (SLOTS // 2) + [B] * (SLOTS // 2),
                                {slot: (A, B) for slot in range(SLOTS // 2)}))
    return engine, cascade, links, moves


def test_a_source_drops_what_it_still_holds_of_a_slot_moving_away_but_a_value_leaving_cascades_nothing():
    """A cascade once ignored the slots moving away: every block a source was told to drop during a
    step moved to the target instead, after the block before it had gone."""
    async def scenario():
        engine, cascade, links, moves = mover(A)
        held, child, moved = keys_of(A, b"h", 3)
        engine.put(held, b"v")
        assert cascade.receive(now_us(), [held]) == 1
        await settle()
        assert engine.lookup(held) is None and cascade.stats.dropped == 1
        engine.put(moved, b"v")
        engine.put(child, b"v", parent=moved)
        assert moves.capture(moved, engine.lookup(moved)) == (child,)     # its links travel with it
        engine.delete(moved)                                                      # as outgoing.take does
        await settle()
        assert engine.lookup(child) is not None and links.sent == [] and cascade.departing is None
    asyncio.run(scenario())


def test_a_target_drops_what_it_imported_and_takes_no_push_of_a_dropped_block_still_on_its_way():
    async def scenario():
        engine, cascade, links, moves = mover(B)
        imported, child, on_the_way = keys_of(A, b"i", 3)
        with moves.storing():                                   # as KV.IMPORT stores
            engine.put(imported, b"v")
            engine.put(child, b"v", parent=imported)
        assert imported not in cascade.commits                  # a pushed value is no write here
        assert moves.accepts(on_the_way)
        assert cascade.receive(now_us() - 1_000_000, [imported, on_the_way]) == 2   # dropped a second ago
        await settle()
        assert engine.lookup(imported) is None and engine.lookup(child) is None    # its chain went too
        assert not moves.accepts(on_the_way) and cascade.stats.dropped == 2
    asyncio.run(scenario())


def test_a_child_of_a_moving_slot_goes_to_both_ends_of_the_move():
    async def scenario():
        engine, cascade, links, moves = mover(B)
        parent, child = keys_of(B, b"p", 1)[0], keys_of(A, b"c", 1)[0]   # the child's slot moves A -> B
        engine.put(parent, b"v")
        assert cascade.link(parent, child)
        engine.delete(parent)
        await settle()
        assert [(addr, command[2:]) for addr, command in links.sent] == [(NODES[A], (child,))]
        assert not moves.accepts(child)                         # B, the target, had it not: no push of it
    asyncio.run(scenario())


def test_a_link_pushed_after_its_parent_went_drops_the_child():
    """The links of a pushed value follow its KV.IMPORT; a target that dropped the value between the
    two drops the value's children instead of linking them to nothing."""
    async def scenario():
        engine, cascade, links, moves = mover(B)
        parent, child, other = keys_of(A, b"p", 3)
        with moves.storing():
            engine.put(parent, b"v")
            engine.put(child, b"v")
        engine.delete(parent)                                   # evicted, say, before its links came
        assert cascade.link_moved(parent, child) is False
        assert cascade.link_moved(b"never-" + other, other) is False    # a parent never here links nothing
        await settle()
        assert engine.lookup(child) is None and engine.lookup(other) is None and cascade.stats.dropped == 1
    asyncio.run(scenario())


def test_links_are_capped_per_key_and_per_node():
    async def scenario():
        engine, cascade, links = node()
        parents, children = keys_of(A, b"p", 3), keys_of(B, b"c", LINKS_PER_KEY + 4)
        for parent in parents:
            engine.put(parent, b"v")
        assert all(cascade.link(parents[0], child) for child in children)
        assert cascade.children[parents[0]] == children[4:]            # the newest stay
        assert cascade.link_count == LINKS_PER_KEY and cascade.stats.links_displaced == 4
        cascade.max_links = LINKS_PER_KEY + 1
        assert cascade.link(parents[1], children[0]) is True
        assert cascade.link(parents[2], children[0]) is False           # over the node's budget
        assert cascade.stats.links_refused == 1
        engine.delete(parents[0])                                       # links go with their key
        assert cascade.link_count == 1 and parents[0] not in cascade.children
    asyncio.run(scenario())


def test_a_batch_a_peer_does_not_take_is_counted_and_lost():
    async def scenario():
        engine, cascade, links = node()
        parent, child = keys_of(A, b"p", 1)[0], keys_of(B, b"c", 1)[0]
        engine.put(parent, b"v")
        cascade.link(parent, child)
        links.down.add(NODES[B])
        engine.delete(parent)
        await settle()
        assert cascade.stats.send_failures == 1 and cascade.pending == 0
        cascade.close()                                 # the node leaves: its last drops cascade nothing
        links.down.clear()
        engine.put(parent, b"v")
        cascade.link(parent, child)
        engine.delete(parent)
        await settle()
        assert cascade.pending == 0 and len(links.sent) == 0
    asyncio.run(scenario())


# ------------------------------------------------------------------ 3 real nodes


@pytest.fixture(scope="module")
def cluster(cluster_module_factory):
    return cluster_module_factory(nodes=3, dram_size="64mb")


@pytest.fixture
def kv(cluster):
    with KVClusterClient([f"{h}:{p}" for h, p in cluster.addrs], fast_path="off") as client:
        yield client


def _chain(kv: KVClusterClient, name: str, blocks: int, size: int = 1000) -> list[bytes]:
    keys = [b"%s-%03d" % (name.encode(), i) for i in range(blocks)]
    kv.batch_put([(k, bytes(size)) for k in keys], parents=[None] + keys[:-1])
    return keys


def _cached(kv: KVClusterClient, keys: list[bytes]) -> list[bool]:
    return [loc is not None for loc in kv.locate(keys)]


def _info(cluster, field: str) -> list[int]:
    return [redis.Redis(*addr).info("cluster")[field] for addr in cluster.addrs]


@pytest.mark.parametrize("how", ["delete", "expire"])
def test_dropping_an_early_block_drops_the_rest_of_its_chain_on_every_node(kv, cluster, how):
    keys = _chain(kv, f"drop-{how}", 32)
    assert len({kv.node_of(k) for k in keys[6:]}) == 3
    assert _cached(kv, keys) == [True] * 32
    if how == "delete":
        kv.delete(keys[5])
    else:
        kv.execute("PEXPIRE", keys[5], 1)
        time.sleep(0.01)
        assert kv.get(keys[5]) is None                 # lazily expired: a final drop
    wait_until(lambda: _cached(kv, keys) == [True] * 5 + [False] * 27, what="the chain's tail to go")


def test_links_ride_with_puts_through_the_local_arena_too(cluster):
    with KVClusterClient([f"{h}:{p}" for h, p in cluster.addrs], fast_path="required") as kv:
        keys = _chain(kv, "arena", 32, size=256 * 1024)     # each node's part goes through the arena
        assert sum(kv._client(addr).fast_path.stats.writes for addr in kv.nodes) == 3
        kv.delete(keys[3])
        wait_until(lambda: _cached(kv, keys) == [True] * 3 + [False] * 29, what="the chain's tail to go")


@pytest.mark.parametrize("how", ["put", "put_layer"])
def test_single_key_puts_link_their_chain_in_the_background(kv, cluster, how):
    keys = [b"single-%s-%02d" % (how.encode(), i) for i in range(16)]
    crossings = sum(kv.node_of(a) != kv.node_of(b) for a, b in zip(keys, keys[1:]))
    before = sum(_info(cluster, "cluster_cascade_links"))
    for i, key in enumerate(keys):
        parent = keys[i - 1] if i else None
        if how == "put":
            kv.put(key, b"v" * 100, parent=parent)
        else:
            for layer in range(3):
                kv.put_layer(key, layer, np.zeros(8, dtype=np.float32), n_layers=3, parent=parent)
    assert all(_cached(kv, keys))
    linked = lambda: sum(_info(cluster, "cluster_cascade_links")) == before + crossings    # noqa: E731
    wait_until(linked, what="the links to arrive")
    kv.delete(keys[2])
    wait_until(lambda: _cached(kv, keys) == [True] * 2 + [False] * 14, what="the chain's tail to go")


def test_a_single_key_put_of_a_block_cached_already_still_links_it(kv, cluster):
    keys = [b"cached-first-%02d" % i for i in range(16)]
    for key in keys:
        kv.put(key, b"v" * 100)                         # cached before its chain was known
    crossings = sum(kv.node_of(a) != kv.node_of(b) for a, b in zip(keys, keys[1:]))
    before = sum(_info(cluster, "cluster_cascade_links"))
    for i, key in enumerate(keys):
        assert kv.put(key, b"v" * 100, parent=keys[i - 1] if i else None) is False     # there already
    linked = lambda: sum(_info(cluster, "cluster_cascade_links")) == before + crossings    # noqa: E731
    wait_until(linked, what="the links to arrive")


def test_a_re_put_chain_is_linked_again_and_nodes_hold_one_link_per_crossing(kv, cluster):
    keys = _chain(kv, "relink", 24)
    crossings = sum(kv.node_of(a) != kv.node_of(b) for a, b in zip(keys, keys[1:]))
    before = sum(_info(cluster, "cluster_cascade_links"))
    _chain(kv, "relink", 24)                            # the same chain again: nothing new to record
    assert sum(_info(cluster, "cluster_cascade_links")) == before
    kv.delete(keys[0])
    wait_until(lambda: not any(_cached(kv, keys)), what="the whole chain to go")
    assert sum(_info(cluster, "cluster_cascade_links")) == before - crossings


def test_link_bad_input_gets_clear_errors(kv, cluster):
    parent = _chain(kv, "bad", 1)[0]
    owner = kv.node_of(parent)
    host, port = owner.rsplit(":", 1)
    other = next(f"{h}:{p}" for h, p in cluster.addrs if f"{h}:{p}" != owner)
    here = redis.Redis(host, int(port))
    elsewhere = redis.Redis(*other.rsplit(":", 1))
    with pytest.raises(redis.exceptions.MovedError):
        elsewhere.execute_command("KV.LINK", parent, b"child")      # a parent of a slot served elsewhere
    with pytest.raises(redis.ResponseError, match="syntax error"):
        here.execute_command("KV.LINK", parent, b"c1", parent)
    with pytest.raises(redis.ResponseError, match=f"at most {KV_LINK_MAX} links"):
        here.execute_command("KV.LINK", *[parent, b"c"] * (KV_LINK_MAX + 1))
    with pytest.raises(redis.ResponseError, match="longer than 1024 bytes"):
        here.execute_command("KV.LINK", parent, b"c" * 1025)
    with pytest.raises(redis.ResponseError, match="at most 1024 keys"):
        here.execute_command("KV.CASCADE", now_us(), *[b"k"] * 1025)
    with pytest.raises(redis.ResponseError, match="microseconds"):
        here.execute_command("KV.CASCADE", b"soon", b"k")
    for args, reason in [((b"1", b"k", b"2"), "wrong number of arguments"), ((b"x", b"k"), "integer"),
                         ((b"16384", b"k"), "between 0 and 16383"), ((b"-1", b"k"), "between 0 and 16383"),
                         ((b"1", b"c" * 1025), "longer than 1024 bytes"), ((b"1", b"k") * 1025, "at most 1024 pairs")]:
        with pytest.raises(redis.ResponseError, match=reason):
            here.execute_command("KV.UPLINK", *args)
    assert here.execute_command("KV.UPLINK", b"5", parent, b"5", b"not-cached") == 1
    absent = b"{%s}absent" % parent                                 # same slot, not cached
    assert here.execute_command("KV.LINK", parent, b"child-1", absent, b"child-2") == 1
    here.execute_command("ACL", "SETUSER", "tenant-a", "on", ">pw", "~bad-*", "+@all")
    tenant = redis.Redis(host, int(port), username="tenant-a", password="pw")
    with pytest.raises(redis.exceptions.NoPermissionError):
        tenant.execute_command("KV.LINK", parent, b"someone-else:block")
    assert tenant.execute_command("KV.LINK", parent, b"bad-child") == 1


def test_chains_written_past_memory_stay_prefixes(cluster_factory):
    """Each node evicts its own oldest at its own pressure; the cascade drops what that leaves unreachable."""
    up = cluster_factory(nodes=3, dram_size="4mb")
    with KVClusterClient([f"{h}:{p}" for h, p in up.addrs], fast_path="off") as kv:
        chains = [_chain(kv, f"full{c:03d}", 16, size=64 * 1024) for c in range(40)]     # ~3.3 x memory
        assert cascades_settled([redis.Redis(*addr) for addr in up.addrs], WAIT_S) < WAIT_S
        broken = 0
        for keys in chains:
            cached = _cached(kv, keys)
            gap = cached.index(False) if False in cached else len(cached)
            broken += any(cached[gap:])
        assert broken == 0
        assert sum(_info(up, "cluster_cascade_dropped")) > 0


def test_a_standalone_node_has_no_cascade(server):
    conn = redis.Redis(server.host, server.port)
    conn.execute_command("KV.PUT", "p", "v")
    with pytest.raises(redis.ResponseError, match="cluster support disabled"):
        conn.execute_command("KV.LINK", "p", "c")
    with pytest.raises(redis.ResponseError, match="cluster support disabled"):
        conn.execute_command("KV.CASCADE", now_us(), "p")
    assert conn.get("p") == b"v"


def test_chains_stay_prefixes_when_a_node_dies(cluster_factory):
    """3 node processes over a real etcd; chains of 24 blocks over all three; one node is killed
    with SIGKILL. Its blocks and links die with it; the map that gives its slots away makes the
    others drop the blocks that followed its blocks (KV.UPLINK), and what follows those."""
    up = cluster_factory(3, extra=("--node-timeout", "2"))
    addrs = [f"{h}:{p}" for h, p in up.addrs]
    with KVClusterClient(addrs, fast_path="off") as kv:
        chains = [_chain(kv, f"dies-{n}", 24) for n in range(6)]
        victim = kv.node_of(chains[0][3])
    survivors = [a for a in addrs if a != victim]
    infos = lambda: [redis.Redis(*a.rsplit(":", 1)).info("cluster") for a in addrs]     # noqa: E731
    wait_until(lambda: sum(i["cluster_cascade_uplinks"] for i in infos()) == sum(i["cluster_cascade_links"]
               for i in infos()) > 0, what="every link noted at its child's node")
    os.kill(next(n["pid"] for n in up.info["nodes"] if n["addr"] == victim), signal.SIGKILL)
    clients = [redis.Redis(*a.rsplit(":", 1), socket_timeout=5) for a in survivors]
    wait_until(lambda: all(int(c.execute_command("CLUSTER INFO")["cluster_known_nodes"]) == 2 for c in clients),
               timeout=30, what="the map without the dead node")

    def present(key: bytes) -> bool:
        for c in clients:
            try:
                return bool(c.exists(key))
            except redis.exceptions.MovedError:
                continue                    # the other survivor serves it now
        raise AssertionError(f"no survivor serves {key!r}")

    def prefixes() -> bool:
        kept = [[present(k) for k in keys] for keys in chains]
        return all(row == [True] * sum(row) + [False] * (len(row) - sum(row)) for row in kept)
    wait_until(prefixes, what="every chain to be a prefix again")
    assert any(not present(keys[-1]) for keys in chains) and any(present(keys[0]) for keys in chains)


def test_a_batch_put_with_a_dead_node_leaves_no_block_past_the_first_it_could_not_write(cluster_factory):
    """Its blocks after the dead node's first one are unreachable and nothing links them to the
    missing block: the client deletes what it stored of them before it raises the node's error."""
    up = cluster_factory(3, extra=("--node-timeout", "30"))
    addrs = [f"{h}:{p}" for h, p in up.addrs]
    with KVClusterClient(addrs, fast_path="off", timeout=2, retries=0) as kv:
        keys = [b"gap-%03d" % i for i in range(24)]
        owners = [kv.node_of(k) for k in keys]
        victim = owners[5]
        first = owners.index(victim)
        assert any(o != victim for o in owners[first + 1:])
        os.kill(next(n["pid"] for n in up.info["nodes"] if n["addr"] == victim), signal.SIGKILL)
        with pytest.raises((ConnectionError, OSError)):
            kv.batch_put([(k, bytes(1000)) for k in keys], parents=[None] + keys[:-1])
    survivors = {a: redis.Redis(*a.rsplit(":", 1), socket_timeout=5) for a in addrs if a != victim}
    stored = [survivors[o].exists(k) == 1 if o != victim else False for k, o in zip(keys, owners)]
    assert stored == [True] * first + [False] * (len(keys) - first)
