"""How often a request that the forecast gave this much room, this far ahead, really fitted.

Predictive admission forecasts the decode load a request will meet, h seconds
from now, and must turn that into a decision. Comparing the forecast with
the limit (a hard threshold) trusts it exactly, and the forecast is an
expectation with two kinds of error that do not average out:

- it grows with the horizon (later admissions, departures, bursts), and
- it is not capped: requests due before this one count in full even when
  decode will refuse some of them, so once demand exceeds memory the forecast
  says "full by 20 %" while the instance is merely full, and a small request
  still slips into the memory the next departure frees.

So the decision is learned online from its own outcomes. Every request the
admission check forecasts is filed with its *slack* (room left under the
tightest of memory, batch and TBT limits once it joins, as a share of that
limit; negative when the forecast says it will not fit) and its due time.
When the instance's clock passes the due time, the request is scored
against the load really there (without it): would it have fitted? Admitted
and rejected requests alike are scored, so the odds are not those of the
requests the forecast let through. The outcomes are kept per horizon band and
slack band, each a ring of the last `WINDOW`; the chance for a new request is
the share that fitted in its cell. A cell with fewer than `MIN_SAMPLES`
outcomes has not earned an opinion and the forecast is trusted as it is.

The miss of the forecast itself (actual minus forecast KV) is summed per
horizon band for reports.
"""
from __future__ import annotations

import heapq
from bisect import bisect_right
from typing import Callable

import numpy as np

HORIZON_EDGES_S = (0.5, 1.0, 2.0, 5.0, 10.0)   # bands [0, 0.5), [0.5, 1), ..., [10, inf)
SLACK_EDGES = (-0.2, -0.1, -0.05, -0.02, 0.0, 0.02, 0.05, 0.1, 0.2)
WINDOW = 64         # outcomes remembered per cell: a chance of 1/2 to within about 0.06
MIN_SAMPLES = 16    # fewer than this and a cell's share is not yet worth trusting


def band_of(horizon_s: float) -> int:
    return bisect_right(HORIZON_EDGES_S, horizon_s)


def band_label(band: int) -> str:
    edges = (0.0, *HORIZON_EDGES_S)
    if band + 1 < len(edges):
        return f"{edges[band]:g}-{edges[band + 1]:g} s"
    return f">= {edges[band]:g} s"


class FitOdds:
    """Filed forecasts waiting for their due time, and the outcomes per (horizon, slack) cell."""

    def __init__(self, window: int = WINDOW):
        shape = (len(HORIZON_EDGES_S) + 1, len(SLACK_EDGES) + 1)
        self._fitted = np.zeros((*shape, window), dtype=bool)
        self._count = np.zeros(shape, dtype=np.int64)
        self._next = np.zeros(shape, dtype=np.int64)
        self._misses = np.zeros((shape[0], 3))      # n, sum and sum of squares of KV misses
        self._pending: list[tuple] = []
        self._seq = 0

    def file(self, now_s: float, due_s: float, slack: float, forecast_kv: float,
             request: tuple) -> None:
        """A forecast to score at ``due_s``; ``request`` is what the scorer needs to judge it."""
        self._seq += 1
        heapq.heappush(self._pending, (due_s, self._seq, due_s - now_s, slack, forecast_kv,
                                       request))

    def score_due(self, until_s: float,
                  judge: Callable[[float, tuple], tuple[bool, float]]) -> None:
        """Score every forecast due by ``until_s``: ``judge(due, request)`` says whether the
        request would have fitted then and what KV was there."""
        pending = self._pending
        while pending and pending[0][0] <= until_s:
            due_s, _, horizon_s, slack, forecast_kv, request = heapq.heappop(pending)
            fitted, actual_kv = judge(due_s, request)
            band = band_of(horizon_s)
            self._record(band, bisect_right(SLACK_EDGES, slack), fitted)
            miss = actual_kv - forecast_kv
            self._misses[band] += 1, miss, miss * miss

    def _record(self, band: int, cell: int, fitted: bool) -> None:
        i = self._next[band, cell]
        self._fitted[band, cell, i] = fitted
        self._next[band, cell] = (i + 1) % self._fitted.shape[2]
        self._count[band, cell] = min(self._count[band, cell] + 1, self._fitted.shape[2])

    def chance(self, horizon_s: float, slack: float) -> float:
        """The share of recent requests like this one that fitted; the forecast's own
        verdict (1 or 0) while there are too few."""
        band, cell = band_of(horizon_s), bisect_right(SLACK_EDGES, slack)
        n = self._count[band, cell]
        if n < MIN_SAMPLES:
            return 1.0 if slack >= 0 else 0.0
        return float(self._fitted[band, cell, :n].mean())

    def misses(self) -> np.ndarray:
        """Per horizon band over the whole run: count, sum and sum of squares of
        (actual - forecast) KV tokens."""
        return self._misses.copy()
