"""Figure 5 and Table 3 of the Mooncake paper (FAST '25), replayed in our simulator.

Figure 5: mean TTFT of the four scheduling policies on the conversation
trace, 16 instances split 8 prefill + 8 decode, no admission control.
Table 3: rejections under overload for baseline, early and predictive
admission, on a split where both pools saturate (14P+2D, 5x) and on the
paper's 8P+8D at 2x, where our decode pool never fills. Prints our numbers
beside the paper's and writes the plots.

    python -m loadtest.bench_conductor [TRACE] [--out DIR]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from conductor.admission import Slo
from conductor.costmodel import CostModel
from conductor.metrics import SERVED
from conductor.plot import plot_runs
from conductor.simulator import SimConfig, replay
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
          f"{'served mean input':>19}")
    for (s, o), (mode, paper) in zip(runs, PAPER_TABLE3.items()):
        served = o.input_tokens[o.status == SERVED]
        print(f"{mode:12}{paper:>11}{s.rejected:>10}{s.rejected_at_arrival:>11}"
              f"{s.rejected_at_decode:>10}{s.completed_in_slo:>9}{s.wasted_prefill_s:>20.0f}"
              f"{served.mean():>19.0f}")
    if out is not None:
        plot_runs(runs[1:], str(out / "conductor_table3_load.png"),
                  f"early vs predictive admission ({prefill}P+{decode}D, {speed:g}x)")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench_conductor")
    ap.add_argument("trace", nargs="?", default=TRACE)
    ap.add_argument("--out", default="docs", help="folder for the PNGs (default docs)")
    ap.add_argument("--overload", default="14:2:5", metavar="P:D:SPEED",
                    help="cluster and speed of the plotted Table 3 run (default 14:2:5); "
                         "the paper's 8:8:2 runs too")
    args = ap.parse_args()
    trace, cost, out = load_trace(args.trace), CostModel.from_testbed(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    figure5(trace, cost, out)
    p, d, speed = args.overload.split(":")
    table3(trace, cost, out, int(p), int(d), float(speed))
    table3(trace, cost, None, 8, 8, 2.0)


if __name__ == "__main__":
    main()
