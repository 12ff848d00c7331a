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
  hold (``parent -> child``: the child's drop must follow the parent's); they
  ride with the value (`Taken.children`, outgoing.py);
- and, when the value's local parent stays here, holds a remote link from
  that parent to the value, so the parent's drop here still reaches it;
- and tells the cascade that the drop which follows is the value leaving,
  not going for good (nothing cascades from it).

The links go in the push that carries their value, right after its
KV.IMPORT in one pipeline (``KV.IMPORTLINK parent child ...``, at most
``KV_LINK_MAX`` a command; kvstore/commands/cluster_data.py): the target
holds them while the slot is still coming in, so a value it imported and
then evicted within the step takes its chain with it (the cascade acts for
slots coming in, cascade.py). They once waited for the end of the step, and
every imported value the target evicted before then left its later blocks
behind. A parent the target did not store (a newer write of its own, or a
push it refused) records nothing or links the value that is there, which has
the same children: lost links cost prefix-closure, never a value.
"""
from __future__ import annotations

import logging

from kvstore.cluster.node import ClusterState
from kvstore.store.eviction import NO_PARENT
from proto.wire import KV_LINK_MAX

log = logging.getLogger("kvstore.cluster")

KV_IMPORTLINK = "KV.IMPORTLINK"


class MovedLinks:
    """The links of the values this node moves away, until they reach the values' new owner."""

    def __init__(self, engine, cluster: ClusterState):
        self.engine = engine
        self.cluster = cluster
        self.sent = 0
        self.lost = 0
        self.sending = 0                # links captured whose push is not done yet

    def capture(self, key: bytes, entry: int) -> tuple[bytes, ...]:
        """``key`` (at ``entry``) is about to leave the index for a move: return its children (they
        travel with it), keep its local parent's link to it here, and have the cascade take the drop
        that follows as the value leaving."""
        engine, cascade = self.engine, self.cluster.cascade
        children = [bytes(engine.key_of(child)) for child in engine.eviction.children_of(entry)]
        if cascade is not None:
            children += cascade.children.get(key, ())
            parent = engine.eviction.parent_of(entry)
            if parent != NO_PARENT:
                cascade.link(engine.key_of(parent), key)
            cascade.departing = key
        self.sending += len(children)
        return tuple(children)

    @staticmethod
    def commands(batch) -> list[tuple]:
        """The KV.IMPORTLINK commands that carry the links of ``batch`` (taken values)."""
        pairs = [part for item in batch for child in item.children for part in (item.key, child)]
        step = 2 * KV_LINK_MAX
        return [(KV_IMPORTLINK, *pairs[i:i + step]) for i in range(0, len(pairs), step)]

    def done(self, batch, delivered: bool) -> None:
        """The push of ``batch`` is over: its links reached the target, or were lost with it."""
        links = sum(len(item.children) for item in batch)
        self.sending -= links
        if delivered:
            self.sent += links
        else:
            self.lost += links

    @property
    def pending(self) -> int:
        """Links captured and not yet pushed: INFO's cluster_moved_links_pending."""
        return self.sending
