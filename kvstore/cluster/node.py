"""What a node knows of its cluster (`ClusterState`): the map in force, who it is, and the leader's duty.

A server in cluster mode holds one `ClusterState` as ``server.cluster``.
Command dispatch asks it one question per command (``owner(slot)`` /
``is_mine(slot)``, with ``importing_from``/``migrating_to`` while a slot
moves); those are list and bytes lookups, computed once per map.

Maps arrive from membership as raw bytes and are applied only when valid and
newer: a malformed map, an older epoch, or a different map at the epoch in
force is refused and logged, and the node keeps serving the one it has. When
this node is the leader, every change of the node set (and every refused map)
leads to a new assignment (assign.py) that membership writes to etcd; the
leader applies it like everyone else, when the watch brings it back. Changes
arriving within ``settle`` seconds are assigned together, so nodes starting
at once produce one map, not one per node.

Clean moves (``move_budget`` > 0). When a join, or a leave announced with
``drain_node``, moves slots between live nodes, the leader first writes a
step map in which those slots still belong to their owners but are marked as
moving (Redis's ASK protocol serves them meanwhile; migration.py pushes their
values), then the final map once every source has reported with
``moves_done``, or ``move_budget`` + ``MOVE_GRACE`` seconds after the step,
or as soon as a node of a move is gone. A slot whose owner died moves at
once: there is nothing left to push. A draining node gets no slots; it stays
registered until its slots are gone and then leaves.

An etcd stall is not a node failure: while membership's `grace_left` runs
(etcd failed this node recently, so leases may have lapsed on etcd's side
without any node dying), the leader counts the nodes of the map in force
that are missing from the registrations as live, and looks again when the
grace ends. A node that registers again meanwhile finds its slots where it
left them; a node still missing then is gone, and its slots move.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable

import numpy as np

from kvstore.cluster.assign import finish_moves, plan_moves, rebalance
from kvstore.cluster.membership import Membership
from kvstore.cluster.mapchange import apply_change
from kvstore.cluster.slots import SLOTS, SlotMap, SlotMapError, keyslot

log = logging.getLogger("kvstore.cluster")

SETTLE_SECONDS = 0.1
MOVE_GRACE = 2.0            # beyond the move budget, before the leader ends a step no source reported
MapListener = Callable[[SlotMap, SlotMap], None]


def new_node_id() -> str:
    """A fresh 40-hex-digit id, as Redis Cluster node ids look (a cache node gets a new one per start)."""
    return secrets.token_hex(20)


class ClusterState:
    """This node's view of the cluster; ``membership`` None for a node fed maps by hand (tests)."""

    def __init__(self, node_id: str, announce: str, membership: Membership | None = None,
                 settle: float = SETTLE_SECONDS, move_budget: float = 0.0):
        self.my_id = node_id
        self.announce = announce
        self.membership = membership
        self.settle = settle
        self.move_budget = move_budget          # seconds a clean move may push (migration.move_seconds); 0: none
        self.nodes: dict[str, str] = {}         # leader: live registrations; others: the map's nodes
        self.refused = 0                        # maps refused since start
        self.map = SlotMap.empty()
        self._owners: list[str | None] = self.map.owner_list
        self.mine = bytes(SLOTS)                # mine[slot] == 1: this node serves the slot
        self._listeners: list[MapListener] = []
        self._pending: asyncio.TimerHandle | None = None
        self._repair = False
        self.draining: set[str] = set()         # the leader's: nodes leaving cleanly (no slots for them)
        self._reports: dict[int, set[str]] = {}  # step epoch -> sources that finished pushing
        self._step_timer: asyncio.TimerHandle | None = None
        self._step_expired = 0                  # epoch of the last step whose time ran out
        self._grace_timer: asyncio.TimerHandle | None = None
        self.copies = None                      # replication.HotCopies, when the node runs it
        self.moves = None                       # migration.Migrator, when the node runs it
        self.cascade = None                     # cascade.Cascade, when the node runs it

    # ---------------------------------------------------------------- queries (hot path)

    def owner(self, slot: int) -> str | None:
        return self._owners[slot]

    def is_mine(self, slot: int) -> bool:
        return self.mine[slot] == 1

    def serves_at_rest(self, key: bytes) -> bool:
        """Whether ``key``'s slot is this node's and not moving, with every slot served: then
        `routing.redirect` answers None for it whatever the connection's flags, and a plain GET
        or SET of it may skip the routing step (kvstore/commands/dispatch.py)."""
        slot = keyslot(key)
        return self.is_mine(slot) and self.ok and slot not in self.map.migrating

    def addr_of(self, node_id: str) -> str | None:
        return self.map.nodes.get(node_id)

    def migrating_to(self, slot: int) -> str | None:
        """The target node id when this node is moving ``slot`` away."""
        move = self.map.migrating.get(slot)
        return move[1] if move and move[0] == self.my_id else None

    def importing_from(self, slot: int) -> str | None:
        """The source node id when ``slot`` is moving to this node."""
        move = self.map.migrating.get(slot)
        return move[0] if move and move[1] == self.my_id else None

    @property
    def ok(self) -> bool:
        """Every slot has an owner (Redis's cluster_state:ok with full coverage required)."""
        return self.map.assigned == SLOTS

    @property
    def is_leader(self) -> bool:
        return self.membership is not None and self.membership.is_leader

    def add_listener(self, listener: MapListener) -> None:
        """Call ``listener(old, new)`` after each map change."""
        self._listeners.append(listener)

    def remove_listener(self, listener: MapListener) -> None:
        self._listeners.remove(listener)

    # ---------------------------------------------------------------- applying maps

    def apply(self, new: SlotMap) -> bool:
        """Install ``new`` if it is newer; False when it is the map in force; SlotMapError when refused."""
        old = self.map
        if new.epoch < old.epoch:
            raise SlotMapError(f"epoch {new.epoch} is older than epoch {old.epoch} in force")
        if new.epoch == old.epoch:
            if new.same_as(old):
                return False
            raise SlotMapError(f"a different map with epoch {new.epoch}, the epoch in force")
        self.map = new
        if not self.is_leader:
            self.nodes = dict(new.nodes)
        self._owners = new.owner_list
        self.mine = new.slots_of(self.my_id).astype(np.uint8).tobytes()
        self._repair = False
        self._reports = {epoch: done for epoch, done in self._reports.items() if epoch >= new.epoch}
        self._time_step()
        log.info("Slot map epoch %d applied: %d nodes, %d slots here, %d assigned",
                 new.epoch, len(new.nodes), new.counts.get(self.my_id, 0), new.assigned)
        for listener in self._listeners:
            try:
                listener(old, new)
            except Exception:
                log.exception("slot map listener %r failed", listener)
        return True

    # ---------------------------------------------------------------- membership listener

    def on_map(self, raw: bytes) -> None:
        try:
            changed = self.apply(SlotMap.from_json(raw))
        except SlotMapError as e:
            self.refused += 1
            log.error("Refusing the slot map in etcd: %s (keeping epoch %d)", e, self.map.epoch)
            self._repair = True         # the leader writes a good map over it
            changed = True
        if changed:
            self._reconcile_soon()

    def on_change(self, raw: bytes) -> bool:
        """Apply a change record to the map in force; False when it is not for that map (membership
        then reads the whole map)."""
        new = apply_change(self.map, bytes(raw))
        try:
            if new is None or not self.apply(new):
                return new is not None
        except SlotMapError:
            return False                # the whole map will say what is wrong
        self._reconcile_soon()
        return True

    def on_nodes(self, nodes: dict[str, str]) -> None:
        self.nodes = nodes
        self.draining &= nodes.keys()
        self._reconcile_soon()

    def on_leader(self, leader: bool) -> None:
        self._time_step()
        if leader:
            self._reconcile_soon()
        else:
            self.nodes = dict(self.map.nodes)

    def map_nodes(self) -> dict[str, str]:
        return self.map.nodes

    def _reconcile_soon(self) -> None:
        if self.is_leader and self._pending is None:
            self._pending = asyncio.get_running_loop().call_later(self.settle, self._reconcile)

    def _reconcile(self) -> None:
        """The leader's duty: a map for the live nodes, written if it differs from the one in force."""
        self._pending = None
        if not self.is_leader:
            return
        live = self._live()
        if self.map.migrating:
            if self._step_over(live):
                self.membership.propose(finish_moves(self.map, self._assignable(live)), self.map)
            return
        plan = rebalance(self.map, self._assignable(live), force=self._repair)
        if plan is self.map:
            return
        if self.move_budget > 0:
            plan = plan_moves(self.map, plan, live)
        self.membership.propose(plan, self.map)

    def _live(self) -> dict[str, str]:
        """The registered nodes, plus, within an etcd stall's grace, the map's nodes missing from them."""
        missing = {node_id: addr for node_id, addr in self.map.nodes.items()
                   if node_id not in self.nodes and node_id not in self.draining}
        if not missing:
            return self.nodes
        wait = self.membership.grace_left()
        if wait <= 0:
            return self.nodes
        if self._grace_timer is None:
            log.info("%d nodes of the map are not registered within %.1f s of an etcd stall: "
                     "they keep their slots until it ends", len(missing), wait)
            self._grace_timer = asyncio.get_running_loop().call_later(wait + 0.05, self._grace_over)
        taken = set(self.nodes.values())        # a node restarted on an address replaces the old one
        live = {node_id: addr for node_id, addr in missing.items() if addr not in taken}
        live.update(self.nodes)
        return live

    def _grace_over(self) -> None:
        self._grace_timer = None
        self._reconcile_soon()

    def _assignable(self, live: dict[str, str]) -> dict[str, str]:
        """The nodes that get slots: the live ones not draining (all of them when every one drains)."""
        staying = {node_id: addr for node_id, addr in live.items() if node_id not in self.draining}
        return staying or live

    # ---------------------------------------------------------------- clean moves (leader)

    def drain_node(self, node_id: str) -> int | None:
        """As leader, give ``node_id``'s slots to the others: how many nodes take them (0: none
        left, so nothing moves), or None when this node is not the leader."""
        if not self.is_leader:
            return None
        staying = [other for other in self.nodes if other != node_id and other not in self.draining]
        if staying and node_id in self.nodes and node_id not in self.draining:
            log.info("Node %s drains: its slots go to the other nodes", node_id)
            self.draining.add(node_id)
            self._reconcile_soon()
        return len(staying)

    def moves_done(self, node_id: str, epoch: int) -> None:
        """Source ``node_id`` pushed what it could of the step map at ``epoch`` (this map's, or the
        next one's when it reaches the source first; other reports are stale or bogus)."""
        if node_id in self.nodes and self.map.epoch <= epoch <= self.map.epoch + 1:
            self._reports.setdefault(epoch, set()).add(node_id)
            if epoch == self.map.epoch:
                self._reconcile_soon()

    def _step_over(self, live: dict[str, str]) -> bool:
        step = self.map
        ends = {node_id for move in step.migrating.values() for node_id in move}
        sources = {source for source, _ in step.migrating.values()}
        return (self._step_expired == step.epoch or not ends <= live.keys()
                or sources <= self._reports.get(step.epoch, set()))

    def _time_step(self) -> None:
        """While leader of a step map, end it after the move budget and grace at the latest."""
        if self._step_timer is not None:
            self._step_timer.cancel()
            self._step_timer = None
        if self.is_leader and self.map.migrating:
            epoch = self.map.epoch
            self._step_timer = asyncio.get_running_loop().call_later(
                self.move_budget + MOVE_GRACE, self._end_step, epoch)

    def _end_step(self, epoch: int) -> None:
        self._step_timer = None
        self._step_expired = epoch
        self._reconcile_soon()

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Join the cluster (ClusterError when that is impossible)."""
        await self.membership.join(self.my_id, self.announce, self)

    async def stop(self, clean: bool = True) -> None:
        """Leave (``clean``) or just go silent, as a crash would."""
        for timer in (self._pending, self._step_timer, self._grace_timer):
            if timer is not None:
                timer.cancel()
        self._pending = self._step_timer = self._grace_timer = None
        if clean:
            await self.membership.leave()
        else:
            await self.membership.abandon()
