"""Extents reserved ahead for the sizes a client has recently put.

A put through the arena needs an extent to copy into (KV.RESERVE) and a
commit (KV.PUBLISH): two round trips. A writer that puts values of a few
sizes over and over (KV blocks all have one size per model) can ask for the
next extent with the current publish (KV.PUBLISH ... NEXT), so each put after
the first is one memcpy into a spare extent plus one round trip of one
command that commits it and reserves the next.

The pool keeps at most `per_size` spares for each of the `max_sizes` sizes
put most recently, and at most `max_bytes` in all (spares take arena room
that values could use). A spare is used only while it has at least half of
its reservation TTL left (the rule every reservation follows: a copy must
never run past the node reclaiming the extent); older ones, and those of
sizes no longer put, are given back with the next request.

A spare is used only by a put running on the connection that reserved it:
the node ends a reservation with its owner connection, so a spare of a
connection that has since been closed (or of a node that has restarted) is
never written into. A client that closes or dies leaves its spares to the
node, which reclaims every reservation of a closed connection.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Spare:
    """A reserved extent not yet written: its id, where it is, its size, until when it may be
    used, and the connection that holds it on the node."""

    reservation_id: int
    offset: int
    size: int
    use_until: float
    owner: Any


class ReservationPool:
    """Spare reservations by size, most recently put size last."""

    def __init__(self, per_size: int, max_sizes: int, max_bytes: int):
        self.per_size = per_size
        self.max_sizes = max_sizes
        self.max_bytes = max_bytes
        self.bytes = 0
        self._spares: OrderedDict[int, deque[Spare]] = OrderedDict()
        self._given_up: list[int] = []

    def take(self, size: int, now: float, owner: Any) -> Spare | None:
        """A usable spare of exactly ``size`` bytes held by ``owner``, or None; stale spares and
        those of other connections that are past their use are given up on the way."""
        spares, found = self._spares.get(size), None
        for spare in list(spares or ()):
            if spare.use_until <= now:
                self._remove(spares, spare)
                self._given_up.append(spare.reservation_id)
            elif found is None and spare.owner is owner:
                self._remove(spares, spare)
                found = spare
        return found

    def wanted(self, sizes: list[int], owner: Any) -> list[int]:
        """Sizes to reserve ahead on ``owner`` after putting values of ``sizes``: one spare per
        value put, up to `per_size` a size, within the byte budget."""
        want, planned = [], self.bytes
        for size in dict.fromkeys(sizes):
            self._spares.setdefault(size, deque())
            self._spares.move_to_end(size)
            have = sum(spare.owner is owner for spare in self._spares[size])
            for _ in range(min(sizes.count(size), self.per_size) - have):
                if planned + size > self.max_bytes:
                    break
                want.append(size)
                planned += size
        self._trim_sizes()
        return want

    def add(self, spares: list[Spare]) -> None:
        for spare in spares:
            queue = self._spares.get(spare.size)
            if queue is None or len(queue) >= self.per_size or self.bytes + spare.size > self.max_bytes:
                self._given_up.append(spare.reservation_id)
                continue
            queue.append(spare)
            self.bytes += spare.size

    def has_given_up(self) -> bool:
        return bool(self._given_up)

    def given_up(self) -> list[int]:
        """Reservations to give back to the node (KV.UNRESERVE), once."""
        ids, self._given_up = self._given_up, []
        return ids

    def clear(self) -> list[int]:
        for queue in self._spares.values():
            self._given_up.extend(spare.reservation_id for spare in queue)
        self._spares.clear()
        self.bytes = 0
        return self.given_up()

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._spares.values())

    def _remove(self, queue: deque, spare: Spare) -> None:
        queue.remove(spare)
        self.bytes -= spare.size

    def _trim_sizes(self) -> None:
        while len(self._spares) > self.max_sizes:
            _, queue = self._spares.popitem(last=False)
            for spare in queue:
                self.bytes -= spare.size
                self._given_up.append(spare.reservation_id)
