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
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable

import numpy as np

from kvstore.cluster.assign import rebalance
from kvstore.cluster.membership import Membership
from kvstore.cluster.slots import SLOTS, SlotMap, SlotMapError

log = logging.getLogger("kvstore.cluster")

SETTLE_SECONDS = 0.1
MapListener = Callable[[SlotMap, SlotMap], None]


def new_node_id() -> str:
    """A fresh 40-hex-digit id, as Redis Cluster node ids look (a cache node gets a new one per start)."""
    return secrets.token_hex(20)


class ClusterState:
    """This node's view of the cluster; ``membership`` None for a node fed maps by hand (tests)."""

    def __init__(self, node_id: str, announce: str, membership: Membership | None = None,
                 settle: float = SETTLE_SECONDS):
        self.my_id = node_id
        self.announce = announce
        self.membership = membership
        self.settle = settle
        self.nodes: dict[str, str] = {}         # live registrations, as membership last said
        self.refused = 0                        # maps refused since start
        self.map = SlotMap.empty()
        self._owners: list[str | None] = self.map.owner_list
        self.mine = bytes(SLOTS)                # mine[slot] == 1: this node serves the slot
        self._listeners: list[MapListener] = []
        self._pending: asyncio.TimerHandle | None = None
        self._repair = False

    # ---------------------------------------------------------------- queries (hot path)

    def owner(self, slot: int) -> str | None:
        return self._owners[slot]

    def is_mine(self, slot: int) -> bool:
        return self.mine[slot] == 1

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
        self._owners = new.owner_list
        self.mine = new.slots_of(self.my_id).astype(np.uint8).tobytes()
        self._repair = False
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

    def on_nodes(self, nodes: dict[str, str]) -> None:
        self.nodes = nodes
        self._reconcile_soon()

    def on_leader(self, leader: bool) -> None:
        if leader:
            self._reconcile_soon()

    def _reconcile_soon(self) -> None:
        if self.is_leader and self._pending is None:
            self._pending = asyncio.get_running_loop().call_later(self.settle, self._reconcile)

    def _reconcile(self) -> None:
        """The leader's duty: a map for the live nodes, written if it differs from the one in force."""
        self._pending = None
        if not self.is_leader:
            return
        plan = rebalance(self.map, self.nodes, force=self._repair)
        if plan is not self.map:
            self.membership.propose(plan)

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Join the cluster (ClusterError when that is impossible)."""
        await self.membership.join(self.my_id, self.announce, self)

    async def stop(self, clean: bool = True) -> None:
        """Leave (``clean``) or just go silent, as a crash would."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        if clean:
            await self.membership.leave()
        else:
            await self.membership.abandon()
