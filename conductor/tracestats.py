"""The statistics that tell two traces apart for a scheduler, measured the same way for any trace.

A generated trace stands in for a real one only as far as these agree: how
fast requests come and how clumped, how long prompts and answers are, and
how much of the prompt an unbounded prefix cache could have reused (a block
is reusable when an earlier request held the same prefix up to it; the
first unseen block ends the reusable part, as a prefix match does).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

import numpy as np

from conductor.trace import TraceRequest


@dataclass(frozen=True)
class TraceStats:
    requests: int
    rate_per_s: float
    per_minute_cv: float       # coefficient of variation of requests per minute
    input_mean: float
    input_p50: float
    input_p90: float
    output_mean: float
    output_p50: float
    output_p90: float
    reusable_share: float      # share of all blocks an unbounded cache would hold

    def as_dict(self) -> dict:
        return asdict(self)


def reusable_blocks(requests: Iterable[TraceRequest]) -> tuple[int, int]:
    """(blocks in a prefix already seen, all blocks) over ``requests`` in order."""
    seen: set[int] = set()
    reusable = total = 0
    for r in requests:
        ids = r.hash_ids
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        reusable += k
        total += len(ids)
        seen.update(ids[k:])
    return reusable, total


def measure(requests: list[TraceRequest]) -> TraceStats:
    if not requests:
        raise ValueError("no requests to measure")
    at = np.array([r.arrival_s for r in requests])
    inputs = np.array([r.input_length for r in requests])
    outputs = np.array([r.output_length for r in requests])
    span = max(float(at.max() - at.min()), 1e-9)
    per_minute = np.bincount(((at - at.min()) // 60).astype(np.int64))
    reusable, total = reusable_blocks(requests)
    return TraceStats(
        requests=len(requests), rate_per_s=len(requests) / span,
        per_minute_cv=float(per_minute.std() / per_minute.mean()),
        input_mean=float(inputs.mean()), input_p50=float(np.median(inputs)),
        input_p90=float(np.percentile(inputs, 90)),
        output_mean=float(outputs.mean()), output_p50=float(np.median(outputs)),
        output_p90=float(np.percentile(outputs, 90)),
        reusable_share=reusable / total)


def comparison_table(named: dict[str, TraceStats]) -> str:
    """A markdown table, one column per trace."""
    names = list(named)
    rows = ["| statistic | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key in TraceStats.__dataclass_fields__:
        cells = []
        for n in names:
            v = getattr(named[n], key)
            cells.append(f"{v:,}" if isinstance(v, int) else
                         f"{v:.3f}" if v < 10 else f"{v:,.0f}")
        rows.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
