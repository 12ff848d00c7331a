"""Soft pins (KV.PIN): values a client will read again soon, evicted last until a deadline.

A serving engine pins the blocks of a prompt it is about to reuse; a pin that
outlived its reason must not keep a value in DRAM for ever, so every pin
carries a deadline and lapses by itself. The eviction policy does the keeping
(a soft-pinned leaf is taken only when no other leaf of its tier is left,
kvstore/store/eviction.py); this table remembers which entries are pinned, for
which key and until when, so the mark can come off again.

Pins are few, so lapsing them is a pass over this table on the server's cron
(`expire`), not a timer per key. A pin belongs to the value, not the key: a
new value of the key is a new entry and starts unpinned.
"""
from __future__ import annotations

from collections.abc import Callable

from kvstore.store.deadlines import now_ms
from kvstore.store.eviction import SampledLRU


class SoftPins:
    """Pinned entry -> (its key, the pin's deadline in ms)."""

    def __init__(self, index: dict[bytes, int], policy: SampledLRU, lookup: Callable[[bytes], int | None]):
        self.index = index          # the engine's key -> entry map, read to see whether a pinned value is still live
        self.policy = policy
        self.lookup = lookup        # the engine's live-key lookup (an expired key is not pinned)
        self._pins: dict[int, tuple[bytes, int]] = {}

    def pin(self, key: bytes, ttl_ms: int) -> bool:
        """Soft-pin ``key`` for ``ttl_ms``: evicted last; the pin lapses by itself. False: no such key."""
        entry = self.lookup(key)
        if entry is None:
            return False
        self.policy.soft_pin(entry)
        self._pins[entry] = (key, now_ms() + ttl_ms)
        return True

    def unpin(self, key: bytes) -> bool:
        """Take ``key``'s pin off. False: no such key, or not pinned."""
        entry = self.lookup(key)
        if entry is None or entry not in self._pins:
            return False
        del self._pins[entry]
        self.policy.soft_pin(entry, False)
        return True

    def expire(self) -> None:
        """Lapse the pins past their deadline and those whose value has left the index."""
        if not self._pins:
            return
        now, index = now_ms(), self.index
        for entry, (key, deadline) in list(self._pins.items()):
            if deadline <= now or index.get(key) != entry:
                del self._pins[entry]
                if index.get(key) == entry:
                    self.policy.soft_pin(entry, False)
