"""An inference engine's traffic to the cache, replayed from the Mooncake conversation trace.

Each trace request is a prompt cut into 512-token blocks whose ``hash_ids``
are already prefix-chained ids. An engine serving it does what vLLM or
SGLang with a KV connector does:

1. hashes the blocks into store keys (`BlockHasher`, one "token" per hash id,
   so two requests share a key exactly when they share the prefix up to it);
2. asks how much of the prefix is cached: one ``KV.MATCH`` (``match_prefix``);
3. reads the cached prefix (``batch_get``), checking every value's seal;
4. writes the blocks it had to compute, each with its parent (``batch_put``,
   put-once: a block another engine wrote meanwhile is left as it is).

Every step is reported to a ``record(name, seconds, nbytes, error)`` callback,
which the locust user turns into locust requests and the chaos run into its
per-fault counters. A value that does not verify is reported as a
`WrongValue` error on the read; a value missing between the match and the
read is a miss (a cache may lose values), and the engine recomputes from
there. The load runs share one `TraceCursor`, so all users together replay
the trace in order and its prefix sharing reaches the store as it would
from one fleet of engines.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from client import BlockHasher
from client.cluster import ClusterDown
from client.errors import ConnectionError, KVError, TimeoutError
from loadtest.sealed import PayloadPool, verify

ROOT = Path(__file__).resolve().parent.parent
SHARED_TRACE = ROOT.parent / "shared" / "data" / "conversation_trace.jsonl"
FIXTURE_TRACE = ROOT / "tests" / "fixtures" / "conversation_head200.jsonl"
NAMESPACE = "loadtest-conversation-trace"

Record = Callable[[str, float, int, "BaseException | None"], None]


class WrongValue(KVError):
    """Values read back that are not the sealed values of their keys.

    The message is the same for every occurrence, so locust's error report counts them in one
    line; how many values and bytes, and which keys, are attributes.
    """

    def __init__(self, count: int, nbytes: int, keys: Sequence[str]):
        super().__init__("a value read back failed verification (another key's, cut short, or changed)")
        self.count, self.nbytes, self.keys = count, nbytes, list(keys)


def default_trace() -> Path:
    """The whole conversation trace when it is beside the project, else the test fixture's 200 requests."""
    return SHARED_TRACE if SHARED_TRACE.exists() else FIXTURE_TRACE


def load_trace(path: str | Path, limit: int | None = None) -> list[list[int]]:
    """The hash ids of each request of a Mooncake trace (JSONL), in order; requests without blocks skipped."""
    requests: list[list[int]] = []
    with open(path, encoding="utf-8") as f:
        for line in itertools.islice(f, limit):
            hash_ids = json.loads(line).get("hash_ids") or []
            if hash_ids:
                requests.append([int(h) for h in hash_ids])
    if not requests:
        raise ValueError(f"{path}: no request with hash_ids")
    return requests


class TraceCursor:
    """The trace's requests handed out in order to every user, from the start again when it runs out."""

    def __init__(self, requests: list[list[int]]):
        self.requests = requests
        self._next = itertools.count()          # next() on a count is atomic under the GIL

    def next(self) -> list[int]:
        return self.requests[next(self._next) % len(self.requests)]


class KVCacheEngine:
    """One engine's requests to the store through the SDK (`KVClient` or `KVClusterClient`)."""

    def __init__(self, kv: Any, pool: PayloadPool, block_bytes: int):
        self.kv = kv
        self.pool = pool
        self.block_bytes = block_bytes
        self.hasher = BlockHasher(NAMESPACE, block_tokens=1)

    def keys(self, hash_ids: Sequence[int]) -> list[str]:
        return self.hasher.keys(np.asarray(hash_ids, dtype=np.uint32))

    def value(self, key: str, hash_id: int) -> bytes:
        return self.pool.sealed(key.encode(), self.block_bytes, hash_id)

    def serve(self, hash_ids: Sequence[int], record: Record) -> None:
        """Match, read the cached prefix, write what was missing; each step reported to ``record``."""
        keys = self.keys(hash_ids)
        matched = self._step(record, "match_prefix", lambda: (self.kv.match_prefix(keys), 0))
        if matched is None:
            return
        have = self._step(record, "batch_get", lambda: self._read(keys[:matched])) if matched else 0
        if have is None:
            return
        parents = [keys[have - 1] if have else None, *keys[have:-1]]
        items = [(key, self.value(key, h)) for key, h in zip(keys[have:], hash_ids[have:])]
        if items:
            self._step(record, "batch_put", lambda: (
                self.kv.batch_put(items, parents=parents, overwrite=False), sum(len(v) for _, v in items)))

    def _read(self, keys: list[str]) -> tuple[int, int]:
        """Read and verify a matched prefix: (how many lead before the first miss, bytes received)."""
        values = self.kv.batch_get(keys)
        wrong = [(k, len(v)) for k, v in zip(keys, values) if not verify(k.encode(), v)]
        if wrong:
            raise WrongValue(len(wrong), sum(n for _, n in wrong), [k for k, _ in wrong])
        have = next((i for i, v in enumerate(values) if v is None), len(values))
        return have, sum(len(v) for v in values if v is not None)

    def _step(self, record: Record, name: str, run: Callable[[], tuple[Any, int]]) -> Any:
        """Run one step, report it, and return its result (None when it failed)."""
        start = time.perf_counter()
        try:
            result, nbytes = run()
        except KVError as exc:
            record(name, time.perf_counter() - start, getattr(exc, "nbytes", 0), exc)
            self._after_error(exc)
            return None
        record(name, time.perf_counter() - start, nbytes, None)
        return result

    def _after_error(self, exc: KVError) -> None:
        """A cluster client reads the slot map again after a node failed to answer: its slots may have moved."""
        refresh = getattr(self.kv, "refresh", None)
        if refresh is not None and isinstance(exc, (ConnectionError, TimeoutError, ClusterDown)):
            with contextlib.suppress(KVError):
                refresh()
