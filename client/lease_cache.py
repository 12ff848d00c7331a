"""Leases a client keeps after a get, so a repeated get is one memcpy and no round trip.

A lease pins a value in the node's arena and comes with a validity word in
the node's control area (kvstore/local/leases.py): the word holds the lease's tag
while the lease is live, and the node clears it before it lets the bytes go
(value deleted, overwritten, evicted, lease expired or released, connection
closed). So a client that still holds a lease can copy the value again from
its own mapping and then read the word: the tag means the copy is the current
value, whole; anything else means the lease is over (the node already ended
it) and the get goes to the node. A node that dies cannot clear its words,
but its death closes the connection that took the lease, so a held lease
vouches for a copy only while that connection is open (`arena_reads`).

What this module decides is which leases to keep and for how long:

- bounded in entries and in bytes (a cached lease pins its value against
  eviction and demotion, so the cache must stay a small part of the arena);
  the oldest lease goes first;
- a lease is used for as long as the node said it may be held (half its TTL
  since it was asked for; not at all for a key with an expiry time); then it
  is handed back (released with the next request) and the next get of the
  key leases it afresh, which is the renewal: a hot key costs one round trip
  per half TTL, and no lease is ever relied on near its deadline;
- everything the cache gives up is returned as lease ids for the caller to
  release; on close the connection's end releases them all on the node.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class HeldLease:
    """A lease on one value: where it is, its validity word and tag, until when it may be used,
    and the watch on the connection that took it (the lease ends when that connection closes)."""

    lease_id: int
    offset: int
    size: int
    word: int
    tag: int
    use_until: float
    peer: Any



class LeaseCache:
    """Held leases by key, oldest first."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._held: OrderedDict[bytes, HeldLease] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def lookup(self, key: bytes) -> HeldLease | None:
        return self._held.get(key)

    def forget(self, key: bytes, held: HeldLease) -> bool:
        """Drop a lease that can no longer vouch for a copy; whether it was still held."""
        if self._held.get(key) is not held:
            return False
        self._pop(key)
        return True

    def keep(self, key: bytes, held: HeldLease) -> list[int]:
        """Hold ``held`` for ``key``; the ids of leases given up to make room (to release)."""
        given_up = [] if key not in self._held else [self._pop(key).lease_id]
        if held.size > self.max_bytes or self.max_entries == 0:
            return [*given_up, held.lease_id]
        while self._held and (len(self._held) >= self.max_entries or self.bytes + held.size > self.max_bytes):
            given_up.append(self._pop(next(iter(self._held))).lease_id)
        self._held[key] = held
        self.bytes += held.size
        return given_up

    def due(self, now: float) -> list[int]:
        """Give up the leases past their use-by time (oldest first, so the scan stops early)."""
        given_up = []
        while self._held:
            key, held = next(iter(self._held.items()))
            if held.use_until > now:
                break
            given_up.append(self._pop(key).lease_id)
        return given_up

    def clear(self) -> list[int]:
        ids = [held.lease_id for held in self._held.values()]
        self._held.clear()
        self.bytes = 0
        return ids

    def _pop(self, key: bytes) -> HeldLease:
        held = self._held.pop(key)
        self.bytes -= held.size
        return held
