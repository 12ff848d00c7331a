"""Cluster membership kept in etcd: leases, one elected leader, and a watched slot map.

Layout under ``/kvstore/<cluster>/``::

    nodes/<node id>   -> host:port     (under the node's lease)
    addrs/<host:port> -> node id       (under the node's lease: one node per address)
    leader            -> node id       (under the leader's lease)
    slotmap           -> the JSON slot map (no lease: it outlives every node)
    mapchange         -> the change record that took the previous map to it (mapchange.py)

A node joins by granting a lease with ttl = its node timeout and creating its
two keys in one transaction that requires both to be absent: a second node
announcing a live node's address is refused (after waiting out one ttl, so a
node restarted on its own address gets in once its old lease has expired).
Its keep-alive loop refreshes the lease every ttl/3; if etcd says the lease is
gone (etcd lost it for longer than the ttl) it joins again. Leadership is a
key created with the leader's lease in a transaction that requires it to be
absent; when the leader's lease expires the key goes and the nodes campaign in
turn, not at once: each ranks itself among the map's nodes other than the
old leader (by id) and campaigns ``rank x CAMPAIGN_STEP`` seconds after the
key went, unless a new leader's key arrived first. The first in rank wins
with one transaction; the next one campaigns only when it is gone too.
The leader writes the map and its change record in a transaction that compares the leader key's
create revision (a deposed leader cannot write) and the map's mod revision
(a map computed from a stale one is not written; the watch brings the newer
map and the leader computes again).

Every node watches two keys, the change record and the leader key; only the
leader watches the registrations (``nodes/``), which it reads when it takes
the lead, before it acts as leader. A join or leave thus reaches the leader
once and every node once more only through the map change it causes: O(N)
watch events per join across the cluster, not O(N) per key, each a binary
record of about a hundred bytes rather than the map; a node reads the whole map only when
the record is not for the map it holds (it missed an epoch) or when a write
of the leader's fails on the map's revision. A map written without a record
(by hand, or by a leader of an older version) is not seen until then. A follower's view of who is
in the cluster is the map's node set (``map_nodes``), which is also what it
ranks itself in when an election is due. A broken watch resumes from the
last revision it saw + 1, so no event is missed; if that history is
compacted the node reads that key (or the registrations) again. While etcd
is unreachable nothing changes: the node keeps its last map, keeps serving,
and retries.

A coordinator pause is not a node failure. When etcd stalls (SIGSTOP, a
long fsync, a partition of etcd itself) for longer than the ttl, every lease
lapses on its side at once, and when it resumes it deletes every node key
and the leader key although no node died. Each node notes when etcd last
failed it (a call that raised `Unavailable`, a keep-alive slower than a
third of the ttl, its own lease found lapsed); for ``grace`` seconds after
that (`grace_left`), the leader does not treat nodes missing from the
registrations as gone: they keep their slots while they register again
(each does within a keep-alive period of etcd's return), and only a node
still missing when the grace ends loses them.

`Membership` is what `ClusterState` (node.py) depends on. `EtcdMembership`
implements it over the small `KV` interface (kv.py); `InMemoryMembership` is
the same logic over `FakeEtcd`, so tests and simulations of hundreds of nodes
run the code real nodes run, with no sockets.
"""
from __future__ import annotations

import asyncio
import logging
import math
from abc import ABC, abstractmethod
from typing import Protocol

from kvstore.cluster.fake_etcd import FakeEtcd
from kvstore.cluster.kv import KV, Compacted, Compare, Event, KeyValue, Put, Unavailable
from kvstore.cluster.mapchange import change_record
from kvstore.cluster.slots import NODE_ID, SlotMap, SlotMapError, check_address

log = logging.getLogger("kvstore.cluster")

RETRY_SECONDS = 0.2
CAMPAIGN_STEP = 0.25        # seconds between successive candidates of an election
GRACE_MARGIN = 1.0          # beyond the ttl, for nodes to register again after an etcd stall
MAX_WATCH_BACKOFF = 1.0


class ClusterError(Exception):
    """This node cannot take part in its cluster; the message says why."""


class MembershipListener(Protocol):
    """What membership tells a node (ClusterState implements it); called on the event loop."""

    def on_nodes(self, nodes: dict[str, str]) -> None: ...
    def on_map(self, raw: bytes) -> None: ...
    def on_change(self, raw: bytes) -> bool: ...
    def on_leader(self, leader: bool) -> None: ...
    def map_nodes(self) -> dict[str, str]: ...


class Membership(ABC):
    """Registration, leadership and the shared slot map, as one node sees them."""

    is_leader: bool = False
    reachable: bool = True

    def grace_left(self) -> float:
        """Seconds during which registrations missing after an etcd stall are not node failures."""
        return 0.0

    @abstractmethod
    async def join(self, node_id: str, addr: str, listener: MembershipListener) -> None:
        """Register this node; the current nodes and map reach ``listener`` before this returns.

        Raises ClusterError when the store cannot be reached in time or the
        address belongs to another live node.
        """

    @abstractmethod
    def propose(self, slot_map: SlotMap, base: SlotMap | None = None) -> None:
        """As leader, write ``slot_map`` (made from ``base``, the map in force) unless the map or the
        leadership changed since it was computed."""

    @abstractmethod
    async def leave(self) -> None:
        """Leave cleanly: the node's registration (and leadership) end now."""

    @abstractmethod
    async def abandon(self) -> None:
        """Stop without a word, as a crash does: the registration expires with its lease."""


class EtcdMembership(Membership):
    """Membership in etcd (any `KV`), under cluster name ``cluster``."""

    def __init__(self, kv: KV, cluster: str, node_timeout: float, *, connect_timeout: float = 10.0,
                 where: str = "etcd"):
        self.kv = kv
        self.cluster = cluster
        self.node_timeout = node_timeout
        self.connect_timeout = connect_timeout
        self.where = where
        self.prefix = f"/kvstore/{cluster}/".encode()
        self.leader_key = self.prefix + b"leader"
        self.map_key = self.prefix + b"slotmap"
        self.change_key = self.prefix + b"mapchange"
        self.node_id = self.addr = ""
        self.listener: MembershipListener | None = None
        self.lease, self.ttl = 0, max(1, math.ceil(node_timeout))
        self.nodes: dict[str, str] = {}         # the registrations, kept while leader
        self.revisions: dict[bytes, int] = {}   # per watched prefix: last revision seen
        self.map_revision = 0           # mod revision of the map last delivered (0: none)
        self.leader_id: str | None = None
        self.leader_revision = 0        # create revision of the leader key while we hold it
        self._proposal: tuple[SlotMap, SlotMap | None, int, int] | None = None
        self._fetching: asyncio.Task | None = None
        self._writer: asyncio.Task | None = None
        self._leading: asyncio.Task | None = None    # reads and watches the registrations
        self._campaigning = False
        self._leaderless_since = 0.0     # loop time the leader key was seen gone
        self._rank = 0                   # this node's turn to campaign in that election
        self._tasks: set[asyncio.Task] = set()
        self.disrupted_at: float | None = None     # loop time etcd last failed this node

    @property
    def grace(self) -> float:
        return self.ttl + GRACE_MARGIN

    def grace_left(self) -> float:
        if self.disrupted_at is None:
            return 0.0
        return max(0.0, self.disrupted_at + self.grace - asyncio.get_running_loop().time())

    def _disrupted(self) -> None:
        self.disrupted_at = asyncio.get_running_loop().time()

    def _node_key(self, node_id: str) -> bytes:
        return self.prefix + b"nodes/" + node_id.encode()

    def _addr_key(self, addr: str) -> bytes:
        return self.prefix + b"addrs/" + addr.encode()

    # ---------------------------------------------------------------- joining

    async def join(self, node_id: str, addr: str, listener: MembershipListener) -> None:
        self.node_id, self.addr, self.listener = node_id, addr, listener
        await self._first_lease()
        try:
            await self._register()
            await self._resync()
        except Unavailable as e:
            raise ClusterError(f"lost {self.where} while joining cluster {self.cluster!r}: {e}") from None
        self._spawn(self._keep_alive())
        self._spawn(self._watch(self.change_key, self._read_map, self._on_change_event))
        self._spawn(self._watch(self.leader_key, self._read_leader, self._on_leader_event))

    async def _first_lease(self) -> None:
        """Grant our lease, retrying until ``connect_timeout``: the one bounded wait at start."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout
        while True:
            try:
                self.lease, self.ttl = await self.kv.grant(self.ttl)
                return
            except Unavailable as e:
                if loop.time() >= deadline:
                    raise ClusterError(f"cannot reach {self.where} for cluster {self.cluster!r} within "
                                       f"{self.connect_timeout:g} s: {e}") from None
            await asyncio.sleep(RETRY_SECONDS)

    async def _register(self) -> None:
        """Create our node and address keys, waiting out one ttl for a dead holder of the address."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ttl + 1.0
        node_key, addr_key = self._node_key(self.node_id), self._addr_key(self.addr)
        while True:
            ok, _ = await self.kv.txn([Compare("create", addr_key, 0), Compare("create", node_key, 0)],
                                      [Put(node_key, self.addr.encode(), self.lease),
                                       Put(addr_key, self.node_id.encode(), self.lease)])
            holder = None if ok else await self._holder()
            if ok or holder == self.node_id:        # (a retried call whose first try had succeeded)
                log.info("Joined cluster %r as %s (%s), lease ttl %d s", self.cluster, self.node_id, self.addr, self.ttl)
                return
            if loop.time() >= deadline:
                await self.kv.revoke(self.lease)
                raise ClusterError(f"address {self.addr} is already announced by node {holder} in "
                                   f"cluster {self.cluster!r}: give every node its own --announce address")
            await self.kv.keepalive(self.lease)
            await asyncio.sleep(RETRY_SECONDS)

    async def _holder(self) -> str:
        _, found = await self.kv.get_prefix(self._addr_key(self.addr))
        return found[0].value.decode(errors="replace") if found else "(gone)"

    # ---------------------------------------------------------------- leaving

    async def leave(self) -> None:
        await self._stop_tasks()
        try:
            await self.kv.revoke(self.lease)
            log.info("Left cluster %r", self.cluster)
        except Unavailable as e:
            log.warning("Could not leave cluster %r cleanly (%s): the registration expires in %d s",
                        self.cluster, e, self.ttl)
        await self.kv.close()

    async def abandon(self) -> None:
        await self._stop_tasks()
        await self.kv.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _stop_tasks(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._set_leader(False)

    # ---------------------------------------------------------------- lease

    async def _keep_alive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                sent = loop.time()
                remaining = await self.kv.keepalive(self.lease)
                if loop.time() - sent > self.ttl / 3:
                    self._disrupted()               # etcd stalled: leases may have lapsed on its side
                if remaining <= 0:
                    self._disrupted()
                    await self._rejoin()
                elif self.leader_id is None and self._campaign_due():
                    await self._campaign()
                self._set_reachable(True)
            except Unavailable as e:
                self._set_reachable(False, str(e))
            except ClusterError as e:
                log.error("%s", e)

    async def _rejoin(self) -> None:
        log.warning("Lease expired (%s heard nothing from this node for %d s): joining cluster %r again",
                    self.where, self.ttl, self.cluster)
        self._set_leader(False)
        self.lease, self.ttl = await self.kv.grant(self.ttl)
        await self._register()
        if self.leader_id is None and self._campaign_due():
            await self._campaign()

    def _set_reachable(self, reachable: bool, why: str = "") -> None:
        if not reachable:
            self._disrupted()
        if reachable != self.reachable:
            self.reachable = reachable
            if reachable:
                log.warning("%s is reachable again", self.where)
            else:
                log.warning("%s is unreachable (%s): serving the last slot map, changing nothing", self.where, why)

    # ---------------------------------------------------------------- leadership

    async def _campaign(self) -> None:
        if self._campaigning or self.leader_id is not None:
            return
        self._campaigning = True
        try:
            ok, revision = await self.kv.txn([Compare("create", self.leader_key, 0)],
                                             [Put(self.leader_key, self.node_id.encode(), self.lease)])
        except Unavailable:
            self._disrupted()
            return                      # the keep-alive loop campaigns again once etcd answers
        finally:
            self._campaigning = False
        if ok:
            self.leader_id, self.leader_revision = self.node_id, revision
            self._set_leader(True)

    def _campaign_due(self) -> bool:
        return asyncio.get_running_loop().time() >= self._leaderless_since + self._rank * CAMPAIGN_STEP

    async def _campaign_in_turn(self) -> None:
        await asyncio.sleep(self._rank * CAMPAIGN_STEP)
        await self._campaign()

    def _leader_seen(self, kv: KeyValue | None) -> None:
        if kv is None:
            old, self.leader_id = self.leader_id, None
            self._set_leader(False)
            candidates = sorted(node_id for node_id in self.listener.map_nodes() if node_id != old)
            self._rank = candidates.index(self.node_id) if self.node_id in candidates else len(candidates)
            self._leaderless_since = asyncio.get_running_loop().time()
            self._spawn(self._campaign_in_turn())
            return
        self.leader_id = kv.value.decode(errors="replace")
        mine = self.leader_id == self.node_id and kv.lease == self.lease
        if mine:
            self.leader_revision = kv.create_revision
        self._set_leader(mine)

    def _set_leader(self, leader: bool) -> None:
        """Start leading (once the registrations are read: `_lead`) or stop."""
        if leader:
            if not self.is_leader and (self._leading is None or self._leading.done()):
                self._leading = self._spawn(self._lead())
            return
        if self._leading is not None:
            self._leading.cancel()
            self._leading = None
        self.nodes = {}
        self.revisions.pop(self.prefix + b"nodes/", None)      # read them again when leading again
        self._announce_leader(False)

    async def _lead(self) -> None:
        """Read the registrations, act as leader, and follow them while leading."""
        def started() -> None:
            self.listener.on_nodes(dict(self.nodes))
            self._announce_leader(True)
        await self._watch(self.prefix + b"nodes/", self._read_nodes, self._on_node_event, started)

    def _announce_leader(self, leader: bool) -> None:
        if leader != self.is_leader:
            self.is_leader = leader
            log.info("%s leadership of cluster %r", "Took" if leader else "Lost", self.cluster)
            if self.listener is not None:
                self.listener.on_leader(leader)

    # ---------------------------------------------------------------- the map

    def propose(self, slot_map: SlotMap, base: SlotMap | None = None) -> None:
        if not self.is_leader:
            return
        self._proposal = (slot_map, base, self.map_revision, self.leader_revision)
        if self._writer is None or self._writer.done():
            self._writer = self._spawn(self._write_proposals())

    async def _write_proposals(self) -> None:
        while self._proposal is not None and self.is_leader:
            slot_map, made_from, base, leadership = self._proposal
            self._proposal = None
            record = change_record(made_from or SlotMap.empty().with_epoch(-1), slot_map)
            try:
                ok, _ = await self.kv.txn([Compare("create", self.leader_key, leadership),
                                           Compare("mod", self.map_key, base)],
                                          [Put(self.map_key, slot_map.to_json()), Put(self.change_key, record)])
            except Unavailable as e:
                self._set_reachable(False, str(e))
                self._proposal = self._proposal or (slot_map, made_from, base, leadership)
                await asyncio.sleep(RETRY_SECONDS)
                continue
            if ok:
                log.info("Wrote slot map epoch %d: %d nodes, %d slots assigned",
                         slot_map.epoch, len(slot_map.nodes), slot_map.assigned)
            else:
                log.info("Slot map epoch %d not written: the map or the leader changed meanwhile", slot_map.epoch)
                self._fetch_map()           # a map written without a record is seen only this way

    # ---------------------------------------------------------------- watching

    async def _resync(self) -> None:
        """Read the map and the leader key (at join)."""
        await self._read_map()
        await self._read_leader()

    async def _read(self, prefix: bytes) -> list[KeyValue]:
        revision, kvs = await self.kv.get_prefix(prefix)
        self.revisions[prefix] = revision
        return kvs

    async def _read_map(self) -> None:
        """The whole map, as the change watch starts (or restarts after a compaction) from here."""
        revision, kvs = await self.kv.get_prefix(self.map_key)
        self.revisions[self.change_key] = revision
        for kv in kvs:
            if kv.key == self.map_key and kv.mod_revision != self.map_revision:
                self.map_revision = kv.mod_revision
                self.listener.on_map(kv.value)

    def _fetch_map(self) -> None:
        if self._fetching is None or self._fetching.done():
            self._fetching = self._spawn(self._fetch())

    async def _fetch(self) -> None:
        """Read the whole map once (a record was not for the map held, or a write failed on it)."""
        while True:
            try:
                _, kvs = await self.kv.get_prefix(self.map_key)
                break
            except Unavailable as e:
                self._set_reachable(False, str(e))
                await asyncio.sleep(RETRY_SECONDS)
        for kv in kvs:
            if kv.key == self.map_key and kv.mod_revision > self.map_revision:
                self.map_revision = kv.mod_revision
                self.listener.on_map(kv.value)

    async def _read_leader(self) -> None:
        found = [kv for kv in await self._read(self.leader_key) if kv.key == self.leader_key]
        self._leader_seen(found[0] if found else None)

    async def _read_nodes(self) -> None:
        nodes = {}
        for kv in await self._read(self.prefix + b"nodes/"):
            node_id, addr = kv.key[len(self.prefix) + 6:].decode(errors="replace"), kv.value.decode(errors="replace")
            if self._valid_node(node_id, addr):
                nodes[node_id] = addr
        self._set_nodes(nodes)

    async def _watch(self, prefix: bytes, read, on_event, started=None) -> None:
        """Follow ``prefix`` from the revision after the last one seen; ``read`` it (again) first
        when nothing was read yet or the history is compacted; ``started()`` once it was read."""
        backoff, resync = RETRY_SECONDS, prefix not in self.revisions
        while True:
            try:
                if resync:
                    await read()
                    resync = False
                    if started is not None:
                        started()
                        started = None
                async for event in self.kv.watch_prefix(prefix, self.revisions[prefix] + 1):
                    self._set_reachable(True)
                    backoff = RETRY_SECONDS
                    self.revisions[prefix] = max(self.revisions[prefix], event.kv.mod_revision)
                    try:
                        on_event(event)
                    except Exception:
                        # A bug applying one event must not stop the watch (the node would go deaf).
                        log.exception("Applying watch event on %r failed", event.kv.key)
            except Compacted as e:
                log.warning("Watch history is compacted (%s): reading %r again", e, prefix)
                resync = True
                continue
            except Unavailable as e:
                self._set_reachable(False, str(e))
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, MAX_WATCH_BACKOFF)

    def _on_change_event(self, event: Event) -> None:
        if event.kv.key != self.change_key or event.deleted or event.kv.mod_revision <= self.map_revision:
            return
        if self.listener.on_change(event.kv.value):
            self.map_revision = event.kv.mod_revision      # written with the map, in one transaction
        else:
            self._fetch_map()

    def _on_leader_event(self, event: Event) -> None:
        if event.kv.key == self.leader_key:
            self._leader_seen(None if event.deleted else event.kv)

    def _on_node_event(self, event: Event) -> None:
        self._node_changed(event.kv.key[len(self.prefix) + 6:].decode(errors="replace"),
                           None if event.deleted else event.kv.value.decode(errors="replace"))

    def _node_changed(self, node_id: str, addr: str | None) -> None:
        nodes = dict(self.nodes)
        if addr is None:
            nodes.pop(node_id, None)
        elif self._valid_node(node_id, addr):
            nodes[node_id] = addr
        self._set_nodes(nodes)

    def _valid_node(self, node_id: str, addr: str) -> bool:
        """Entries someone else wrote under our prefix are checked before they reach an assignment."""
        try:
            if not NODE_ID.fullmatch(node_id):
                raise SlotMapError(f"bad node id {node_id!r}")
            check_address(addr)
            return True
        except SlotMapError as e:
            log.error("Ignoring a malformed node entry in %s: %s", self.where, e)
            return False

    def _set_nodes(self, nodes: dict[str, str]) -> None:
        if nodes != self.nodes:
            self.nodes = nodes
            self.listener.on_nodes(dict(nodes))


class InMemoryMembership(EtcdMembership):
    """The same membership over an in-process `FakeEtcd` shared by every simulated node."""

    def __init__(self, store: FakeEtcd, cluster: str, node_timeout: float, *, connect_timeout: float = 10.0):
        super().__init__(store.client(), cluster, node_timeout, connect_timeout=connect_timeout,
                         where="in-memory etcd")
        self.store = store
