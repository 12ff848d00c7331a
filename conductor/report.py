"""Readable output of a replay: one column per run, one row per metric.

The JSON form is `RunSummary.as_dict()`; this is the form for a terminal.
"""
from __future__ import annotations

from conductor.metrics import RunSummary

ROWS = [
    ("requests", "d"), ("admitted", "d"), ("rejected", "d"), ("rejected_at_arrival", "d"),
    ("rejected_at_decode", "d"), ("completed_in_slo", "d"), ("slo_attainment", ".3f"),
    ("ttft_mean_s", ".2f"), ("ttft_p50_s", ".2f"), ("ttft_p90_s", ".2f"),
    ("ttft_p99_s", ".2f"), ("tbt_p90_s", ".3f"), ("prefix_hit_rate", ".3f"),
    ("prefill_busy_s", ".0f"), ("wasted_prefill_s", ".0f"), ("wall_s", ".1f"),
]


def format_table(runs: list[RunSummary]) -> str:
    first = runs[0]
    head = (f"{first.prefill} prefill + {first.decode} decode instances, "
            f"speed {first.speed:g}x, admission {first.admission}")
    width = max(16, *(len(r.policy) + 2 for r in runs))
    lines = [head, f"{'':22}" + "".join(f"{r.policy:>{width}}" for r in runs)]
    for name, fmt in ROWS:
        cells = "".join(f"{format(getattr(r, name), fmt):>{width}}" for r in runs)
        lines.append(f"{name:22}{cells}")
    return "\n".join(lines)
