"""The keys that carry a TTL: a dict of deadlines that active expiry can sample in O(samples).

Redis's active expiry looks at a few random keys with a TTL every cycle (10 a
second). Drawing them from a plain dict means listing it first, a cost that
grows with every key holding a TTL and is paid ten times a second whether
anything expires or not. Here the dict (key -> deadline in ms, read as is by
INFO, WATCH, TTL and the shared index) keeps beside it a dense list of its
keys and each key's position in that list; a removal moves the last key into
the hole (swap-remove, as the eviction policy's candidate lists do), so a
sample is a few random positions whatever the number of keys.

Only the methods the engine writes through are kept in step with the list
(``d[key] = deadline``, ``pop``, ``del d[key]``, ``clear``); the others that
would change the dict behind its back raise instead of drifting.
"""
from __future__ import annotations

import random
import time


def now_ms() -> int:
    """The clock deadlines are read against: ms since the epoch, as Redis's absolute expiry times."""
    return int(time.time() * 1000)


class Deadlines(dict):
    """key -> deadline (ms since the epoch), with a uniform random sample in O(k)."""

    __slots__ = ("_keys", "_pos")

    def __init__(self) -> None:
        super().__init__()
        self._keys: list[bytes] = []
        self._pos: dict[bytes, int] = {}

    def __setitem__(self, key: bytes, deadline: int) -> None:
        if key not in self._pos:
            self._pos[key] = len(self._keys)
            self._keys.append(key)
        dict.__setitem__(self, key, deadline)

    def __delitem__(self, key: bytes) -> None:
        dict.__delitem__(self, key)
        self._forget(key)

    def pop(self, key: bytes, *default):
        """Remove ``key`` and return its deadline (or ``default``), as dict.pop."""
        if key not in self._pos:
            return dict.pop(self, key, *default)
        self._forget(key)
        return dict.pop(self, key)

    def clear(self) -> None:
        dict.clear(self)
        self._keys.clear()
        self._pos.clear()

    def _forget(self, key: bytes) -> None:
        """Swap-remove ``key`` from the dense list: the last key takes its place."""
        pos = self._pos.pop(key)
        last = self._keys.pop()
        if pos < len(self._keys):
            self._keys[pos] = last
            self._pos[last] = pos

    def sample(self, count: int) -> list[bytes]:
        """Up to ``count`` distinct keys drawn at random, in O(count)."""
        keys = self._keys
        return [keys[i] for i in random.sample(range(len(keys)), min(count, len(keys)))]

    def _refuse(self, *args, **kwargs):
        raise TypeError("Deadlines changes only through d[key] = deadline, pop, del and clear")

    update = setdefault = popitem = __ior__ = _refuse
