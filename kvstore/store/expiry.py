"""TTLs: which keys carry a deadline, and Redis's active expiry cycle.

Redis expires a key two ways, and so does the node. Lazily: a key past its
deadline is dropped when it is next looked up; that check sits in
`Engine.lookup`, on the path of every read, which reads `deadlines` through a
reference of its own so the check costs what a dict lookup costs. Actively:
ten times a second the server's cron runs `cycle`, which samples a few keys
with a TTL and drops those past their deadline, repeating while a quarter or
more of a sample had expired, so memory held by keys nobody reads again comes
back without a scan whose cost grows with the number of keys
(kvstore/store/deadlines.py says how the sample stays O(samples)).

Few keys of a KV cache carry a TTL, so the deadlines live in a side dict,
not in a column of every entry. Giving a key a deadline is news to those who
cache what they know of it, told through `listeners`: WATCH (the key
changed) and the shared index (a local client reading through it would not
see the key expire, so the key leaves it).
"""
from __future__ import annotations

from collections.abc import Callable

from kvstore.store.deadlines import Deadlines, now_ms


class Expiry:
    """The keys' deadlines, set, removed and enforced by sampling."""

    def __init__(self, index: dict[bytes, int], drop_expired: Callable[[int], None]):
        self.deadlines = Deadlines()     # key -> deadline ms; read as is by INFO, WATCH, TTL, the shared index
        self.listeners: list[Callable[[bytes], None]] = []     # fn(key) when it gets a deadline
        self.index = index               # the engine's key -> entry map
        self.drop_expired = drop_expired  # fn(entry): drop a value past its deadline, counted as expired

    def set(self, key: bytes, deadline_ms: int) -> None:
        """Give ``key`` a deadline (ms since the epoch), replacing any it had."""
        for listener in self.listeners:
            listener(key)
        self.deadlines[key] = deadline_ms

    def persist(self, key: bytes) -> bool:
        """Remove ``key``'s deadline; False when it had none."""
        return self.deadlines.pop(key, None) is not None

    def cycle(self, samples: int = 20) -> int:
        """Drop the expired keys among a random sample of those with a deadline; how many went."""
        deadlines = self.deadlines
        if not deadlines:
            return 0
        now, dropped = now_ms(), 0
        for key in deadlines.sample(samples):
            if deadlines[key] <= now:
                self.drop_expired(self.index[key])
                dropped += 1
        return dropped
