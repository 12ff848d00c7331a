"""The numbers a replay reports, computed once from per-request outcomes.

The simulator fills a `Outcomes` record (numpy arrays, one slot per request);
`summarize` turns it into the flat `RunSummary` that the table, the JSON
output and the benchmark print. TTFT statistics cover requests that finished
prefill and reached decode; TBT is each decoded request's mean time between
tokens; `completed_in_slo` counts requests that met both SLOs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

SERVED, REJECTED_AT_ARRIVAL, REJECTED_AT_DECODE = 0, 1, 2


@dataclass
class Outcomes:
    """Per-request results and the run's load samples."""

    n: int
    status: np.ndarray = field(init=False)
    ttft_s: np.ndarray = field(init=False)
    tbt_s: np.ndarray = field(init=False)
    input_tokens: np.ndarray = field(init=False)
    reused_tokens: np.ndarray = field(init=False)
    prefill_busy_s: float = 0.0
    wasted_prefill_s: float = 0.0
    load_time_s: list[float] = field(default_factory=list)
    prefill_load: list[float] = field(default_factory=list)
    decode_load: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.status = np.full(self.n, SERVED, dtype=np.int8)
        self.ttft_s = np.full(self.n, np.nan)
        self.tbt_s = np.full(self.n, np.nan)
        self.input_tokens = np.zeros(self.n, dtype=np.int64)
        self.reused_tokens = np.zeros(self.n, dtype=np.int64)

    def ensure(self, n: int) -> None:
        """Room for ``n`` requests (a live replay grows one arrival at a time)."""
        if n <= self.status.size:
            self.n = max(self.n, n)
            return
        size = max(n, 2 * self.status.size)
        for name, fill in (("status", SERVED), ("ttft_s", np.nan), ("tbt_s", np.nan),
                           ("input_tokens", 0), ("reused_tokens", 0)):
            old = getattr(self, name)
            new = np.full(size, fill, dtype=old.dtype)
            new[:old.size] = old
            setattr(self, name, new)
        self.n = n


@dataclass
class RunSummary:
    policy: str
    admission: str
    prefill: int
    decode: int
    speed: float
    requests: int
    admitted: int
    rejected: int
    rejected_at_arrival: int
    rejected_at_decode: int
    completed_in_slo: int
    slo_attainment: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tbt_p90_s: float
    prefix_hit_rate: float
    prefill_busy_s: float
    wasted_prefill_s: float
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def _stat(values: np.ndarray, q: float | None = None) -> float:
    if values.size == 0:
        return float("nan")
    return float(np.mean(values) if q is None else np.percentile(values, q))


def summarize(out: Outcomes, *, policy: str, admission: str, prefill: int, decode: int,
              speed: float, ttft_slo_s: float, tbt_slo_s: float) -> RunSummary:
    if out.status.size != out.n:        # grown by `ensure`: only the first n are requests
        out = _first(out, out.n)
    served = out.status == SERVED
    at_arrival = int((out.status == REJECTED_AT_ARRIVAL).sum())
    at_decode = int((out.status == REJECTED_AT_DECODE).sum())
    ttft = out.ttft_s[served & ~np.isnan(out.ttft_s)]
    tbt = out.tbt_s[served & ~np.isnan(out.tbt_s)]
    in_slo = int((served & (out.ttft_s <= ttft_slo_s) & (out.tbt_s <= tbt_slo_s)).sum())
    prefilled = out.status != REJECTED_AT_ARRIVAL
    tokens = int(out.input_tokens[prefilled].sum())
    return RunSummary(
        policy=policy, admission=admission, prefill=prefill, decode=decode, speed=speed,
        requests=out.n, admitted=out.n - at_arrival, rejected=at_arrival + at_decode,
        rejected_at_arrival=at_arrival, rejected_at_decode=at_decode,
        completed_in_slo=in_slo, slo_attainment=in_slo / out.n,
        ttft_mean_s=_stat(ttft), ttft_p50_s=_stat(ttft, 50), ttft_p90_s=_stat(ttft, 90),
        ttft_p99_s=_stat(ttft, 99), tbt_p90_s=_stat(tbt, 90),
        prefix_hit_rate=int(out.reused_tokens[prefilled].sum()) / tokens if tokens else 0.0,
        prefill_busy_s=out.prefill_busy_s, wasted_prefill_s=out.wasted_prefill_s)


def _first(out: Outcomes, n: int) -> Outcomes:
    view = Outcomes.__new__(Outcomes)
    view.__dict__.update(out.__dict__)
    for name in ("status", "ttft_s", "tbt_s", "input_tokens", "reused_tokens"):
        setattr(view, name, getattr(out, name)[:n])
    return view
