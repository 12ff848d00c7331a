"""The store as an SGLang HiCache storage backend: tensors by key, and prefix hits in one round trip.

SGLang's hierarchical cache names each page of KV by a chained hash of its
tokens and asks its storage backend `get`/`set`/`exists` per page, plus
`batch_exists(keys)`: how many keys in a row, from the first, are stored. That
is exactly `KV.MATCH`, so it costs one round trip however long the prefix.
`batch_set` links each page to the one before it (`PARENT`), so under memory
pressure the store evicts a prefix from its tail and what remains still
matches.

Values are tensors (dtype and shape travel with them); `get` fills the
caller's `target_location` tensor when given one (no allocation), else returns
a new CPU tensor. Keys live under `key_prefix`, which `clear` deletes, so
several engines can share a store without clearing each other.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import torch

from client import KVClient

CLEAR_SCAN_COUNT = 1000


class HiCacheStore:
    """`get`, `batch_get`, `set`, `batch_set`, `exists`, `batch_exists`, `clear`, `get_stats`."""

    def __init__(self, store: KVClient, key_prefix: str = "hicache:"):
        self.store = store
        self.key_prefix = key_prefix
        self._lock = threading.Lock()
        self._stats = {"get_hits": 0, "get_misses": 0, "sets": 0, "exists_queries": 0, "prefix_hits": 0}

    def _key(self, key: str) -> str:
        return self.key_prefix + key

    def get(self, key: str, target_location: torch.Tensor | None = None, target_sizes: Any = None
            ) -> torch.Tensor | None:
        """The page's tensor (in ``target_location`` when given), or None when it is not stored."""
        if target_location is not None:
            found = self.store.get_tensor_into(self._key(key), target_location)
            value = target_location if found else None
        else:
            value = self.store.get_tensor(self._key(key), framework="torch")
        self._count("get_hits" if value is not None else "get_misses")
        return value

    def batch_get(self, keys: Sequence[str], target_locations: Sequence[torch.Tensor] | None = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(targets)} target locations")
        return [self.get(k, t) for k, t in zip(keys, targets)]

    def set(self, key: str, value: torch.Tensor | None = None, target_location: Any = None,
            target_sizes: Any = None, parent: str | None = None) -> bool:
        """Store a page; True also when it was stored already (pages are content-addressed)."""
        if value is None:
            raise ValueError("set needs a tensor value")
        self.store.put_tensor(self._key(key), value.contiguous(),
                              parent=self._key(parent) if parent is not None else None)
        self._count("sets")
        return True

    def batch_set(self, keys: Sequence[str], values: Sequence[torch.Tensor] | None = None,
                  target_locations: Any = None, target_sizes: Any = None) -> bool:
        """Store consecutive pages of one prefix, each linked to the page before it."""
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set needs one tensor per key")
        for i, (key, value) in enumerate(zip(keys, values)):
            self.set(key, value, parent=keys[i - 1] if i else None)
        return True

    def exists(self, key: str) -> bool:
        self._count("exists_queries")
        return self.store.exists(self._key(key)) == 1

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        """How many leading keys are stored: one KV.MATCH."""
        self._count("exists_queries")
        hits = self.store.match_prefix([self._key(k) for k in keys]) if keys else 0
        self._count("prefix_hits", hits)
        return hits

    def clear(self) -> None:
        """Delete every page under this backend's key prefix (other users of the store keep theirs)."""
        cursor = 0
        while True:
            cursor, keys = self.store.execute("SCAN", cursor, "MATCH", self.key_prefix + "*",
                                              "COUNT", CLEAR_SCAN_COUNT)
            if keys:
                self.store.delete(*keys)
            if int(cursor) == 0:
                return

    def get_stats(self) -> dict[str, int]:
        """This backend's counters and the store's (KV.STATS)."""
        with self._lock:
            mine = dict(self._stats)
        return {**mine, **{f"store_{k}": v for k, v in self.store.stats().items()}}

    def _count(self, name: str, by: int = 1) -> None:
        with self._lock:
            self._stats[name] += by
