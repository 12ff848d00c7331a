"""Admission modes judged on a family of generated traces, not on the one they were built on.

`python -m loadtest.bench_conductor --generalize` runs this. Each trace of the
family varies one or two of the generator's parameters from two starting
shapes (the conversation preset, about 37 % of blocks reusable, and the
shared-document preset, about 65 %): the arrival process (Poisson, gamma
bursts, a daily swing, ticks), the reuse structure (documents, agent-style
long system prompts with quick turns, session trees, none at all) and the
length distributions. For each trace the replay speed is searched (doubling,
then halving the interval in log speed) until the baseline rejects 20-40 %
of the requests on 15P+1D; then early and predictive run at that speed. The
report is one row per trace (with how many requests predictive admitted
with a held prefill start), the share of traces on which each mode serves
the most requests within the SLO, and the bias of the predictive forecast by
horizon over all traces (every checked request scored, see `fit_odds`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from multiprocessing import Pool

import numpy as np

from conductor.costmodel import CostModel
from conductor.fit_odds import HORIZON_EDGES_S, band_label
from conductor.metrics import RunSummary
from conductor.simulator import SimConfig, Simulator
from conductor.tracegen import Lengths, generate, spec_from
from conductor.tracestats import reusable_blocks

MODES = ("baseline", "early", "predictive")
PREFILL, DECODE = 15, 1
BAND = (0.20, 0.40)       # share of requests the baseline rejects at the chosen speed
SEARCH_STEPS = 10

_L = Lengths.parse
_AGENT = dict(document_share=0.0, system_prompts=8, system_tokens=_L("6000:0.5"),
              continue_p=0.6, branch_p=0.1, think_s=_L("5:1@1-3600"),
              followup_tokens=_L("600:1"), output_tokens=_L("150:0.8@1-2000"))
_SHORT_ANSWERS = dict(output_tokens=_L("120:0.9@1-2000"), document_tokens=_L("16000:0.5"),
                      first_tokens=_L("800:1.2"))
# name -> (preset, overrides, what it varies)
FAMILY: dict[str, tuple[str, dict, str]] = {
    "conversation": ("conversation", {}, "the preset (gap CV 1.3, 3 s ticks)"),
    "conv-poisson": ("conversation", dict(arrival="poisson", tick_s=0.0), "Poisson arrivals"),
    "conv-bursty": ("conversation", dict(burst_cv=3.0, tick_s=0.0), "gamma gaps, CV 3"),
    "conv-diurnal": ("conversation", dict(arrival="diurnal", tick_s=0.0), "rate swings +-60 %"),
    "conv-short-prompts": ("conversation", dict(first_tokens=_L("1500:1"),
                                                output_tokens=_L("400:0.6@1-2000")),
                           "1.5 k-token openings"),
    "conv-trees": ("conversation", dict(continue_p=0.4, branch_p=0.4), "branching sessions"),
    "no-reuse": ("conversation", dict(continue_p=0.0, system_tokens=_L("200:0")),
                 "no follow-ups, tiny system prompt"),
    "documents": ("documents", {}, "the preset"),
    "docs-bursty": ("documents", dict(arrival="bursty"), "gamma gaps, CV 3"),
    "docs-diurnal": ("documents", dict(arrival="diurnal"), "rate swings +-60 %"),
    "docs-ticks": ("documents", dict(tick_s=10.0, **_SHORT_ANSWERS), "10 s ticks, short answers"),
    "docs-short-answers": ("documents", _SHORT_ANSWERS, "answers of ~120 tokens"),
    "docs-long-answers": ("documents", dict(output_tokens=_L("800:0.6@1-4000")),
                          "answers of ~800 tokens"),
    "docs-popular": ("documents", dict(documents=60, document_zipf=1.0, document_share=0.8),
                     "60 documents, Zipf 1"),
    "agent": ("documents", _AGENT, "6 k system prompts, quick turns"),
    "agent-bursty": ("documents", dict(arrival="bursty", **_AGENT), "the same, CV 3"),
    "docs-extreme-bursts": ("documents", dict(arrival="bursty", burst_cv=6.0, **_SHORT_ANSWERS),
                            "gamma gaps, CV 6, short answers"),
}


@dataclass
class TraceResult:
    name: str
    arrival: str
    varies: str
    reusable: float
    speed: float
    runs: dict[str, RunSummary]
    misses: np.ndarray          # per horizon band: n, sum, sum of squares (share of a node)
    held: int                   # requests predictive admitted with a held prefill start

    def goodput(self, mode: str) -> int:
        return self.runs[mode].completed_in_slo


def _replay(trace, cost: CostModel, mode: str, speed: float) -> tuple[RunSummary, Simulator]:
    sim = Simulator(trace, SimConfig(prefill=PREFILL, decode=DECODE, admission=mode,
                                     speed=speed), cost)
    return sim.run(), sim


def _misses(sim: Simulator) -> np.ndarray:
    """The forecast's misses per horizon band as a share of a node (see `FitOdds.misses`)."""
    cap = sim.cost.decode_capacity_tokens
    return sum(d.odds.misses() for d in sim.decodes) * np.array([1.0, 1 / cap, cap ** -2])


def find_speed(trace, cost: CostModel) -> tuple[float, RunSummary]:
    """A speed at which the baseline rejects a share of requests inside `BAND`
    (or the closest one found in `SEARCH_STEPS` replays)."""
    lo = hi = None
    speed, best = 2.0, None
    for _ in range(SEARCH_STEPS):
        summary, _ = _replay(trace, cost, "baseline", speed)
        share = summary.rejected / summary.requests
        gap = 0.0 if BAND[0] <= share <= BAND[1] else min(abs(share - b) for b in BAND)
        if best is None or gap < best[0]:
            best = (gap, speed, summary)
        if gap == 0.0:
            break
        if share < BAND[0]:
            lo = speed
        else:
            hi = speed
        speed = speed * 2 if hi is None else speed / 2 if lo is None else math.sqrt(lo * hi)
    return best[1], best[2]


def run_trace(name: str, requests: int, seed: int) -> TraceResult:
    preset, overrides, varies = FAMILY[name]
    spec = spec_from(preset, requests=requests, seed=seed, **overrides)
    trace = list(generate(spec))
    reusable, total = reusable_blocks(trace)
    cost = CostModel.from_testbed()
    speed, baseline = find_speed(trace, cost)
    runs = {"baseline": baseline}
    runs["early"], _ = _replay(trace, cost, "early", speed)
    runs["predictive"], sim = _replay(trace, cost, "predictive", speed)
    return TraceResult(name, spec.arrival, varies, reusable / total, speed, runs, _misses(sim),
                       sim.admission.held)


def generalize(requests: int = 4000, seed: int = 5, names: list[str] | None = None,
               processes: int = 2) -> list[TraceResult]:
    """Every trace of the family (or ``names``), one worker process per trace."""
    names = names or list(FAMILY)
    work = partial(run_trace, requests=requests, seed=seed)
    if processes <= 1:
        return [work(n) for n in names]
    with Pool(processes) as pool:
        return pool.map(work, names, chunksize=1)


def best_modes(result: TraceResult) -> list[str]:
    top = max(result.goodput(m) for m in MODES)
    return [m for m in MODES if result.goodput(m) == top]


def report(results: list[TraceResult], wall_s: float) -> str:
    """The markdown tables of docs/conductor.md's generalization section."""
    lines = ["| trace | varies | arrival | reusable | speed | baseline rejects "
             "| rejected: baseline / early / predictive | goodput: baseline / early / predictive "
             "| predictive ÷ best other | wasted prefill (s): baseline / early / predictive "
             "| predictive ÷ baseline | held |", "|---" * 12 + "|"]
    ratios, waste = [], []
    for r in results:
        b, e, p = (r.runs[m] for m in MODES)
        ratios.append(p.completed_in_slo / max(b.completed_in_slo, e.completed_in_slo))
        waste.append(p.wasted_prefill_s / b.wasted_prefill_s if b.wasted_prefill_s else 0.0)
        lines.append(
            f"| {r.name} | {r.varies} | {r.arrival} | {r.reusable:.0%} | {r.speed:.2f}x "
            f"| {b.rejected / b.requests:.0%} | {b.rejected} / {e.rejected} / {p.rejected} "
            f"| {b.completed_in_slo} / {e.completed_in_slo} / {p.completed_in_slo} "
            f"| {ratios[-1]:.3f} | {b.wasted_prefill_s:.0f} / {e.wasted_prefill_s:.0f} / "
            f"{p.wasted_prefill_s:.0f} | {waste[-1]:.2f} | {r.held} |")
    n = len(results)
    wins = {m: sum(m in best_modes(r) for r in results) for m in MODES}
    lines += ["", "Best goodput (ties count for each): " + ", ".join(
        f"{m} {wins[m]} of {n} ({wins[m] / n:.0%})" for m in MODES) + ".",
        f"Predictive >= 0.99 x the better of baseline and early on {sum(x >= 0.99 for x in ratios)}"
        f" of {n} traces (lowest {min(ratios):.3f}); wasted prefill <= 0.5 x the baseline's on "
        f"{sum(w <= 0.5 for w in waste)} of {n} (highest {max(waste):.2f}). Wall time "
        f"{wall_s:.0f} s.", "", _bias_table(results)]
    return "\n".join(lines)


def _bias_table(results: list[TraceResult]) -> str:
    """Actual minus forecast decode KV at the due time, share of a node, all traces pooled."""
    totals = sum(r.misses for r in results)
    lines = ["| request due in | forecasts | actual − forecast, mean | std |", "|---|---|---|---|"]
    for band in range(len(HORIZON_EDGES_S) + 1):
        n, s, s2 = totals[band]
        if n:
            mean = s / n
            lines.append(f"| {band_label(band)} | {int(n)} | {mean:+.3f} "
                         f"| {math.sqrt(max(s2 / n - mean * mean, 0.0)):.3f} |")
    return "\n".join(lines)


def main(requests: int, seed: int, names: list[str] | None = None) -> None:
    unknown = sorted(set(names or ()) - set(FAMILY))
    if unknown:
        raise SystemExit(f"unknown trace {', '.join(unknown)} (choose from {', '.join(FAMILY)})")
    started = time.perf_counter()
    results = generalize(requests, seed, names)
    print(f"Generalization: {len(results)} generated traces of {requests} requests (seed {seed}), "
          f"{PREFILL}P+{DECODE}D, kvcache-centric, SLO TTFT 30 s / TBT 0.1 s, at the speed where "
          f"the baseline rejects {BAND[0]:.0%}-{BAND[1]:.0%}\n")
    print(report(results, time.perf_counter() - started))
