"""Where a fixed admission mode's goodput comes from in time: the requests that joined a
decode batch within the SLO in each stretch of a replay, and after the last arrival.

On a run of a few minutes a mode whose prefill queue is deep when arrivals stop goes on
feeding decode for up to a TTFT SLO after the last one, and the whole run counts that as
goodput; an unending stream has no such end. This table separates the two, for a trace
of `admission_sweep`'s grid (or its family, or "heldout") at the bench's speed:

    python -m loadtest.admission_drain "steady / 4k / reuse 85% / answers 40" [--span 900]

`--decode-wait S` replays the same trace with a decode stage that lets a KV finding no
room wait up to S seconds for a slot (`SimConfig.decode_wait_s`) instead of refusing it:
what the decode check's refusals cost in wasted prefill and what they buy in goodput.
"""
from __future__ import annotations

import argparse

import numpy as np

from conductor.metrics import REJECTED_AT_ARRIVAL, REJECTED_AT_DECODE, SERVED
from loadtest.admission_sweep import (GRID_REQUESTS, MIN_SPAN_S, MODES, _replay, joined_s,
                                      sized_trace)

STRETCH_EDGES_S = (0.0, 15.0, 30.0, 60.0, 120.0, 180.0, 240.0)


def drain_table(name: str, modes: list[str], requests: int = GRID_REQUESTS, seed: int = 5,
                span_s: float = MIN_SPAN_S, decode_wait_s: float = 0.0) -> str:
    """A markdown table: per mode, joins per stretch, after the last arrival, the rate
    from 30 s to the last arrival, the whole run's goodput, its wasted prefill and the
    mean prompt of the requests served and turned away (which sizes each stage keeps)."""
    _, trace, cost, speed = sized_trace(name, requests, seed, min_span_s=span_s)
    end = trace[-1].arrival_s / speed
    edges = [e for e in STRETCH_EDGES_S if e < end] + [end, np.inf]
    heads = [f"{a:.0f}-{b:.0f} s" for a, b in zip(edges, edges[1:-1])]
    wait = f", KV waits up to {decode_wait_s:g} s at decode" if decode_wait_s else ""
    lines = [f"{name}: {len(trace):,} requests at {speed:.2f}x, last arrival at {end:.0f} s"
             f"{wait}", "",
             "| mode | " + " | ".join(heads) + " | after the last arrival "
             "| rate from 30 s to the last arrival | whole run | wasted prefill "
             "| mean prompt: served / turned away at decode / at arrival |",
             "|---" * (len(heads) + 6) + "|"]
    inputs = np.fromiter((r.input_length for r in trace), float, len(trace))
    for mode in modes:
        summary, sim = _replay(trace, cost, mode, speed, decode_wait_s)
        joined = joined_s(sim, trace, speed)
        joined = joined[~np.isnan(joined)]
        counts = np.histogram(joined, edges)[0]
        rate = ((joined > 30.0) & (joined <= end)).sum() / max(end - 30.0, 1e-9)
        lines.append(f"| {mode} | " + " | ".join(f"{c:,}" for c in counts)
                     + f" | {rate:.1f}/s | {summary.completed_in_slo:,} "
                     f"| {summary.wasted_prefill_s:,.0f} s "
                     f"| {_mean_prompts(sim.out.status[:len(trace)], inputs)} |")
    return "\n".join(lines)


def _mean_prompts(status: np.ndarray, inputs: np.ndarray) -> str:
    """Mean input tokens of the requests served, turned away at decode and at arrival."""
    means = [inputs[status == s].mean() if (status == s).any() else None
             for s in (SERVED, REJECTED_AT_DECODE, REJECTED_AT_ARRIVAL)]
    return " / ".join("-" if m is None else f"{m:,.0f}" for m in means)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a trace name of the grid, the family, or heldout")
    ap.add_argument("--span", type=float, default=MIN_SPAN_S,
                    help="the least seconds of arrivals at the bench's speed (default 300)")
    ap.add_argument("--modes", default="baseline,predictive",
                    help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--requests", type=int, default=GRID_REQUESTS)
    ap.add_argument("--decode-wait", type=float, default=0.0, metavar="S",
                    help="seconds a KV finding decode full may wait for a slot (default 0)")
    args = ap.parse_args()
    print(drain_table(args.trace, args.modes.split(","), args.requests, span_s=args.span,
                      decode_wait_s=args.decode_wait))


if __name__ == "__main__":
    main()
