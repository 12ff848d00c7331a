"""Chain links that travel with the values of a slot move, so the eviction cascade still finds them.

A block's links live on the node that holds it: the engine's parent links
to its local children, and the cascade's list of its remote children
(cascade.py). Taking a value out of the index for a move drops both there,
so without this a moved block's later blocks would no longer go when it goes
on its new owner, and chains would stop being prefixes after every
rebalance. KV.IMPORT carries each value's local parent, which links it on
the target only when the parent got there first; a move sends the hottest
and newest first, children before their parents, so mostly it does not.

So when a move takes a value (`capture`), its source

- notes the value's children, local and remote, as links the new owner must
  hold (``parent -> child``: the child's drop must follow the parent's);
- and, when the value's local parent stays here, holds a remote link from
  that parent to the value, so the parent's drop here still reaches it.

Once the map no longer shows the slots moving (the step is over), the noted
links go to the owners of their parents, as the client sends them after a
batch put (KV.LINK, pipelined, at most ``KV_LINK_MAX`` a command). A parent
that did not arrive (dropped by the move) records nothing: its children are
dropped by the cascade's next sweep of its own, or stay until evicted. Lost
links cost prefix-closure, never a value.
"""
from __future__ import annotations

import asyncio
import logging

from kvstore.cluster.node import ClusterState
from kvstore.cluster.peer import PeerError, PeerReplyError, Peers
from kvstore.cluster.slots import keyslot
from kvstore.store.eviction import NO_PARENT
from proto.wire import KV_LINK, KV_LINK_MAX

log = logging.getLogger("kvstore.cluster")

MAX_NOTED = 1_000_000           # links one node keeps for moves in flight (more are not sent)
SEND_TRIES = 5                  # a new owner that has not applied the map yet answers MOVED
RETRY_S = 0.1


class MovedLinks:
    """The links of the values this node moved away, until they reach the values' new owners."""

    def __init__(self, engine, cluster: ClusterState, peers: Peers):
        self.engine = engine
        self.cluster = cluster
        self.peers = peers
        self.noted: list[tuple[bytes, bytes]] = []      # (parent, child) for the parent's new owner
        self.sent = 0
        self.lost = 0
        self.sending = 0                                # links handed to `deliver`, not yet sent or lost

    def capture(self, key: bytes, entry: int) -> None:
        """``key`` (at ``entry``) is about to leave the index for a move: note its children, and
        keep its local parent's link to it here."""
        engine, cascade = self.engine, self.cluster.cascade
        children = [engine.key_of(child) for child in engine.eviction.children_of(entry)]
        if cascade is not None:
            children += cascade.children.get(key, ())
            parent = engine.eviction.parent_of(entry)
            if parent != NO_PARENT:
                cascade.link(engine.key_of(parent), key)
        room = MAX_NOTED - len(self.noted)
        self.lost += max(0, len(children) - room)
        self.noted += [(key, bytes(child)) for child in children[:room]]

    async def deliver(self) -> None:
        """Send the noted links to their parents' owners (this node's own cascade for its own)."""
        noted, self.noted = self.noted, []
        self.sending += len(noted)
        try:
            await self._deliver(noted)
        finally:
            self.sending -= len(noted)

    @property
    def pending(self) -> int:
        """Links noted or on their way: INFO's cluster_moved_links_pending."""
        return len(self.noted) + self.sending

    async def _deliver(self, noted: list[tuple[bytes, bytes]]) -> None:
        by_owner: dict[str, list[bytes]] = {}
        for parent, child in noted:
            owner = self.cluster.owner(keyslot(parent))
            if owner == self.cluster.my_id and self.cluster.cascade is not None:
                self.sent += self.cluster.cascade.link(parent, child)
                continue
            addr = self.cluster.addr_of(owner) if owner is not None else None
            if addr is None:
                self.lost += 1
                continue
            by_owner.setdefault(addr, []).extend((parent, child))
        await asyncio.gather(*(self._send(addr, pairs) for addr, pairs in by_owner.items()))

    async def _send(self, addr: str, pairs: list[bytes]) -> None:
        step = 2 * KV_LINK_MAX
        commands = [(KV_LINK, *pairs[i:i + step]) for i in range(0, len(pairs), step)]
        links = len(pairs) // 2
        for _ in range(SEND_TRIES):
            try:
                replies = await self.peers.link(addr).pipeline(commands)
            except (PeerError, PeerReplyError) as e:
                log.debug("Sending %d moved links to %s failed: %s", links, addr, e)
                break
            failed = [reply for reply in replies if isinstance(reply, PeerReplyError)]
            if not failed:
                self.sent += links
                return
            await asyncio.sleep(RETRY_S)
        self.lost += links
