"""Admission modes judged on generated traces, not on the one they were built on.

`python -m loadtest.bench_conductor --generalize` runs the grid: every
combination of four independent knobs of the generator (`GRID`: arrival
regularity from steadier than Poisson to heavy bursts, prompt length, the
share of a prompt that is a prefix shared with other requests, and answer
length), each trace at the replay speed where the baseline rejects 20-40 %
on 15P+1D. Every mode runs on it, the `audited` one included (one audited
replay gives all four: its shadows are the fixed modes), and the report ends
with a map of where each fixed mode wins and how close `audited` comes to the
best of them. `--family` runs the earlier family of 17 traces instead, and
`--heldout` the held-out trace (`HELDOUT`) at two speeds.

Each trace of the family varies one or two of the generator's parameters from two starting
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
from dataclasses import dataclass, field
from functools import partial
from multiprocessing import Pool

import numpy as np

from conductor.costmodel import CostModel
from conductor.fit_odds import HORIZON_EDGES_S, band_label
from conductor.metrics import SERVED, RunSummary
from conductor.simulator import SimConfig, Simulator
from conductor.tracegen import Lengths, generate, spec_from
from conductor.tracestats import reusable_blocks

MODES = ("baseline", "early", "predictive")
ALL_MODES = (*MODES, "audited")
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


# The grid: each knob at two or three levels, every combination (3 x 2 x 2 x 2 = 24 traces).
# Prompts draw their length from a log-normal (sigma 0.6) and share their first `reuse` of it
# with the other requests that open with the same of 8 contexts (Zipf 0.8); no follow-ups, so
# the share is the knob's (`TraceSpec.reuse`).
GRID_ARRIVAL_CV = {"steady": 0.3, "poisson": 1.0, "bursts": 4.0}
GRID_PROMPT = {"4k": 4000, "24k": 24000}
GRID_REUSE = {"reuse 20%": 0.2, "reuse 85%": 0.85}
GRID_ANSWER = {"answers 40": 40, "answers 400": 400}
GRID_REQUESTS = 3000
# A grid or held-out trace lasts at least this long at its speed (more requests if needed):
# cheap prefills and short answers need 100+ requests a second to fill decode, and 3,000 of
# them in 23 s are one burst shorter than the TTFT SLO, not a regime to audit.
MIN_SPAN_S = 300.0


def grid_overrides(arrival: str, prompt: str, reuse: str, answer: str) -> dict:
    return dict(arrival="gamma", burst_cv=GRID_ARRIVAL_CV[arrival], rate=1.0,
                first_tokens=_L(f"{GRID_PROMPT[prompt]}:0.6@64-120000"),
                reuse=GRID_REUSE[reuse], system_prompts=8, system_zipf=0.8, continue_p=0.0,
                output_tokens=_L(f"{GRID_ANSWER[answer]}:0.7@1-2000"))


GRID: dict[str, tuple[str | None, dict, str]] = {
    f"{a} / {p} / {r} / {o}": (None, grid_overrides(a, p, r, o), "grid")
    for a in GRID_ARRIVAL_CV for p in GRID_PROMPT for r in GRID_REUSE for o in GRID_ANSWER}

# The held-out trace: the style of the trace the grid's region stands for (steady arrivals,
# long prompts with much prefix reuse, short answers), built on the documents preset's
# structure rather than the grid's knob, with a seed not used while the audit was designed.
HELDOUT_SEED = 23
HELDOUT_REQUESTS = 4000
HELDOUT = ("documents", dict(arrival="gamma", burst_cv=0.5, documents=40, document_zipf=0.8,
                             document_share=0.9, document_tokens=_L("20000:0.4"),
                             first_tokens=_L("400:1"), output_tokens=_L("50:0.8@1-2000")),
           "steady, 20 k documents, short answers")
HELDOUT_LOADS = (1.0, 1.67)     # x the speed where the baseline rejects 20-40 %


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
    switches: list = ()         # the audit's switches: (audited arrivals, from, to)
    in_force: dict | None = None    # arrivals decided under each mode by the audited run
    worst_gap: int = 0          # the most the mode in force trailed the best in the window
    # per mode, the requests served within the SLO whose KV joined decode by the last arrival
    while_loaded: dict[str, int] = field(default_factory=dict)

    def goodput(self, mode: str) -> int:
        return self.runs[mode].completed_in_slo


def _replay(trace, cost: CostModel, mode: str, speed: float,
            decode_wait_s: float = 0.0) -> tuple[RunSummary, Simulator]:
    sim = Simulator(trace, SimConfig(prefill=PREFILL, decode=DECODE, admission=mode,
                                     speed=speed, decode_wait_s=decode_wait_s), cost)
    return sim.run(), sim


def _misses(sim: Simulator) -> np.ndarray:
    """The forecast's misses per horizon band as a share of a node (see `FitOdds.misses`)."""
    cap = sim.cost.decode_capacity_tokens
    return sum(d.odds.misses() for d in sim.decodes) * np.array([1.0, 1 / cap, cap ** -2])


def joined_s(sim: Simulator, trace, speed: float) -> np.ndarray:
    """When each request served within the SLO joined a decode batch (its first token, then
    the KV transfer), seconds of the run; NaN for the others."""
    out, n, slo = sim.out, len(trace), sim.cfg.slo
    arrival = np.fromiter((r.arrival_s for r in trace), float, n) / speed
    inputs = np.fromiter((r.input_length for r in trace), float, n)
    ttft, tbt = out.ttft_s[:n], out.tbt_s[:n]
    with np.errstate(invalid="ignore"):
        ok = (out.status[:n] == SERVED) & (ttft <= slo.ttft_s) & (tbt <= slo.tbt_s)
    return np.where(ok, arrival + ttft + sim.cost.transfer_s(inputs), np.nan)


def served_while_loaded(sim: Simulator, trace, speed: float) -> int:
    """Requests served within the SLO whose KV joined a decode batch by the last arrival's
    time: the goodput while the trace still loads the cluster. After the last arrival a
    mode with a deep prefill queue goes on feeding decode for up to a TTFT SLO, which a
    run of a few minutes counts as a lead it would not have in an unending stream."""
    with np.errstate(invalid="ignore"):
        return int((joined_s(sim, trace, speed) <= trace[-1].arrival_s / speed).sum())


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


def sized_trace(name: str, requests: int, seed: int, load: float = 1.0,
                min_span_s: float = MIN_SPAN_S) -> tuple:
    """(spec, trace, cost model, speed) of a trace of `FAMILY` or `GRID` (or "heldout") at
    ``load`` x the speed where the baseline rejects 20-40 %, the grid's and the held-out
    trace as long as ``min_span_s`` at that speed makes them."""
    preset, overrides, _ = HELDOUT if name == "heldout" else {**FAMILY, **GRID}[name]
    spec = spec_from(preset, requests=requests, seed=seed, **overrides)
    trace = list(generate(spec))
    cost = CostModel.from_testbed()
    speed, _ = find_speed(trace, cost)
    speed *= load
    span = trace[-1].arrival_s / speed
    if name not in FAMILY and span < min_span_s:
        # the same trace, longer (the generator streams: its first requests are the same)
        spec = spec_from(preset, requests=math.ceil(requests * min_span_s / span), seed=seed,
                         **overrides)
        trace = list(generate(spec))
    return spec, trace, cost, speed


def run_trace(name: str, requests: int, seed: int, load: float = 1.0,
              min_span_s: float = MIN_SPAN_S) -> TraceResult:
    """One trace of `FAMILY` or `GRID` (or "heldout"), at ``load`` x the speed where the
    baseline rejects 20-40 %: every fixed mode and the audited one, in one audited replay."""
    spec, trace, cost, speed = sized_trace(name, requests, seed, load, min_span_s)
    reusable, total = reusable_blocks(trace)
    varies = (HELDOUT if name == "heldout" else {**FAMILY, **GRID}[name])[2]
    summary, sim = _replay(trace, cost, "audited", speed)
    runs = {**sim.shadow_summaries, "audited": summary}    # its shadows are the fixed modes
    loaded = {m: served_while_loaded(s, trace, speed)
              for m, s in [*sim.shadows.items(), ("audited", sim)]}
    shadow = sim.shadows["predictive"]
    return TraceResult(name, spec.arrival, varies, reusable / total, speed, runs,
                       _misses(shadow), shadow.admission.held, list(sim.audit.switches),
                       dict(sim.audit.in_force), sim.audit.worst_gap, loaded)


def generalize(requests: int = 4000, seed: int = 5, names: list[str] | None = None,
               processes: int = 2, loads: list[float] | None = None,
               min_span_s: float = MIN_SPAN_S) -> list[TraceResult]:
    """Every trace of the family (or ``names``), one worker process per trace (and per load
    in ``loads``, default 1)."""
    jobs = [(n, x) for n in (names or list(FAMILY)) for x in (loads or [1.0])]
    work = partial(_run_job, requests=requests, seed=seed, min_span_s=min_span_s)
    if processes <= 1:
        return [work(j) for j in jobs]
    with Pool(processes) as pool:
        return pool.map(work, jobs, chunksize=1)


def _run_job(job: tuple[str, float], requests: int, seed: int,
             min_span_s: float = MIN_SPAN_S) -> TraceResult:
    return run_trace(job[0], requests, seed, job[1], min_span_s)


def best_modes(result: TraceResult) -> list[str]:
    """The fixed modes with the most goodput (ties: each)."""
    top = max(result.goodput(m) for m in MODES)
    return [m for m in MODES if result.goodput(m) == top]


def audited_ratio(r: TraceResult) -> float:
    """The audited run's goodput over the best fixed mode's."""
    return r.goodput("audited") / max(r.goodput(m) for m in MODES)


def loaded_ratio(r: TraceResult) -> float:
    """`audited_ratio` counting only what was served by the last arrival
    (`served_while_loaded`)."""
    best = max(r.while_loaded[m] for m in MODES)
    return r.while_loaded["audited"] / best if best else 1.0


def waste_ratio(r: TraceResult, mode: str = "audited") -> float:
    base = r.runs["baseline"].wasted_prefill_s
    return r.runs[mode].wasted_prefill_s / base if base else 0.0


def _in_force(r: TraceResult) -> str:
    total = sum((r.in_force or {}).values()) or 1
    return " / ".join(f"{(r.in_force or {}).get(m, 0) / total:.0%}" for m in MODES)


def report(results: list[TraceResult], wall_s: float) -> str:
    """The markdown tables of docs/conductor.md's generalization section."""
    lines = ["| trace | requests | speed | baseline rejects "
             "| goodput: baseline / early / predictive / audited | audited ÷ best fixed "
             "| predictive ÷ best other | wasted prefill (s): baseline / early / predictive "
             "/ audited | audited ÷ baseline | in force: B / E / P | switches "
             "| by the last arrival: B / E / P / audited | audited ÷ best, by then |",
             "|---" * 13 + "|"]
    ratios, waste, loaded = [], [], []
    for r in results:
        b, e, p, a = (r.runs[m] for m in ALL_MODES)
        ratios.append(audited_ratio(r))
        waste.append(waste_ratio(r))
        loaded.append(loaded_ratio(r))
        pred = p.completed_in_slo / max(b.completed_in_slo, e.completed_in_slo)
        label = r.name if not r.name == "heldout" else f"held out ({r.varies})"
        lines.append(
            f"| {label} | {b.requests:,} | {r.speed:.2f}x | {b.rejected / b.requests:.0%} "
            f"| {b.completed_in_slo} / {e.completed_in_slo} / {p.completed_in_slo} / "
            f"{a.completed_in_slo} | {ratios[-1]:.3f} | {pred:.3f} "
            f"| {b.wasted_prefill_s:.0f} / {e.wasted_prefill_s:.0f} / {p.wasted_prefill_s:.0f} / "
            f"{a.wasted_prefill_s:.0f} | {waste[-1]:.2f} | {_in_force(r)} | {len(r.switches)} "
            f"| {' / '.join(str(r.while_loaded[m]) for m in ALL_MODES)} | {loaded[-1]:.3f} |")
    n = len(results)
    wins = {m: sum(m in best_modes(r) for r in results) for m in MODES}
    lines += ["", "Best fixed mode (ties count for each): " + ", ".join(
        f"{m} {wins[m]} of {n}" for m in MODES) + ".",
        f"Audited >= 0.98 x the best fixed mode on {sum(x >= 0.98 for x in ratios)} of {n} "
        f"(lowest {min(ratios):.3f}, mean {sum(ratios) / n:.3f}); wasted prefill <= 0.5 x the "
        f"baseline's on {sum(w <= 0.5 for w in waste)} of {n} (highest {max(waste):.2f}); "
        f"served by the last arrival, audited >= 0.98 x the best fixed mode on "
        f"{sum(x >= 0.98 for x in loaded)} of {n} (lowest {min(loaded):.3f}). "
        f"Wall time {wall_s:.0f} s."]
    if all(r.name in GRID for r in results):
        lines += ["", grid_map(results)]
    return "\n".join(lines)


def grid_map(results: list[TraceResult]) -> str:
    """Where each fixed mode wins on the grid: rows arrival x answers, columns prompt x reuse;
    a cell names the best fixed mode(s) (B, E, P) and the audited run's ratio to it."""
    by_name = {r.name: r for r in results}
    cols = [(p, u) for p in GRID_PROMPT for u in GRID_REUSE]
    lines = ["| arrivals, answers | " + " | ".join(f"{p} prompts, {u}" for p, u in cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    for a in GRID_ARRIVAL_CV:
        for o in GRID_ANSWER:
            cells = []
            for p, u in cols:
                r = by_name.get(f"{a} / {p} / {u} / {o}")
                if r is None:
                    cells.append("")
                    continue
                best = "".join(m[0].upper() for m in best_modes(r))
                cells.append(f"{best} {audited_ratio(r):.3f}")
            lines.append(f"| {a} (CV {GRID_ARRIVAL_CV[a]:g}), {o} | " + " | ".join(cells) + " |")
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


def main(requests: int | None, seed: int, names: list[str] | None = None,
         family: bool = False, heldout: bool = False) -> None:
    pool = FAMILY if family else GRID
    unknown = sorted(set(names or ()) - set(pool))
    if unknown:
        raise SystemExit(f"unknown trace {', '.join(unknown)} (choose from {', '.join(pool)})")
    started = time.perf_counter()
    if heldout:
        results = generalize(requests or HELDOUT_REQUESTS, HELDOUT_SEED, ["heldout"],
                             loads=list(HELDOUT_LOADS))
        what = f"the held-out trace (seed {HELDOUT_SEED}) at {' and '.join(map(str, HELDOUT_LOADS))} x"
    else:
        requests = requests or (4000 if family else GRID_REQUESTS)
        results = generalize(requests, seed, names or list(pool))
        what = (f"{len(results)} generated traces of {requests} requests (seed {seed}), at")
    print(f"Generalization: {what} the speed where the baseline rejects "
          f"{BAND[0]:.0%}-{BAND[1]:.0%}; {PREFILL}P+{DECODE}D, kvcache-centric, "
          f"SLO TTFT 30 s / TBT 0.1 s\n")
    print(report(results, time.perf_counter() - started))
    print()
    print(_bias_table(results))
