"""Moving slots with their values when a node joins or leaves cleanly.

The leader first writes a step map (node.py) in which the slots that change
hands still belong to their owners but are marked as moving. The source of a
moving slot then pushes the slot's values to the target, hottest first (the
keys read in the last heat windows, by reads, then the others newest first),
for at most the move budget, whatever tier they live in (values on SSD or
GPU are read off the loop first, outgoing.py); whatever is left when the
budget is spent is dropped: it is a cache, and a cold value costs more to
move than to miss. Bytes moved and dropped are counted (INFO's cluster
section) and logged. The source reports to the leader, which writes
the final map; without a report it does so after the budget and a grace.

The budget (`move_seconds`) is what moving a whole DRAM over the NIC takes,
with a margin, and at least ``cluster-move-budget``. Not the bytes this
source moves: a join's newcomer receives its share from many sources at
once, so their pushes end together, when its NIC has taken about one node's
DRAM; a clean leave sends the leaver's over its own NIC. A fixed budget cut
every move of a node whose DRAM its NIC takes longer to carry (160 GiB at
100 Gbit/s: 13.7 s against 5). Leader and sources compute the same budget
from the same settings, so the leader's timer does not end a step its
sources are still inside.

While a slot moves, Redis's ASK protocol keeps every read and write correct
without stopping anything: the source takes each value out of its index as it
sends it, so the key is no longer here and a client is told ``ASK`` (to read
it, or write it, on the target with ASKING); a key still here is served here.
A value pushed (KV.IMPORT) never overwrites a write: the target stores it only
if the key is absent (or only a copy of a hot block) and was not written or
deleted there since the slot started coming in (`ImportGuard`), so a write that reached the target first is never
undone by an older pushed value. The same rule lets the holders of a dead
owner's copies push them to the slot's new owner for a while after the map
gave it the slot.

Chain links travel with the values (moved_links.py): a value's children, here
and on other nodes, go in the push that carries it (KV.IMPORTLINK after its
KV.IMPORT), so its new owner holds them while the slot is still coming in, and
the eviction cascade, which acts for the slots moving in and out of a node
(cascade.py), keeps chains prefixes through a rebalance.

After a map is applied, a node removes the values of slots it no longer
serves (a sweep in chunks, so the loop keeps serving): they would otherwise
sit unreachable until evicted. Copies of hot blocks are not its values and stay.

A clean leave (SIGTERM) first drains the node: it asks the leader to give its
slots to the others (KV.DRAIN), serves while its values move, and leaves once
the map gives it no slot, or when the wait is over.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from kvstore.cluster.moved_links import MovedLinks
from kvstore.cluster.node import MOVE_GRACE, ClusterState
from kvstore.cluster.outgoing import Gathered, Outbox, Taken, in_host_memory, take
from kvstore.cluster.peer import PeerError, PeerReplyError, Peers
from kvstore.cluster.simclock import loop_time
from kvstore.cluster.slots import SlotMap, keyslot
from kvstore.cluster.tasks import BackgroundTasks

log = logging.getLogger("kvstore.cluster")

SCAN_CHUNK = 2048                   # keys looked at between two turns of the event loop
ACCEPT_SECONDS = 10.0               # a slot gained from a dead node takes pushed copies this long
MAX_TOUCHED = 1_000_000             # keys remembered as written while slots come in
FOREVER = float("inf")
DRAIN_POLL = 0.2
MAP_WAIT = 2.0                      # how long a push waits for its target to apply the sender's map
MOVE_MARGIN = 1.5                   # the NIC also carries reads, copies and other moves
KV_IMPORT, KV_MIGRATED, KV_DRAIN = "KV.IMPORT", "KV.MIGRATED", "KV.DRAIN"
IMPORT_SPAN = 1 << 22       # LRU stamps one step's pushed values take (Migrator.stamp_import)


def move_seconds(least: float, dram_bytes: int, nic_bytes_per_s: float) -> float:
    """How long a clean move may push: a whole DRAM over the NIC, with a margin, and at least
    ``least`` (the cluster-move-budget setting; 0: no value moves)."""
    return max(least, MOVE_MARGIN * dram_bytes / nic_bytes_per_s) if least > 0 else 0.0


@dataclass
class MoveStats:
    moves: int = 0                  # slot moves this node ran as a source
    moved_keys: int = 0
    moved_bytes: int = 0
    dropped_keys: int = 0           # values of moving or lost slots not moved (cold, over budget, unreachable)
    dropped_bytes: int = 0
    imported_keys: int = 0          # values pushed here and stored
    imported_bytes: int = 0
    last_move_seconds: float = 0.0


class ImportGuard:
    """Which pushed values a node takes: keys of slots coming in, never over a write made here since.

    ``accepting`` maps a slot to the `loop_time` until which it takes
    pushed values (forever while the map says it is importing); ``touched``
    holds, per such slot, the keys written or deleted here since it started
    coming in.
    """

    def __init__(self):
        self.accepting: dict[int, float] = {}
        self.touched: dict[int, set[bytes]] = {}
        self.remembered = 0
        self.storing = False            # our own KV.IMPORT commits are not writes to guard against

    def on_map(self, cluster: ClusterState, old: SlotMap, new: SlotMap) -> None:
        now = loop_time()
        me = cluster.my_id
        for slot, (_, target) in new.migrating.items():
            if target == me and self.accepting.get(slot) != FOREVER:
                self._open(slot, FOREVER)
        for slot in (new.slots_of(me) & ~old.slots_of(me)).nonzero()[0].tolist():
            if slot in self.accepting:
                self.accepting[slot] = now + ACCEPT_SECONDS        # its import ended: what it touched stands
            else:
                self._open(slot, now + ACCEPT_SECONDS)              # gained from a node that died
        for slot, until in list(self.accepting.items()):
            if until == FOREVER and cluster.importing_from(slot) is None:
                self._close(slot)                                   # a move that did not happen
        self.expire(now)

    def _open(self, slot: int, until: float) -> None:
        self._close(slot)
        self.accepting[slot] = until
        self.touched[slot] = set()

    def _close(self, slot: int) -> None:
        self.accepting.pop(slot, None)
        self.remembered -= len(self.touched.pop(slot, ()))

    def touch(self, key: bytes) -> None:
        if self.accepting and not self.storing:
            keys = self.touched.get(keyslot(key))
            if keys is not None and key not in keys:
                keys.add(key)
                self.remembered += 1
                if self.remembered > MAX_TOUCHED:           # too much to remember: take no more pushes
                    for slot in list(self.accepting):
                        self._close(slot)

    def accepts(self, key: bytes, engine, held) -> bool:
        """Whether a pushed value of ``key`` may be stored: its slot is coming in, and the key is untouched
        since and absent here, or only a copy of a hot block (older than, or the same as, what comes)."""
        slot = keyslot(key)
        until = self.accepting.get(slot)
        return until is not None and until > loop_time() and key not in self.touched[slot] \
            and (key in held or engine.lookup(key) is None)

    def expire(self, now: float) -> None:
        for slot in [slot for slot, until in self.accepting.items() if until <= now]:
            self._close(slot)


class ImportStamps:
    """The place in the LRU order of values pushed here by a move.

    Sources push the hottest first, so arrival order is the reverse of recency: stored as
    they arrive, the hottest would be the oldest here and go first when the newcomer's
    DRAM fills. Each step's imports take the stamps below a point IMPORT_SPAN ahead of the
    clock, one lower each: newer than whatever was here before the step, older than what
    is written or read during it, and the first pushed the newest among them.
    """

    def __init__(self, policy):
        self.policy = policy
        self.epoch = -1                 # the step (its map's epoch) being stamped
        self.base = self.seq = 0

    def stamp(self, epoch: int, entry: int) -> None:
        policy = self.policy
        if epoch != self.epoch or self.base > policy.clock:     # a new step, or the stamps were halved
            self.epoch, self.seq = epoch, 0
            self.base = policy.advance(IMPORT_SPAN)
        self.seq += 1
        policy.backdate(entry, max(1, self.base - self.seq))


class Migrator:
    """This node's part in slot moves: source (push, drop, report), target (guarded imports), sweeps, drain."""

    def __init__(self, engine, cluster: ClusterState, peers: Peers, config: Callable[[], object],
                 heat: Callable[[], dict[bytes, float]], tiers=None, nic_bytes_per_s: float | None = None):
        self.engine = engine
        self.tiers = tiers              # the node's TierManager: values on SSD or GPU are read through it
        self.cluster = cluster
        self.peers = peers
        self.config = config            # the node's live Config (cluster-move-budget, cluster-nic-gbps)
        self.nic_bytes_per_s = nic_bytes_per_s      # a simulation's modelled NIC; else the config's
        self.heat = heat                # recent reads per key: what moves first
        self.guard = ImportGuard()
        self.links = MovedLinks(engine, cluster)
        self.stats = MoveStats()
        self._moving_epoch = 0
        self.import_stamps = ImportStamps(engine.eviction)
        self._tasks = BackgroundTasks()
        self._sweeping = False

    @property
    def budget(self) -> float:
        config = self.config()
        nic = self.nic_bytes_per_s or config.cluster_nic_gbps * 1e9 / 8
        return move_seconds(config.cluster_move_budget, self.engine.allocator.capacity, nic)

    def attach(self) -> None:
        engine = self.engine
        engine.commit_listeners.append(lambda key, entry: self.guard.touch(key))
        engine.drop_listeners.append(lambda entry, key: self.guard.touch(key))
        engine.overwrite_listeners.append(self.guard.touch)
        self.cluster.add_listener(self._on_map)
        self.cluster.moves = self

    # ------------------------------------------------------------ the map changes

    def _on_map(self, old: SlotMap, new: SlotMap) -> None:
        me = self.cluster.my_id
        self.guard.on_map(self.cluster, old, new)
        moving = {slot: target for slot, (source, target) in new.migrating.items() if source == me}
        if moving and new.epoch != self._moving_epoch:
            self._moving_epoch = new.epoch
            self._tasks.spawn(self._move(new.epoch, moving))
        if (old.slots_of(me) & ~new.slots_of(me)).any() and not self._sweeping:
            self._tasks.spawn(self._sweep())

    # ------------------------------------------------------------ source

    def _ordered_keys(self, moving: dict[int, str]) -> list[bytes]:
        """The keys of the moving slots worth moving first: read most in the last windows, then newest."""
        heat = self.heat()
        hot = sorted((key for key in heat if keyslot(key) in moving), key=heat.get, reverse=True)
        return hot + [key for key in reversed(list(self.engine.index)) if key not in heat]

    async def _move(self, epoch: int, moving: dict[int, str]) -> None:
        started = loop_time()
        deadline = started + self.budget
        engine, outbox = self.engine, Outbox(self._push)
        group = Gathered(engine, self.tiers, self.links.capture)
        moved0, dropped0 = self.stats.moved_bytes, self.stats.dropped_bytes
        for i, key in enumerate(self._ordered_keys(moving)):
            if i % SCAN_CHUNK == SCAN_CHUNK - 1:
                await asyncio.sleep(0)
            entry = engine.lookup(key)
            if entry is None or not self._still_moving(key, moving):
                continue
            if loop_time() >= deadline:
                self._dropped(1, engine.size_of(entry))
                engine.delete(key)
            elif group.add(key, engine.size_of(entry)):
                await self._send_group(group, moving, outbox)
        await self._send_group(group, moving, outbox)
        await outbox.flush()
        self._finish_move(epoch, moving, started, moved0, dropped0)
        await self._report(epoch)

    def _still_moving(self, key: bytes, moving: dict[int, str]) -> bool:
        """Whether ``key``'s slot is one this move sends, to the target the map still names."""
        slot = keyslot(key)
        target = moving.get(slot)
        return target is not None and self.cluster.migrating_to(slot) == target

    async def _send_group(self, group: Gathered, moving: dict[int, str], outbox: Outbox) -> None:
        """Take the gathered values (those on SSD or GPU read first, off the loop) into the outbox."""
        if not group.keys:
            return
        taken, lost_keys, lost_bytes = await group.take(lambda key: self._still_moving(key, moving))
        self._dropped(lost_keys, lost_bytes)
        for item in taken:
            await outbox.add(moving[keyslot(item.key)], item)

    async def _push(self, target: str, batch: list[Taken]) -> None:
        """Move one batch of taken values to ``target``; what it did not store counts as dropped."""
        keys, stored = await self._send(target, batch)
        self.stats.moved_keys += keys
        self.stats.moved_bytes += stored
        self._dropped(len(batch) - keys, sum(item.size for item in batch) - stored)

    async def _send(self, target: str, batch: list[Taken]) -> tuple[int, int]:
        """KV.IMPORT of taken values at ``target``, then their chain links (KV.IMPORTLINK) in the same
        pipeline, holds released after: (keys, bytes) it stored.

        A target that has not applied our map yet answers TRYAGAIN: we try
        again for a while (the watch brings it the map within milliseconds).
        """
        addr = self.cluster.addr_of(target) or self.cluster.nodes.get(target)
        args = [part for item in batch for part in (item.key, item.parent, item.tenant, item.view)]
        links = self.links.commands(batch)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + MAP_WAIT
        linked = False
        try:
            while addr is not None and batch:
                try:
                    replies = await self.peers.link(addr).pipeline([(KV_IMPORT, self.cluster.map.epoch, *args),
                                                                    *links])
                    if isinstance(replies[0], PeerReplyError):
                        raise replies[0]
                    linked = not any(isinstance(reply, PeerReplyError) for reply in replies[1:])
                    keys, stored = replies[0]
                    return keys, stored
                except PeerReplyError as e:
                    if not str(e).startswith("TRYAGAIN") or loop.time() > deadline:
                        raise
                await asyncio.sleep(DRAIN_POLL / 4)
        except (PeerError, PeerReplyError) as e:
            log.warning("Pushing %d values to %s failed: %s", len(batch), addr, e)
        finally:
            self.links.done(batch, linked)
            for item in batch:
                self.engine.holds.release(item.hold)
        return 0, 0

    def _dropped(self, keys: int, size: int) -> None:
        self.stats.dropped_keys += keys
        self.stats.dropped_bytes += size

    def _finish_move(self, epoch: int, moving: dict[int, str], started: float, moved0: int, dropped0: int) -> None:
        elapsed = loop_time() - started
        self.stats.moves += 1
        self.stats.last_move_seconds = elapsed
        targets = sorted({self.cluster.addr_of(t) or t for t in moving.values()})
        log.info("Moved %d slots (epoch %d) to %s in %.2f s: %d bytes moved, %d bytes dropped",
                 len(moving), epoch, ", ".join(targets), elapsed, self.stats.moved_bytes - moved0,
                 self.stats.dropped_bytes - dropped0)

    async def _report(self, epoch: int) -> None:
        """Tell the leader this node's part of the step at ``epoch`` is done (the leader's timer covers a loss)."""
        cluster = self.cluster
        leader = getattr(cluster.membership, "leader_id", None)
        if leader == cluster.my_id:
            cluster.moves_done(cluster.my_id, epoch)
            return
        addr = cluster.nodes.get(leader) if leader else None
        if addr is None:
            return
        try:
            await self.peers.link(addr).call(KV_MIGRATED, cluster.my_id, epoch)
        except (PeerError, PeerReplyError) as e:
            log.info("Could not report the end of the move to the leader at %s: %s", addr, e)

    # ------------------------------------------------------------ copies of a dead owner

    def rescue(self, owner: str, keys: list[bytes]) -> None:
        """Push the copies ``keys`` (this node held for a node that died) to the slot's new ``owner``."""
        engine = self.engine
        batch = [take(engine, key, entry) for key in keys
                 if (entry := engine.lookup(key)) is not None and in_host_memory(engine, entry)]
        self._tasks.spawn(self._send(owner, batch))

    # ------------------------------------------------------------ target

    @contextmanager
    def storing(self):
        """Around a KV.IMPORT's commits: they are the push itself, not writes that supersede it."""
        self.guard.storing = True
        try:
            yield
        finally:
            self.guard.storing = False

    def accepts(self, key: bytes) -> bool:
        copies = self.cluster.copies
        return self.guard.accepts(key, self.engine, copies.held if copies is not None else ())

    def refuse(self, key: bytes) -> None:
        """Take no pushed value of ``key`` from now on: the cascade dropped it here (cascade.py), so a
        push of it still on its way would come back without the block before it in its chain."""
        self.guard.touch(key)

    def went_since_import(self, key: bytes) -> bool:
        """Whether ``key``, of a slot coming in (or that came in lately), was written, dropped or
        deleted here since (the guard's record; a caller that finds it absent knows it went)."""
        keys = self.guard.touched.get(keyslot(key))
        return keys is not None and key in keys

    def stamp_import(self, epoch: int, entry: int) -> None:
        self.import_stamps.stamp(epoch, entry)

    def count_import(self, keys: int, size: int) -> None:
        self.stats.imported_keys += keys
        self.stats.imported_bytes += size

    # ------------------------------------------------------------ sweep

    async def _sweep(self) -> None:
        """Remove the values of slots this node does not serve (copies and incoming slots excepted)."""
        self._sweeping = True
        try:
            cluster, engine = self.cluster, self.engine
            held = cluster.copies.held if cluster.copies is not None else ()
            keys, removed, size = list(engine.index), 0, 0
            for i, key in enumerate(keys):
                if i % SCAN_CHUNK == SCAN_CHUNK - 1:
                    await asyncio.sleep(0)
                slot = keyslot(key)
                if cluster.is_mine(slot) or key in held or cluster.importing_from(slot) is not None:
                    continue
                found = engine.lookup(key)
                if found is not None:
                    size += engine.size_of(found)
                    removed += 1
                    engine.delete(key)
            if removed:
                self._dropped(removed, size)
                log.info("Removed %d values (%d bytes) of slots this node no longer serves", removed, size)
        finally:
            self._sweeping = False

    # ------------------------------------------------------------ clean leave

    async def drain(self) -> None:
        """Have the leader move this node's slots away, and wait (bounded) until the map gives it none."""
        cluster = self.cluster
        if cluster.copies is not None:
            cluster.copies.held.drop_all()      # their owners will not reach us to remove them soon
        if self.budget <= 0 or cluster.membership is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.budget + MOVE_GRACE + 2 * DRAIN_POLL + cluster.settle
        started = loop.time()
        while loop.time() < deadline and cluster.map.counts.get(cluster.my_id, 0):
            if await self._ask_drain() == 0:
                log.info("No other node takes slots: leaving without moving values")
                return
            await asyncio.sleep(DRAIN_POLL)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        log.info("Drained in %.2f s: %d bytes moved, %d bytes dropped", loop.time() - started,
                 self.stats.moved_bytes, self.stats.dropped_bytes)

    async def _ask_drain(self) -> int | None:
        """The leader's answer to KV.DRAIN: how many nodes take slots (None: no leader reachable)."""
        cluster = self.cluster
        leader = getattr(cluster.membership, "leader_id", None)
        if leader == cluster.my_id:
            return cluster.drain_node(cluster.my_id)
        addr = cluster.nodes.get(leader) if leader else None
        if addr is None:
            return None
        try:
            return await self.peers.link(addr).call(KV_DRAIN, cluster.my_id)
        except (PeerError, PeerReplyError) as e:
            log.info("Drain request to the leader at %s failed: %s", addr, e)
            return None

    # ------------------------------------------------------------ helpers

    def info(self) -> dict:
        s = self.stats
        return {"cluster_moves": s.moves, "cluster_moved_keys": s.moved_keys, "cluster_moved_bytes": s.moved_bytes,
                "cluster_dropped_keys": s.dropped_keys, "cluster_dropped_bytes": s.dropped_bytes,
                "cluster_imported_keys": s.imported_keys, "cluster_imported_bytes": s.imported_bytes,
                "cluster_moved_links": self.links.sent, "cluster_moved_links_lost": self.links.lost,
                "cluster_moved_links_pending": self.links.pending,
                "cluster_last_move_seconds": f"{s.last_move_seconds:.3f}"}

    def close(self) -> None:
        self._tasks.cancel_all()
