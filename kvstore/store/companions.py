"""Companion keys: when eviction takes a value that another is useless without, both go.

Why. LMCache's Redis connector stores each chunk of KV cache as two keys,
``<chunk>kv_bytes`` (the tensor bytes, MiBs) and ``<chunk>metadata`` (about 60
bytes: shapes, dtype, length), looks a chunk up by its ``metadata`` key and then
reads the other. Evicted one key at a time, as Redis's LRU evicts them, a chunk
whose ``kv_bytes`` went keeps its ``metadata``: every lookup then finds a chunk
that is not there (LMCache logs "Key exists but KV cache does not exist" and
recomputes it), and a ``kv_bytes`` whose ``metadata`` went is never read again
and only takes room. Size-aware eviction makes the first case common: the bytes a
big write needs are freed in big values' windows, and the small ``metadata`` keys
sit in pages of their own.

What goes. ``evict-companions`` names pairs of key suffixes (by default
LMCache's ``kv_bytes metadata``). When a value leaves for good because memory
is short (evicted from DRAM with no lower tier to take it, trimmed from the
last tier, or a corrupt copy dropped), the key with the same stem and the other
suffix of its pair goes with it, in the same step: one lookup and one drop per
eviction, so the per-turn bound of kvstore/store/room.py still covers it. A
delete, an expiry, an overwrite or a demotion to a lower tier takes no
companion: Redis's semantics for commands stay as they are.
"""
from __future__ import annotations


class Companions:
    """The suffix pairs of ``evict-companions``, each way round."""

    def __init__(self, setting: str = ""):
        words = [word.encode() for word in setting.split()]
        pairs = list(zip(words[::2], words[1::2]))
        self.setting = setting
        self.pairs = tuple(pairs + [(b, a) for a, b in pairs])

    def of(self, key: bytes) -> list[bytes]:
        """The keys that go with ``key`` when it is evicted."""
        return [key[:-len(suffix)] + other for suffix, other in self.pairs if key.endswith(suffix)]


def check(setting: str) -> str | None:
    """Why ``setting`` is not a list of suffix pairs (None when it is)."""
    words = setting.split()
    if len(words) % 2:
        return "evict-companions takes pairs of key suffixes (an even number of words)"
    if any(a == b for a, b in zip(words[::2], words[1::2])):
        return "evict-companions pairs two different suffixes"
    return None
