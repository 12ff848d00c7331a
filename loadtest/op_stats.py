"""Latency percentiles and bytes per second per operation, kept in bounded memory at 1 % resolution.

locust keeps its own statistics, but rounds response times under 100 ms to
whole milliseconds, and most cache operations take less than one. Each
operation here gets a histogram with logarithmic bins 1 % wide from 1 µs to
100 s: a percentile read from it is within 1 % of the exact one, and its
memory does not grow with the length of the run.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np

FLOOR_S = 1e-6
STEP = 1.01
BINS = int(math.log(100.0 / FLOOR_S, STEP)) + 2


@dataclass
class OpLog:
    """One operation's counts, failures, bytes and latency histogram."""

    bins: np.ndarray = field(default_factory=lambda: np.zeros(BINS, dtype=np.int64))
    calls: int = 0
    failures: int = 0
    nbytes: int = 0

    def add(self, seconds: float, nbytes: int, failed: bool) -> None:
        self.bins[min(BINS - 1, max(0, int(math.log(max(seconds, FLOOR_S) / FLOOR_S, STEP))))] += 1
        self.calls += 1
        self.failures += failed
        self.nbytes += nbytes

    def percentile_ms(self, fraction: float) -> float:
        """The latency under which ``fraction`` of the calls finished, in ms (the bin's upper edge)."""
        if not self.calls:
            return float("nan")
        index = int(np.searchsorted(np.cumsum(self.bins), math.ceil(fraction * self.calls)))
        return FLOOR_S * STEP ** (index + 1) * 1e3


class OpStats:
    """Every operation's `OpLog`, by name, and the wall time they cover; safe to record from many threads."""

    def __init__(self) -> None:
        self.ops: dict[str, OpLog] = {}
        self.started = time.monotonic()
        self._lock = threading.Lock()

    def record(self, name: str, seconds: float, nbytes: int, failed: bool) -> None:
        with self._lock:
            self.ops.setdefault(name, OpLog()).add(seconds, nbytes, failed)

    def rows(self, seconds: float | None = None) -> list[dict[str, float | str | int]]:
        """Per operation: calls, failures, p50 and p99 (ms), MB/s over ``seconds`` (default: since start)."""
        elapsed = seconds if seconds is not None else time.monotonic() - self.started
        return [{"operation": name, "calls": log.calls, "failures": log.failures,
                 "p50_ms": log.percentile_ms(0.50), "p99_ms": log.percentile_ms(0.99),
                 "MB/s": log.nbytes / max(elapsed, 1e-9) / 1e6}
                for name, log in sorted(self.ops.items())]

    def markdown(self, seconds: float | None = None) -> str:
        lines = ["| operation | calls | failures | p50 ms | p99 ms | MB/s |", "|---|--:|--:|--:|--:|--:|"]
        for row in self.rows(seconds):
            lines.append(f"| {row['operation']} | {row['calls']:,} | {row['failures']:,} | {row['p50_ms']:.3g} "
                         f"| {row['p99_ms']:.3g} | {row['MB/s']:.1f} |")
        return "\n".join(lines)
