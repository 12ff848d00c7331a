"""The copies of other nodes' hot blocks that this node holds (the holder's side of replication.py).

A copy is an ordinary value in the engine (so GET, KV.GETLAYERS and the
local fast path read it as any other), plus a record here: whose it is, until
when it may be served (the owner's lease, renewed every heat window), and how
often it was read since the owner last asked. Only READONLY readers are served
from a copy (dispatch asks `serves`); a write of the key still goes to its
owner, which removes the copies before acknowledging it.

A copy competes for DRAM by value, not by kind. The engine asks the
``shed_first`` hook before it evicts anything; the hook drops a copy only
when the LRU's next victim is one (or when nothing else could go), so a copy
goes exactly when it is colder than every value the LRU would evict instead,
and as a delete: a tiered engine would otherwise demote it to SSD, where
it serves no one. Shedding copies first whatever their heat, as this hook
once did, kept no copy at all in a full cache: the hottest block's copy went
at the holder's next write and its owner made it again the next second. When a new map gives a copy's slot to another node, the
copy is dropped, kept as this node's own value (the slot came here), or, when
the owner died, handed back to the caller to push to the slot's new owner.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.cluster.node import ClusterState
from kvstore.cluster.simclock import loop_time
from kvstore.cluster.slots import SlotMap, keyslot
from kvstore.store.entries import DRAM


@dataclass(slots=True)
class HeldCopy:
    """A copy held for ``owner``: served until ``deadline`` (`loop_time` seconds)."""

    owner: str
    deadline: float
    reads: int = 0          # reads served since the owner last renewed the lease


class HeldCopies:
    """The copies on this node, by key."""

    def __init__(self, engine, cluster: ClusterState):
        self.engine = engine
        self.cluster = cluster
        self.copies: dict[bytes, HeldCopy] = {}
        self.reads = 0              # reads served from copies
        self.shed = 0               # copies dropped to make room

    def __contains__(self, key: bytes) -> bool:
        return key in self.copies

    def __len__(self) -> int:
        return len(self.copies)

    def read(self, key: bytes) -> bool:
        """Count a read if ``key`` is a copy here (the hit listener's question); False when it is not."""
        copy = self.copies.get(key)
        if copy is None:
            return False
        copy.reads += 1
        self.reads += 1
        return True

    def serves(self, keys: list[bytes]) -> bool:
        """Whether every key is a copy held here under a live lease (a READONLY read may run here)."""
        now = loop_time()
        for key in keys:
            copy = self.copies.get(key)
            if copy is None or copy.deadline < now:
                return False
        return True

    def store(self, owner: str, lease_ms: int, key: bytes, value, store: Callable) -> bool:
        """Keep ``value`` as ``owner``'s copy of ``key``; False when ``owner`` does not own its slot here."""
        if owner == self.cluster.my_id or self.cluster.owner(keyslot(key)) != owner:
            return False
        store(key, value)           # replacing an older copy forgets it (the drop listener)
        self.copies[key] = HeldCopy(owner, loop_time() + lease_ms / 1000)
        return True

    def forget(self, key: bytes) -> bool:
        """The engine let ``key`` go: True when it was a copy."""
        return bool(self.copies) and self.copies.pop(key, None) is not None

    def drop(self, key: bytes) -> bool:
        if key not in self.copies:
            return False
        self.engine.delete(key)     # the drop listener forgets it
        return True

    def drop_all(self) -> None:
        """Serve no copy any more (a node about to leave: its copies' owners stop counting on it)."""
        for key in list(self.copies):
            self.engine.delete(key)

    def renew(self, owner: str, lease_ms: int, keys: list[bytes]) -> list[int]:
        """Extend ``owner``'s copies of ``keys``: per key the reads served since the last renewal, -1 if gone."""
        deadline = loop_time() + lease_ms / 1000
        reads = []
        for key in keys:
            copy = self.copies.get(key)
            if copy is None or copy.owner != owner:
                reads.append(-1)
                continue
            copy.deadline = deadline
            reads.append(copy.reads)
            copy.reads = 0
        return reads

    def shed_one(self) -> bool:
        """Drop the copy the LRU would evict next, to make room; False when its next victim is a
        value of this node's own (the engine evicts that) or no copy is held."""
        if not self.copies:
            return False
        oldest = self.engine.eviction.oldest(DRAM)
        key = next(iter(self.copies)) if oldest is None else self.engine.key_of(oldest[1])
        if key not in self.copies:
            return False
        self.engine.delete(key)
        self.shed += 1
        return True

    def drop_lapsed(self) -> None:
        now = loop_time()
        for key in [key for key, copy in self.copies.items() if copy.deadline < now]:
            self.engine.delete(key)

    def on_map(self, new: SlotMap) -> tuple[list[tuple[bytes, str]], dict[str, list[bytes]]]:
        """Settle the copies whose slot changed owner: those dropped go now; returns the ones
        kept as this node's own, with their old owner, and per new owner the ones a dead owner left."""
        cluster = self.cluster
        adopted: list[tuple[bytes, str]] = []
        orphans: dict[str, list[bytes]] = defaultdict(list)
        for key, copy in list(self.copies.items()):
            owner = cluster.owner(keyslot(key))
            if owner == copy.owner:
                continue
            del self.copies[key]
            if owner == cluster.my_id:
                adopted.append((key, copy.owner))       # the value stays, as this node's own
            elif owner is not None and copy.owner not in new.nodes:
                orphans[owner].append(key)
            else:
                self.engine.delete(key)
        return adopted, orphans
