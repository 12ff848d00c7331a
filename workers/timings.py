"""The workers' own measurements, in the rows the conductor's cost model is fitted to.

Each prefill, prefix load and decode step is recorded as a row of
`conductor.costmodel.read_timings` (kind, its inputs, seconds), so
`kvstore replay --calibrate FILE` can predict this deployment from what it
measured. The rows are a bounded window (the newest `MAX_ROWS`); the prefill
speed they imply also prices a worker's queue in its load reports.
"""
from __future__ import annotations

import json
import threading
from collections import deque

MAX_ROWS = 4096
DEFAULT_S_PER_TOKEN = 2e-3      # until the first prefill is measured


class Timings:
    def __init__(self, max_rows: int = MAX_ROWS):
        self._rows: deque[dict] = deque(maxlen=max_rows)
        self._lock = threading.Lock()
        self._prefill_tokens = 0
        self._prefill_s = 0.0

    def record_prefill(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        self._add({"kind": "prefill", "new_tokens": new_tokens, "cached_tokens": cached_tokens,
                   "seconds": seconds})
        with self._lock:
            self._prefill_tokens += new_tokens
            self._prefill_s += seconds

    def record_transfer(self, tokens: int, seconds: float) -> None:
        self._add({"kind": "transfer", "tokens": tokens, "seconds": seconds})

    def record_decode(self, batch: int, kv_tokens: int, seconds: float) -> None:
        self._add({"kind": "decode", "batch": batch, "kv_tokens": kv_tokens, "seconds": seconds})

    def prefill_s_per_token(self) -> float:
        with self._lock:
            return self._prefill_s / self._prefill_tokens if self._prefill_tokens else DEFAULT_S_PER_TOKEN

    def rows(self) -> list[dict]:
        with self._lock:
            return list(self._rows)

    def to_json(self) -> str:
        return json.dumps(self.rows())

    def _add(self, row: dict) -> None:
        with self._lock:
            self._rows.append(row)
