"""Hot-block replication: copies of the blocks read most, on as many other nodes as their load needs.

A block that one prompt prefix after another reads (a system prompt's first
blocks) would make its owner's NIC the cluster's bottleneck. So each node
counts the reads of each block, weighed by its size, copies a block read past
``hot-reads`` times a second to ``hot-replicas`` other nodes or more, and
readers spread over owner and copies (READONLY connections read a copy as Redis Cluster replicas serve
reads). Whole slots are never replicated: only the few blocks that are hot.

Heat is bytes, not only reads, and a hot block's copies follow its load:
heat.py counts the reads, says how many copies a load needs and which nodes
hold them (rendezvous hashing: every node computes the same targets without
a word). A key is copied the moment its count in the current window passes
``hot-reads``; at the end of each window its copies grow or shrink to fit the
window's load, and a block read less than half the threshold over a window
cools and loses every copy.

Consistency. A reader must never get a value older than the last write
acknowledged: an overwrite, delete, expiry or eviction of a replicated key on
its owner removes the copies (KV.UNCOPY) before any write of that key is
acknowledged (dispatch defers the reply until ``take_unacked`` is done; a
removal still in flight, of all copies or of those K shrank by, holds any
write of its key). A copy is served only under a lease the owner renews
every window; a holder the owner cannot reach keeps its copy at most until
that lease lapses, so the owner then waits the lease out before
acknowledging. The lease outlasts the node timeout, so when an owner dies its
copies stay readable until the new map gives the slot to a survivor: a holder
that gets the slot keeps the value as its own, the others push their copy to
the new owner (KV.IMPORT, which never overwrites a newer write) and drop it. A
holder that gets the slot also counts every node rendezvous hashing could
have chosen as a holder of its own, so its first write of the key removes
their copies even if they have not applied the new map yet.

Memory. A copy competes for DRAM by value: it goes to make room only when it
is the value the LRU would evict anyway (held_copies.py is the holder's side),
so the copy of a block read every second outlives the holder's own cold
values; and at most ``MAX_HOT_KEYS`` keys of one owner are replicated at once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.cluster.heat import MAX_COPIES, WINDOW, Heat, rendezvous
from kvstore.cluster.held_copies import HeldCopies
from kvstore.cluster.node import ClusterState
from kvstore.cluster.peer import PeerError, PeerReplyError, Peers
from kvstore.cluster.slots import SlotMap, keyslot
from kvstore.cluster.tasks import BackgroundTasks
from kvstore.store.entries import DRAM, STAGED

log = logging.getLogger("kvstore.cluster")

MAX_HOT_KEYS = 1024         # keys one owner replicates at once
KV_COPY, KV_UNCOPY, KV_RENEW = "KV.COPY", "KV.UNCOPY", "KV.RENEW"


def lease_seconds(node_timeout: float) -> float:
    """How long a copy is served without a renewal: past a dead owner's lease in etcd and the new map."""
    return 2 * node_timeout + 1


@dataclass
class CopyStats:
    copies_made: int = 0            # copies pushed (one per holder)
    copies_removed: int = 0         # replicated keys whose copies were removed (written, cooled, evicted)
    copies_cooled: int = 0
    copies_shrunk: int = 0          # copies removed because the load needed fewer
    copies_adopted: int = 0         # copies kept as this node's own when their slot came here
    copies_rescued: int = 0         # copies pushed to a dead owner's successor
    invalidation_waits: int = 0     # holders unreachable at a write: the lease was waited out


class HotCopies:
    """Replication on one node: the keys it replicates as their owner, and (``held``) the copies it holds."""

    def __init__(self, engine, cluster: ClusterState, peers: Peers, config: Callable[[], object],
                 rescue: Callable[[str, list[bytes]], None]):
        self.engine = engine
        self.cluster = cluster
        self.peers = peers
        self.config = config                # the node's live Config (hot-reads, hot-replicas)
        self.rescue = rescue                # push copies of a dead owner's keys to their new owner
        self.heat = Heat(engine)                    # reads of owned keys, by size, with the holders'
        self.replicated: dict[bytes, tuple[str, ...]] = {}     # owner: key -> holder ids
        self.inflight: dict[bytes, asyncio.Task] = {}          # owner: key -> removal of its copies
        self.unacked: list[asyncio.Task] = []                  # removals a reply must wait for
        self.renewed_at: dict[str, float] = {}      # holder -> when its last lease grant was sent
        self.held = HeldCopies(engine, cluster)
        self.version = int(time.time() * 1000) << 16           # of the hot-key map (KV.HOTKEYS)
        self.stats = CopyStats()
        self._tasks = BackgroundTasks()
        self.refresh_settings()

    @property
    def lease(self) -> float:
        return lease_seconds(self.config().cluster_node_timeout)

    def attach(self) -> None:
        """Listen to the engine and the map (the engine's hooks are set here and nowhere else)."""
        engine = self.engine
        engine.hit_listeners.append(self._on_hit)
        engine.drop_listeners.append(self._on_drop)
        engine.commit_listeners.append(self._on_commit)
        engine.overwrite_listeners.append(self._on_overwrite)
        engine.shed_first = self.held.shed_one
        self.cluster.add_listener(self._on_map)
        self.cluster.copies = self

    def refresh_settings(self) -> None:
        cfg = self.config()
        self.heat.configure(cfg.hot_reads, cfg.hot_replicas)

    # ------------------------------------------------------------ reads (hot path)

    def _on_hit(self, entry: int) -> None:
        key = self.engine.key_of(entry)
        if self.held.read(key):
            return
        if self.heat.count(key, entry) and key not in self.replicated:
            self._replicate(key, entry, self.heat.least)

    # ------------------------------------------------------------ owner: making copies

    def targets(self, key: bytes, count: int) -> tuple[str, ...]:
        """The ``count`` holders of ``key``'s copies: among the live nodes of the map, this one excepted."""
        cluster = self.cluster
        others = [node_id for node_id in cluster.map.nodes if node_id != cluster.my_id and node_id in cluster.nodes]
        return rendezvous(key, others, count)

    def _replicate(self, key: bytes, entry: int, count: int) -> None:
        """Copy ``key`` to the first ``count`` of its targets that do not hold it yet."""
        cluster = self.cluster
        key_slot = keyslot(key)
        held = self.replicated.get(key, ())
        if (not held and len(self.replicated) >= MAX_HOT_KEYS) or key in self.inflight or not cluster.ok \
                or not cluster.is_mine(key_slot) or cluster.migrating_to(key_slot) is not None:
            return
        engine = self.engine
        if engine.tier_code(entry) != DRAM and not engine.flags_of(entry) & STAGED:
            return                                  # a value on SSD or GPU is copied once a read stages it
        new = tuple(h for h in self.targets(key, count) if h not in held)
        if not new:
            return
        self.replicated[key] = held + new
        self.version += 1
        self.stats.copies_made += len(new)
        token = engine.holds.hold(entry)             # the value stays in place while it is sent
        self._tasks.spawn(self._push(key, engine.view(entry), token, new))

    async def _push(self, key: bytes, value: memoryview, token, holders: tuple[str, ...]) -> None:
        lease_ms = int(self.lease * 1000)

        async def one(holder: str) -> None:
            addr = self._addr(holder)
            if addr is None:
                return
            self.renewed_at[holder] = asyncio.get_running_loop().time()
            try:
                await self.peers.link(addr).call(KV_COPY, self.cluster.my_id, lease_ms, key, value)
            except (PeerError, PeerReplyError) as e:
                log.debug("Copy of a hot block to %s failed: %s", addr, e)

        try:
            await asyncio.gather(*(one(holder) for holder in holders))
        finally:
            self.engine.holds.release(token)

    # ------------------------------------------------------------ owner: removing copies

    def _on_drop(self, entry: int, key: bytes) -> None:
        if not self.held.forget(key) and key in self.replicated:
            self._remove_copies(key)

    def _on_overwrite(self, key: bytes) -> None:
        if key in self.replicated:
            self._remove_copies(key)

    def _on_commit(self, key: bytes, entry: int) -> None:
        removal = self.inflight.get(key)
        if removal is not None:         # a write of a key whose copies are still being removed waits
            self.unacked.append(removal)

    def _remove_copies(self, key: bytes) -> None:
        holders = self.replicated.pop(key)
        self.version += 1
        self.stats.copies_removed += 1
        self.unacked.append(self._uncopy_soon(key, holders))

    def _shrink(self, key: bytes, count: int) -> None:
        """Keep the first ``count`` holders of ``key``; the others' copies go (a write waits for that)."""
        if count == 0:
            self._remove_copies(key)
            return
        holders = self.replicated[key]
        self.replicated[key] = holders[:count]
        self.version += 1
        self.stats.copies_shrunk += len(holders) - count
        self._uncopy_soon(key, holders[count:])

    def _uncopy_soon(self, key: bytes, holders: tuple[str, ...]) -> asyncio.Task:
        """Start removing ``key``'s copies from ``holders``, after any removal of it still in flight, so
        that a write of ``key`` waits for both (`_on_commit`)."""
        removal = self._tasks.spawn(self._uncopy(key, holders, self.inflight.get(key)))
        self.inflight[key] = removal
        removal.add_done_callback(lambda task: self.inflight.pop(key) if self.inflight.get(key) is task else None)
        return removal

    async def _uncopy(self, key: bytes, holders: tuple[str, ...], before: asyncio.Task | None) -> None:
        if before is not None:
            await asyncio.gather(before, return_exceptions=True)
        loop = asyncio.get_running_loop()

        async def one(holder: str) -> None:
            addr = self._addr(holder)
            try:
                if addr is None:
                    raise PeerError(f"node {holder} left")
                await self.peers.link(addr).call(KV_UNCOPY, key)
            except (PeerError, PeerReplyError) as e:
                wait = self.renewed_at.get(holder, 0.0) + self.lease - loop.time()
                if wait > 0:
                    log.warning("Cannot remove a copy from %s (%s): waiting %.1f s for its lease to lapse",
                                addr or holder, e, wait)
                    self.stats.invalidation_waits += 1
                    await asyncio.sleep(wait)

        await asyncio.gather(*(one(holder) for holder in holders))

    def take_unacked(self) -> asyncio.Future:
        """What the command just run must wait for before its reply goes out."""
        waits, self.unacked = self.unacked, []
        return asyncio.gather(*waits, return_exceptions=True)

    # ------------------------------------------------------------ the map changes

    def _on_map(self, old: SlotMap, new: SlotMap) -> None:
        cluster = self.cluster
        for key, holders in list(self.replicated.items()):
            if not cluster.is_mine(keyslot(key)):
                del self.replicated[key]        # its holders drop their copies on this map too
                self.version += 1
            elif not set(holders) <= new.nodes.keys():
                self._forget_holders(key, [h for h in holders if h not in new.nodes])     # they left or died
        adopted, orphans = self.held.on_map(new)
        for key, previous_owner in adopted:
            self._adopt(key, previous_owner, old)
        for owner, keys in orphans.items():
            self.stats.copies_rescued += len(keys)
            self.rescue(owner, keys)

    def _adopt(self, key: bytes, previous_owner: str, old: SlotMap) -> None:
        """Keep a copy as this node's own value; the other copies are counted as ours to remove."""
        self.stats.copies_adopted += 1
        others = [node_id for node_id in old.nodes if node_id != previous_owner]
        holders = tuple(h for h in rendezvous(key, others, MAX_COPIES) if h != self.cluster.my_id)
        if holders and len(self.replicated) < MAX_HOT_KEYS:
            self.replicated[key] = holders
            self.version += 1

    # ------------------------------------------------------------ every window

    async def run_once(self) -> None:
        """Wait out the window, then close it."""
        await asyncio.sleep(WINDOW)
        try:
            await self.tick()
        except Exception:
            log.exception("Hot-block replication tick failed")

    async def tick(self) -> None:
        """Close the window: renew leases (collecting the holders' reads), then fit each replicated
        key's copies to its load: more, fewer, or none when it cooled."""
        self.refresh_settings()
        self.heat.close_window()
        self.held.drop_lapsed()
        self.unacked = [task for task in self.unacked if not task.done()]
        by_holder: dict[str, list[bytes]] = defaultdict(list)
        for key, holders in self.replicated.items():
            for holder in holders:
                by_holder[holder].append(key)
        await asyncio.gather(*(self._renew(holder, keys) for holder, keys in by_holder.items()))
        for key in list(self.replicated):
            if self.heat.cooled(key):
                self.stats.copies_cooled += 1
                self._remove_copies(key)
            else:
                self._fit(key)

    def _fit(self, key: bytes) -> None:
        """As many copies of ``key`` as its load needs (heat.py)."""
        have = len(self.replicated[key])
        wanted = self.heat.fit(key, have)
        if wanted < have:
            self._shrink(key, wanted)
        elif wanted > have and (entry := self.engine.lookup(key)) is not None:
            self._replicate(key, entry, wanted)

    async def _renew(self, holder: str, keys: list[bytes]) -> None:
        addr = self._addr(holder)
        if addr is None:
            for key in keys:
                self._forget_holders(key, [holder])
            return
        self.renewed_at[holder] = asyncio.get_running_loop().time()
        try:
            reads = await self.peers.link(addr).call(KV_RENEW, self.cluster.my_id, int(self.lease * 1000), *keys)
        except (PeerError, PeerReplyError) as e:
            log.debug("Lease renewal at %s failed: %s", addr, e)
            return
        for key, count in zip(keys, reads):
            if count < 0:
                self._forget_holders(key, [holder])
            elif count:
                self.heat.add_reported(key, count)

    def _forget_holders(self, key: bytes, gone: list[str]) -> None:
        """``gone`` no longer hold copies of ``key`` (nothing to remove there)."""
        holders = self.replicated.get(key)
        if holders is None:
            return
        rest = tuple(h for h in holders if h not in gone)
        if rest:
            self.replicated[key] = rest
        else:
            del self.replicated[key]
        self.version += 1

    # ------------------------------------------------------------ what readers learn

    def copies_of(self, key: bytes) -> list[str]:
        """Addresses of the nodes holding copies of ``key`` (as its owner knows them)."""
        return [addr for addr in map(self._addr, self.replicated.get(key, ())) if addr is not None]

    def hot_map(self) -> list[tuple[bytes, list[str]]]:
        return [(key, self.copies_of(key)) for key in self.replicated]

    def info(self) -> dict[str, int]:
        s = self.stats
        return {"cluster_hot_keys": len(self.replicated), "cluster_copies_held": len(self.held),
                "cluster_copies_made": s.copies_made, "cluster_copies_removed": s.copies_removed,
                "cluster_copies_cooled": s.copies_cooled, "cluster_copies_shrunk": s.copies_shrunk,
                "cluster_copy_reads": self.held.reads,
                "cluster_copies_shed": self.held.shed, "cluster_copies_adopted": s.copies_adopted,
                "cluster_copies_rescued": s.copies_rescued, "cluster_invalidation_waits": s.invalidation_waits}

    # ------------------------------------------------------------ helpers

    def _addr(self, node_id: str) -> str | None:
        return self.cluster.map.nodes.get(node_id) or self.cluster.nodes.get(node_id)

    def close(self) -> None:
        self._tasks.cancel_all()
