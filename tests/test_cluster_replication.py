"""Hot-block replication: rendezvous targets, both sides of `HotCopies` over a real engine, and 3 real nodes.

The unit tests run `HotCopies` on a real `Engine` and a `ClusterState` fed
maps by hand, with a recording stand-in for the peer links (virtual time where
a lease is waited out). The integration tests start `kvstore cluster up`
(a throwaway etcd and 3 node processes) and read copies with READONLY
connections, as a cluster-aware client does.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import redis

from kvstore.cluster.node import ClusterState
from kvstore.cluster.peer import PeerError
from kvstore.cluster.heat import rendezvous
from kvstore.cluster.replication import KV_COPY, KV_RENEW, KV_UNCOPY, HotCopies, lease_seconds
from kvstore.cluster.simclock import run_simulated
from kvstore.cluster.slots import SLOTS, SlotMap, keyslot
from kvstore.commands.table import CommandError
from kvstore.commands.cluster_data import _from_a_node
from kvstore.store.engine import Engine
from tests.cluster_client import connect
from tests.cluster_procs import ClusterUp
from tests.conftest import wait_until

A, B, C, D = "a" * 40, "b" * 40, "c" * 40, "d" * 40
NODES = {A: "10.0.0.1:7000", B: "10.0.0.2:7000", C: "10.0.0.3:7000", D: "10.0.0.4:7000"}
MiB = 1024 * 1024

# ------------------------------------------------------------------ rendezvous


def test_rendezvous_picks_k_distinct_nodes_the_same_everywhere_and_moves_few_on_a_join():
    keys = [b"block-%d" % i for i in range(2000)]
    five = ["%040x" % n for n in range(5)]
    picks = {key: rendezvous(key, five, 2) for key in keys}
    assert all(len(set(p)) == 2 and set(p) <= set(five) for p in picks.values())
    assert picks == {key: rendezvous(key, list(reversed(five)), 2) for key in keys}     # order does not matter
    six = five + ["%040x" % 5]
    changed = [key for key in keys if rendezvous(key, six, 2) != picks[key]]
    assert all(six[-1] in rendezvous(key, six, 2) for key in changed)           # only the newcomer wins places
    assert 0.2 < len(changed) / len(keys) < 0.45                                  # about 2 in 6
    assert rendezvous(b"k", five[:1], 2) == (five[0],)


# ------------------------------------------------------------------ HotCopies on a real engine


class Links:
    """Peer links that record what is sent; ``down`` addresses fail as a dead node does."""

    def __init__(self):
        self.sent: list[tuple[str, str, list]] = []
        self.down: set[str] = set()
        self.renew_reply = None         # fn(addr, keys) -> reads per key

    def link(self, addr: str):
        links = self

        class Link:
            async def call(self, *args):
                links.sent.append((addr, args[0], [bytes(a) if isinstance(a, memoryview) else a for a in args[1:]]))
                if addr in links.down:
                    raise PeerError(f"node {addr} is unreachable")
                if args[0] == KV_RENEW:
                    return links.renew_reply(addr, list(args[3:]))
                return 1
        return Link()

    def of(self, command: str) -> list[tuple[str, list]]:
        return [(addr, args) for addr, name, args in self.sent if name == command]


def node(me: str, *, owners=None, hot_reads: float = 5, dram: int = 4 * MiB, rescued=None):
    """A HotCopies for node ``me`` with every slot owned by ``owners`` (default: ``me``)."""
    engine = Engine(dram, prefault=False)
    cluster = ClusterState(me, NODES[me])
    cluster.apply(SlotMap.build(1, NODES, [owners or me] * SLOTS))
    cluster.nodes = dict(NODES)             # all registered (membership would say so)
    config = SimpleNamespace(hot_reads=hot_reads, hot_replicas=2, cluster_node_timeout=0.5)
    links = Links()
    copies = HotCopies(engine, cluster, links, lambda: config,
                       lambda owner, keys: (rescued if rescued is not None else []).append((owner, keys)))
    copies.attach()
    return engine, cluster, copies, links


def read(engine: Engine, key: bytes, times: int) -> None:
    for _ in range(times):
        assert engine.get_entry(key) is not None


def test_a_block_read_past_the_threshold_is_copied_to_its_two_rendezvous_nodes():
    async def scenario():
        engine, cluster, copies, links = node(A)
        engine.put(b"hot", b"v" * 1000)
        engine.put(b"cold", b"c" * 10)
        read(engine, b"hot", 5)
        read(engine, b"cold", 3)
        assert copies.replicated == {}                      # 5 reads: not more than 5 a second yet
        read(engine, b"hot", 1)
        holders = rendezvous(b"hot", [B, C, D], 2)
        assert copies.replicated == {b"hot": holders}
        await asyncio.sleep(0.01)
        sent = links.of(KV_COPY)
        assert sorted(addr for addr, _ in sent) == sorted(NODES[h] for h in holders)
        assert all(args == [A, int(lease_seconds(0.5) * 1000), b"hot", b"v" * 1000] for _, args in sent)
        assert copies.copies_of(b"hot") == [NODES[h] for h in holders]
        assert copies.hot_map() == [(b"hot", [NODES[h] for h in holders])]
    run_simulated(scenario())


@pytest.mark.parametrize("write", ["in place", "new extent", "delete", "expire"])
def test_every_change_of_a_replicated_key_removes_its_copies_and_holds_the_reply(write):
    async def scenario():
        engine, cluster, copies, links = node(A)
        engine.put(b"hot", b"v" * 1000)
        read(engine, b"hot", 6)
        version = copies.version
        if write == "in place":
            engine.put(b"hot", b"w" * 1000)
        elif write == "new extent":
            engine.put(b"hot", b"w" * 100_000)
        elif write == "delete":
            engine.delete(b"hot")
        else:
            engine.expiry.set(b"hot", 1)
            assert engine.lookup(b"hot") is None
        assert copies.replicated == {} and copies.version > version
        assert copies.unacked                                       # dispatch holds the reply on these
        await copies.take_unacked()
        assert sorted(addr for addr, _ in links.of(KV_UNCOPY)) == sorted(NODES[h] for h in rendezvous(b"hot", [B, C, D], 2))
    run_simulated(scenario())


def test_a_write_while_copies_are_being_removed_waits_for_the_removal():
    async def scenario():
        engine, cluster, copies, links = node(A)
        engine.put(b"hot", b"v" * 1000)
        read(engine, b"hot", 6)
        engine.delete(b"hot")                 # removal in flight (say an eviction, no reply waiting on it)
        removal = copies.unacked.pop()
        engine.put(b"hot", b"x" * 10)          # a write of the key must wait for it too
        assert copies.unacked == [removal]
        await copies.take_unacked()
    run_simulated(scenario())


def test_an_unreachable_holder_is_waited_out_for_its_lease():
    async def scenario():
        loop = asyncio.get_running_loop()
        engine, cluster, copies, links = node(A)
        engine.put(b"hot", b"v" * 1000)
        read(engine, b"hot", 6)
        await asyncio.sleep(0.01)
        links.down.add(NODES[copies.replicated[b"hot"][0]])
        granted = loop.time()
        engine.put(b"hot", b"w" * 1000)
        await copies.take_unacked()
        assert loop.time() - granted >= lease_seconds(0.5) - 0.01       # its copy cannot outlive this
        assert copies.stats.invalidation_waits == 1
    run_simulated(scenario())


def test_the_window_tick_renews_leases_counts_holder_reads_and_removes_cooled_copies():
    async def scenario():
        engine, cluster, copies, links = node(A)
        engine.put(b"hot", b"v" * 1000)
        read(engine, b"hot", 6)
        holders = copies.replicated[b"hot"]
        links.renew_reply = lambda addr, keys: [2] * len(keys)
        await copies.tick()                     # 6 own reads + 2 + 2 reported: still hot, 2 copies carry it
        assert copies.replicated == {b"hot": holders} and copies.heat.last[b"hot"] == 10
        renewals = links.of(KV_RENEW)
        assert len(renewals) == 2 and all(args[0] == A and args[2:] == [b"hot"] for _, args in renewals)
        links.renew_reply = lambda addr, keys: [-1 if addr == NODES[holders[0]] else 0] * len(keys)
        await copies.tick()                     # one holder lost its copy; 0 reads: cooled
        assert copies.replicated == {} and copies.stats.copies_cooled == 1
        await copies.take_unacked()
    run_simulated(scenario())


def test_holders_that_leave_are_forgotten_and_hot_reads_0_removes_every_copy():
    async def scenario():
        engine, cluster, copies, links = node(A)
        config = copies.config()
        engine.put(b"hot", b"v" * 1000)
        read(engine, b"hot", 6)
        gone, stays = copies.replicated[b"hot"]
        cluster.apply(SlotMap.build(2, {n: a for n, a in NODES.items() if n != gone}, [A] * SLOTS))
        assert copies.replicated == {b"hot": (stays,)}
        links.renew_reply = lambda addr, keys: [100] * len(keys)
        config.hot_reads = 0                    # CONFIG SET hot-reads 0
        await copies.tick()
        assert copies.replicated == {}
        await copies.take_unacked()
        assert [addr for addr, _ in links.of(KV_UNCOPY)] == [NODES[stays]]
    run_simulated(scenario())


def test_a_holder_serves_copies_only_of_the_slot_owner_and_only_under_lease():
    async def scenario():
        engine, cluster, copies, links = node(B, owners=A)

        def store(key, value):
            engine.put(key, value)

        held = copies.held
        assert not held.store(C, 5000, b"k", b"x", store)               # C does not own the slot
        assert held.store(A, 5000, b"k", b"x", store) and held.serves([b"k"])
        assert held.store(A, 1, b"short", b"y", store)
        await asyncio.sleep(0.01)
        assert not held.serves([b"short"]) and not held.serves([b"k", b"short"])
        read(engine, b"k", 3)
        assert held.renew(A, 5000, [b"k", b"short", b"none"]) == [3, 0, -1]
        assert held.renew(C, 5000, [b"k"]) == [-1]
        assert held.drop(b"k") and engine.lookup(b"k") is None and not held.serves([b"k"])
        assert not held.drop(b"k")
        held.drop_all()
        assert len(held) == 0 and engine.lookup(b"short") is None
    run_simulated(scenario())


def test_copies_follow_the_load_and_shrink_only_past_a_margin():
    async def scenario():
        engine, cluster, copies, links = node(A)            # hot at 6 reads a window
        engine.put(b"hot", b"v" * 1000)
        read(engine, b"hot", 6)
        first = copies.replicated[b"hot"]
        assert len(first) == 2
        for reported, expected in ((10, 3), (6, 3), (2, 2), (1, 0)):
            links.renew_reply = lambda addr, keys: [reported] * len(keys)
            await copies.tick()                 # the load: what the holders report, over 6 a server
            assert len(copies.replicated.get(b"hot", ())) == expected, reported
        await copies.take_unacked()
        await asyncio.sleep(0.01)
        pushed = [addr for addr, _ in links.of(KV_COPY)]
        assert len(pushed) == 3 and pushed[:2] == [NODES[h] for h in first]     # grown by one
        assert len(links.of(KV_UNCOPY)) == 3                # shrunk by one, then cooled
        assert copies.stats.copies_shrunk == 1 and copies.stats.copies_cooled == 1
    run_simulated(scenario())


def test_a_large_block_is_hot_at_fewer_reads():
    async def scenario():
        engine, cluster, copies, links = node(A)
        for i in range(10):
            engine.put(b"small-%d" % i, b"s" * 100)
        engine.put(b"large", b"L" * 10_000)                # mean 1,000 bytes: a read counts as 10
        await copies.tick()
        read(engine, b"small-0", 5)
        read(engine, b"large", 1)
        assert set(copies.replicated) == {b"large"}
        read(engine, b"small-0", 1)                        # a small value is hot at hot-reads as before
        assert set(copies.replicated) == {b"large", b"small-0"}
        await copies.take_unacked()
    run_simulated(scenario())


def test_a_copy_goes_only_when_colder_than_what_lru_would_evict():
    """A holder under memory pressure keeps the copy read every second and drops its own cold
    values before it; a copy nobody reads goes when it is the oldest value."""
    async def scenario():
        engine, cluster, copies, links = node(B, owners=A, dram=8 * MiB)
        cluster.apply(SlotMap.build(2, NODES, [A if s == keyslot(b"copy-0") or s == keyslot(b"copy-1") else B
                                               for s in range(SLOTS)]))
        copies.held.store(A, 60_000, b"copy-0", bytes(MiB), engine.put)       # never read
        copies.held.store(A, 60_000, b"copy-1", bytes(MiB), engine.put)
        for i in range(30):
            read(engine, b"copy-1", 1)
            engine.put(b"own-%d" % i, bytes(MiB))
        assert copies.held.shed == 1 and engine.lookup(b"copy-0") is None
        assert b"copy-1" in copies.held and engine.lookup(b"copy-1") is not None
        assert engine.stats.evictions >= 20 and engine.lookup(b"own-0") is None
        assert engine.lookup(b"own-29") is not None
    run_simulated(scenario())


def test_a_new_map_adopts_copies_of_slots_gained_and_passes_on_those_of_a_dead_owner():
    async def scenario():
        rescued = []
        engine, cluster, copies, links = node(B, owners=A, rescued=rescued)
        keys = [b"k%d" % i for i in range(40)]
        for key in keys:
            copies.held.store(A, 60_000, key, b"v", engine.put)
        half = {keyslot(k) for k in keys[:20]}
        without_a = {n: a for n, a in NODES.items() if n != A}
        cluster.apply(SlotMap.build(2, without_a, [B if s in half else C for s in range(SLOTS)]))
        assert len(copies.held) == 0
        assert copies.stats.copies_adopted == 20 and all(engine.lookup(k) is not None for k in keys[:20])
        assert rescued == [(C, [k for k in keys[20:]])]
        assert set(copies.replicated) == set(keys[:20])         # the other holders' copies are ours to remove
    run_simulated(scenario())


def test_copies_of_a_live_owner_that_lost_the_slot_are_dropped():
    async def scenario():
        engine, cluster, copies, links = node(B, owners=A)
        copies.held.store(A, 60_000, b"k", b"v", engine.put)
        cluster.apply(SlotMap.build(2, NODES, [C] * SLOTS))
        assert len(copies.held) == 0 and engine.lookup(b"k") is None
    run_simulated(scenario())


def test_node_to_node_commands_come_only_from_a_node_host_or_the_unix_socket():
    cluster = ClusterState(A, NODES[A])
    cluster.apply(SlotMap.build(1, NODES, [A] * SLOTS))
    cluster.copies = object()

    def conn(addr: str):
        return SimpleNamespace(server=SimpleNamespace(cluster=cluster), addr=addr)

    assert _from_a_node(conn("10.0.0.3:51234")) is cluster
    assert _from_a_node(conn("/unixsocket:0")) is cluster
    with pytest.raises(CommandError, match="only the cluster's nodes"):
        _from_a_node(conn("10.9.9.9:51234"))
    with pytest.raises(CommandError, match="cluster support disabled"):
        _from_a_node(SimpleNamespace(server=SimpleNamespace(cluster=None), addr="10.0.0.3:1"))


# ------------------------------------------------------------------ real nodes


def owner_of(addr: str, key: bytes) -> str:
    slot = keyslot(key)
    for first, last, owner, *_ in connect(addr).execute_command("CLUSTER SLOTS"):
        if first <= slot <= last:
            return f"{owner[0].decode()}:{owner[1]}"
    raise AssertionError("slot not served")


def make_hot(owner: str, key: bytes, value: bytes) -> list[str]:
    """Write ``key`` on its owner and read it until the owner reports its copies; their addresses."""
    conn = connect(owner)
    conn.set(key, value)

    def copied():
        for _ in range(30):
            conn.get(key)
        return any(k == key for k, _ in conn.execute_command("KV.HOTKEYS")[1])

    wait_until(copied, what="the copies")
    return [a.decode() for k, addrs in conn.execute_command("KV.HOTKEYS")[1] if k == key for a in addrs]


@contextmanager
def kept_hot(owner: str, key: bytes) -> Iterator[None]:
    """Keep reading ``key`` on its owner while the test looks at its copies.

    A block read less than half the threshold over a heat window cools and
    its copies go, so on a busy host a test that only looks would race the
    window's end.
    """
    stop = threading.Event()

    def read() -> None:
        conn = connect(owner)
        while not stop.wait(0.01):
            conn.get(key)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield
    finally:
        stop.set()
        reader.join()


@pytest.fixture(scope="module")
def cluster(cluster_module_factory):
    return cluster_module_factory(3, extra=("--node-timeout", "2", "--", "--hot-reads", "20"))


def addrs_of(up: ClusterUp) -> list[str]:
    return [f"{h}:{p}" for h, p in up.addrs]


def test_readers_learn_where_copies_are_and_read_them_with_readonly(cluster):
    key, value = b"sys-prompt-0", bytes(range(256)) * 1024
    owner = owner_of(addrs_of(cluster)[0], key)
    with kept_hot(owner, key):                         # the copies stay while they are looked at
        holders = make_hot(owner, key, value)
        others = sorted(a for a in addrs_of(cluster) if a != owner)
        assert sorted(holders) == others                    # 3 nodes, 2 copies: both others
        reader = connect(owner, readonly=True)
        tier_size_copies = reader.execute_command("KV.LOCATE", key, b"{sys-prompt-0}missing")   # same slot
        assert tier_size_copies[1] is None and tier_size_copies[0][:2] == [b"dram", len(value)]
        assert sorted(a.decode() for a in tier_size_copies[0][2]) == others
        assert connect(owner).execute_command("KV.LOCATE", key) == [[b"dram", len(value)]]     # the old shape
        version, entries = connect(owner).execute_command("KV.HOTKEYS")
        assert [k for k, _ in entries] == [key]
        assert connect(owner).execute_command("KV.HOTKEYS", version) is None                  # unchanged: nil
        for holder in holders:
            assert connect(holder, readonly=True).get(key) == value
            with pytest.raises(redis.exceptions.MovedError):
                connect(holder).get(key)                    # without READONLY: the owner's
            with pytest.raises(redis.exceptions.MovedError):
                connect(holder, readonly=True).set(key, b"x")                                   # never a write
            assert connect(holder).info("cluster")["cluster_copies_held"] >= 1


@pytest.mark.parametrize("change", ["overwrite", "delete"])
def test_a_write_removes_the_copies_before_it_is_acknowledged(cluster, change):
    for round_ in range(5):
        key = b"hot-%s-%d" % (change.encode(), round_)
        owner = owner_of(addrs_of(cluster)[0], key)
        holders = make_hot(owner, key, b"old" * 1000)
        readers = [connect(h, readonly=True) for h in holders]
        if change == "overwrite":
            connect(owner).set(key, b"new" * 1000)
        else:
            connect(owner).delete(key)
        for reader in readers:                          # right after the reply: no copy answers the old value
            with pytest.raises(redis.exceptions.MovedError):
                reader.get(key)


def test_copies_are_removed_when_the_block_cools(cluster):
    key = b"briefly-hot"
    owner = owner_of(addrs_of(cluster)[0], key)
    holders = make_hot(owner, key, b"v" * 4096)
    wait_until(lambda: connect(owner).execute_command("KV.HOTKEYS")[1] == [], what="cooling")
    for holder in holders:
        with pytest.raises(redis.exceptions.MovedError):
            connect(holder, readonly=True).get(key)
    assert connect(owner).info("cluster")["cluster_copies_cooled"] >= 1


def test_without_a_cluster_the_new_commands_answer_as_for_cluster_commands(server):
    conn = connect(f"127.0.0.1:{server.port}")
    for command in (("KV.HOTKEYS",), ("KV.COPY", A, "1000", "k", "v"), ("KV.UNCOPY", "k"),
                    ("KV.IMPORT", "1", "k", "", "", "v"), ("KV.DRAIN", A)):
        with pytest.raises(redis.ResponseError, match="This instance has cluster support disabled"):
            conn.execute_command(*command)
    assert conn.execute_command("KV.LOCATE", "nothing") == [None]
    conn.config_set("hot-reads", "50")             # run-time settings, read at each heat window
    conn.config_set("hot-replicas", "1")
    conn.config_set("cluster-move-budget", "2.5")
    assert conn.config_get("hot-*") == {"hot-reads": "50.0", "hot-replicas": "1"}
    with pytest.raises(redis.ResponseError, match="hot-replicas"):
        conn.config_set("hot-replicas", "99")
