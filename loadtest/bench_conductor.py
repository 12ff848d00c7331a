"""Figure 5 and Table 3 of the Mooncake paper (FAST '25), replayed in our simulator.

Figure 5: mean TTFT of the four scheduling policies on the conversation
trace, 16 instances split 8 prefill + 8 decode, no admission control.
Table 3: rejections under overload for baseline, early and predictive
admission, on a split where decode memory binds (15P+1D, 3x) and on the
paper's 8P+8D at 2x, where our decode pool never fills. Prints our numbers
beside the paper's and writes the plots. `--sweep` replays every split from
15P+1D to 8P+8D at 2x to 6x and prints where the paper's order holds.
`--generalize` judges the admission modes on a family of generated traces
(`admission_sweep`).

    python -m loadtest.bench_conductor [TRACE] [--out DIR] [--sweep | --generalize [--traces ...]]
"""
from __future__ import annotations

import argparse
import os
from functools import partial
from multiprocessing import Pool
from pathlib import Path

import numpy as np

from conductor.admission import Slo
from conductor.costmodel import CostModel
from conductor.fit_odds import band_label
from conductor.metrics import SERVED
from conductor.plot import binned, plot_runs
from conductor.simulator import SimConfig, Simulator, replay
from conductor.trace import load_trace

TRACE = "/work/shared/data/conversation_trace.jsonl"
PAPER_FIG5 = {"random": 19.65, "load-balance": 5.27, "cache-aware": 3.58,
              "kvcache-centric": 3.07}
PAPER_TABLE3 = {"baseline": 4183, "early": 3771, "predictive": 3589}


def figure5(trace, cost, out: Path) -> None:
    runs = [replay(trace, SimConfig(prefill=8, decode=8, policy=p), cost) for p in PAPER_FIG5]
    glob = runs[-1][0].ttft_mean_s
    print("Figure 5: mean TTFT, conversation trace, 8 prefill + 8 decode, 1x")
    print(f"{'policy':18}{'paper (s)':>10}{'ours (s)':>10}{'paper/global':>14}"
          f"{'ours/global':>13}{'hit rate':>10}{'wall (s)':>10}")
    for (s, _), (name, paper) in zip(runs, PAPER_FIG5.items()):
        print(f"{name:18}{paper:>10.2f}{s.ttft_mean_s:>10.2f}"
              f"{paper / PAPER_FIG5['kvcache-centric']:>14.2f}{s.ttft_mean_s / glob:>13.2f}"
              f"{s.prefix_hit_rate:>10.3f}{s.wall_s:>10.1f}")
    plot_runs(runs, str(out / "conductor_fig5.png"), "TTFT by policy (8P+8D, 1x)")


def table3(trace, cost, out: Path | None, prefill: int, decode: int, speed: float) -> None:
    runs = [replay(trace, SimConfig(prefill=prefill, decode=decode, admission=mode,
                                    speed=speed, slo=Slo(30.0, 0.1)), cost)
            for mode in PAPER_TABLE3]
    print(f"\nTable 3: overload, {prefill} prefill + {decode} decode, {speed:g}x, "
          f"SLO TTFT 30 s / TBT 0.1 s")
    print(f"{'admission':12}{'paper rej.':>11}{'ours rej.':>10}{'at arrival':>11}"
          f"{'at decode':>10}{'goodput':>9}{'wasted prefill (s)':>20}"
          f"{'served mean input':>19}{'queue swing (s)':>17}")
    for (s, o), (mode, paper) in zip(runs, PAPER_TABLE3.items()):
        served = o.input_tokens[o.status == SERVED]
        print(f"{mode:12}{paper:>11}{s.rejected:>10}{s.rejected_at_arrival:>11}"
              f"{s.rejected_at_decode:>10}{s.completed_in_slo:>9}{s.wasted_prefill_s:>20.0f}"
              f"{served.mean():>19.0f}{np.std(binned(o.load_time_s, o.prefill_load)[1]):>17.2f}")
    if out is not None:
        plot_runs(runs[1:], str(out / "conductor_table3_load.png"),
                  f"early vs predictive admission ({prefill}P+{decode}D, {speed:g}x)")


def prediction_error(trace, cost, prefill: int, decode: int, speed: float) -> None:
    """How far predictive admission's decode-KV forecast is from what was there when due
    (every checked request, admitted or not)."""
    sim = Simulator(trace, SimConfig(prefill=prefill, decode=decode, admission="predictive",
                                     speed=speed), cost)
    sim.run()
    misses = sum(d.odds.misses() for d in sim.decodes)
    cap = cost.decode_capacity_tokens
    print(f"\nActual minus predicted decode KV when due, share of a node "
          f"({prefill}P+{decode}D, {speed:g}x, predictive)")
    print(f"{'due in':>12}{'requests':>10}{'mean':>8}{'std':>8}")
    for band, (n, total, squares) in enumerate(misses):
        if n:
            mean = total / n
            std = np.sqrt(max(squares / n - mean * mean, 0.0))
            print(f"{band_label(band):>12}{int(n):>10}{mean / cap:>8.3f}{std / cap:>8.3f}")


SWEEP_SPLITS = ((15, 1), (14, 2), (13, 3), (12, 4), (10, 6), (8, 8))
SWEEP_SPEEDS = (2.0, 3.0, 4.0, 5.0, 6.0)


def _rejections(trace, cost, point: tuple[int, int, float, str]) -> tuple[int, int]:
    p, d, speed, mode = point
    s, _ = replay(trace, SimConfig(prefill=p, decode=d, admission=mode, speed=speed), cost)
    return s.rejected, s.completed_in_slo


def sweep(trace, cost) -> None:
    """Every split and speed under the three modes, two processes at a time."""
    modes = tuple(PAPER_TABLE3)
    points = [(p, d, x, m) for p, d in SWEEP_SPLITS for x in SWEEP_SPEEDS for m in modes]
    with Pool(min(4, os.cpu_count() or 1)) as pool:
        results = pool.map(partial(_rejections, trace, cost), points, chunksize=1)
    print("\n| split | speed | baseline rejected / goodput | early | predictive "
          "| baseline rejects | paper's order |")
    print("|---|---|---|---|---|---|---|")
    n = len(trace)
    for i in range(0, len(points), len(modes)):
        p, d, x, _ = points[i]
        (rb, gb), (re_, ge), (rp, gp) = results[i:i + len(modes)]
        holds = rb > re_ > rp and gp >= max(gb, ge)
        print(f"| {p}P+{d}D | {x:g}x | {rb} / {gb} | {re_} / {ge} | {rp} / {gp} "
              f"| {rb / n:.0%} | {'yes' if holds else 'no'} |")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench_conductor")
    ap.add_argument("trace", nargs="?", default=TRACE)
    ap.add_argument("--out", default="docs", help="folder for the PNGs (default docs)")
    ap.add_argument("--overload", default="15:1:3", metavar="P:D:SPEED",
                    help="cluster and speed of the plotted Table 3 run (default 15:1:3); "
                         "the paper's 8:8:2 runs too")
    ap.add_argument("--sweep", action="store_true",
                    help="only the sweep of splits and speeds (a few minutes)")
    ap.add_argument("--generalize", action="store_true",
                    help="only the admission modes on generated traces (a few minutes)")
    ap.add_argument("--family", action="store_true",
                    help="with --generalize: the family of 17 traces varied from two presets "
                         "instead of the grid")
    ap.add_argument("--heldout", action="store_true",
                    help="with --generalize: the held-out trace at two loads")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per generated trace (--generalize; default 3000 on the grid, "
                         "4000 for the family and the held-out trace)")
    ap.add_argument("--seed", type=int, default=5,
                    help="seed of the generated traces (--generalize; default 5)")
    ap.add_argument("--traces", default="", metavar="NAME,...",
                    help="only these generated traces (--generalize; default all of "
                         "admission_sweep.GRID, or FAMILY with --family)")
    args = ap.parse_args()
    if args.generalize:
        from loadtest.admission_sweep import main as generalize_main
        generalize_main(args.requests, args.seed, [n for n in args.traces.split(",") if n],
                        args.family, args.heldout)
        return
    trace, cost, out = load_trace(args.trace), CostModel.from_testbed(), Path(args.out)
    if args.sweep:
        sweep(trace, cost)
        return
    out.mkdir(parents=True, exist_ok=True)
    figure5(trace, cost, out)
    p, d, speed = args.overload.split(":")
    table3(trace, cost, out, int(p), int(d), float(speed))
    prediction_error(trace, cost, int(p), int(d), float(speed))
    table3(trace, cost, None, 8, 8, 2.0)


if __name__ == "__main__":
    main()
