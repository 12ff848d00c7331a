"""Past one machine, by simulation: the conductor's replay at hundreds of instances and a million
requests, and the store cluster's real slot, leader, replication and migration code at 16-256
nodes (`sim_cluster`). docs/scale.md is written from what this prints.

    python -m loadtest.bench_scale replay                   # 1M requests, 256P+256D, every policy x mode
    python -m loadtest.bench_scale replay --full kvcache-centric:none --others 100000
    python -m loadtest.bench_scale growth                   # wall time vs requests, vs instances
    python -m loadtest.bench_scale cluster --nodes 16 64 256
    python -m loadtest.bench_scale cluster --nodes 256 --blocks-per-node 410 --events join   # 64 GiB nodes
    python -m loadtest.bench_scale hits --nodes 16          # hit ratio vs DRAM per node
    python -m loadtest.bench_scale map --nodes 256          # map size, watch events and bytes per join

Replays run one at a time, each in a fresh process that generates its trace itself (the
conversation preset, its rate scaled with the prefill instances so each sees the load of the
paper's 8P+8D at 1x), so a row's peak memory (ru_maxrss) is that replay's alone. Wall time
depends on what else the host runs: each row also gives its CPU time, and the load average is
printed before and after. The growth tables give each size's time per request as a ratio to
the smallest size of the same run.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

import numpy as np

from conductor.admission import MODES
from conductor.policy import POLICIES

RATE_PER_PREFILL = 3.4 / 8          # the conversation trace on the paper's 8 prefill instances at 1x


@dataclass(frozen=True)
class ReplayJob:
    policy: str
    admission: str
    requests: int
    prefill: int
    decode: int
    seed: int = 0


@dataclass
class ReplayRow:
    job: ReplayJob
    trace_s: float
    wall_s: float
    cpu_s: float
    peak_mb: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tbt_p50_s: float
    tbt_p90_s: float
    tbt_p99_s: float
    hit_rate: float
    rejected: float


def run_replay(job: ReplayJob) -> ReplayRow:
    """One replay in this (fresh) process: generate the trace, replay it, measure."""
    from conductor.costmodel import CostModel
    from conductor.metrics import SERVED
    from conductor.simulator import SimConfig, replay
    from conductor.tracegen import generate, spec_from

    started = time.perf_counter()
    spec = spec_from("conversation", requests=job.requests, seed=job.seed,
                     rate=RATE_PER_PREFILL * job.prefill)
    trace = list(generate(spec))
    trace_s = time.perf_counter() - started
    config = SimConfig(prefill=job.prefill, decode=job.decode, policy=job.policy,
                       admission=job.admission, seed=job.seed)
    wall, cpu = time.perf_counter(), time.process_time()
    summary, out = replay(trace, config, CostModel.from_testbed())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    served = out.status == SERVED
    ttft = out.ttft_s[served & ~np.isnan(out.ttft_s)]
    tbt = out.tbt_s[served & ~np.isnan(out.tbt_s)]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return ReplayRow(job, trace_s, wall, cpu, peak_mb, *np.percentile(ttft, [50, 90, 99]),
                     *np.percentile(tbt, [50, 90, 99]), summary.prefix_hit_rate,
                     summary.rejected / summary.requests)


def run_all(jobs: list[ReplayJob], on_row) -> list[ReplayRow]:
    """Each job in its own fresh process, one after another."""
    rows = []
    with ProcessPoolExecutor(1, mp_context=get_context("spawn"), max_tasks_per_child=1) as pool:
        for row in pool.map(run_replay, jobs):
            on_row(row)
            rows.append(row)
    return rows


REPLAY_HEAD = ("| policy | admission | requests | wall (s) | CPU (s) | peak (MB) | TTFT p50/p90/p99 (s) "
               "| TBT p50/p90/p99 (ms) | prefix hit rate | rejected |\n|---|---|---|---|---|---|---|---|---|---|")


def replay_line(r: ReplayRow) -> str:
    j = r.job
    return (f"| {j.policy} | {j.admission} | {j.requests:,} | {r.wall_s:.1f} | {r.cpu_s:.1f} "
            f"| {r.peak_mb:.0f} | {r.ttft_p50_s:.2f} / {r.ttft_p90_s:.2f} / {r.ttft_p99_s:.2f} "
            f"| {1e3 * r.tbt_p50_s:.1f} / {1e3 * r.tbt_p90_s:.1f} / {1e3 * r.tbt_p99_s:.1f} "
            f"| {r.hit_rate:.3f} | {r.rejected:.1%} |")


def load_line(when: str) -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {when}: {one:.1f} {five:.1f} {fifteen:.1f} ({os.cpu_count()} CPUs)"


def cmd_replay(args) -> None:
    full = set(args.full or [f"{p}:{m}" for p in POLICIES for m in MODES])
    jobs = [ReplayJob(p, m, args.requests if f"{p}:{m}" in full else args.others,
                      args.instances, args.instances, args.seed)
            for p in POLICIES for m in MODES if f"{p}:{m}" in full or args.others]
    print(f"{args.instances}P+{args.instances}D, conversation preset at "
          f"{RATE_PER_PREFILL * args.instances:.1f} req/s, seed {args.seed}")
    print(load_line("before"))
    print(REPLAY_HEAD, flush=True)
    run_all(jobs, lambda row: print(replay_line(row), flush=True))
    print(load_line("after"))


def growth_table(title: str, jobs: list[ReplayJob]) -> None:
    """Time per request of each job, as a ratio to the first."""
    print(f"\n{title}\n| instances | requests | wall (s) | CPU (s) | CPU µs/request "
          f"| ratio to first | peak (MB) |\n|---|---|---|---|---|---|---|", flush=True)
    first = []

    def row(r: ReplayRow) -> None:
        per = 1e6 * r.cpu_s / r.job.requests
        first.append(per)
        print(f"| {r.job.prefill}P+{r.job.decode}D | {r.job.requests:,} | {r.wall_s:.1f} | {r.cpu_s:.1f} | {per:.0f} "
              f"| {per / first[0]:.2f} | {r.peak_mb:.0f} |", flush=True)
    run_all(jobs, row)


def cmd_growth(args) -> None:
    policy, mode = args.policy.split(":")
    print(load_line("before"))
    growth_table(f"Wall time vs requests ({policy}, {mode}, 256P+256D)",
                 [ReplayJob(policy, mode, n, 256, 256) for n in args.requests])
    growth_table(f"Wall time vs instances ({policy}, {mode}, {args.seconds:g} s of traffic, its rate "
                 f"scaled with the instances)",
                 [ReplayJob(policy, mode, round(RATE_PER_PREFILL * n * args.seconds), n, n)
                  for n in args.instances])
    print(load_line("after"))


def cmd_cluster(args) -> None:
    from loadtest.sim_cluster import SimSettings, simulate
    from loadtest.sim_report import print_report

    print(load_line("before"))
    for nodes in args.nodes:
        settings = SimSettings(nodes=nodes, seed=args.seed, blocks_per_node=args.blocks_per_node,
                               hot_reads=args.hot_reads, **({"events": tuple(args.events)} if args.events else {}))
        wall, cpu = time.perf_counter(), time.process_time()
        report = simulate(settings)
        print_report(report, time.perf_counter() - wall, time.process_time() - cpu)
    print(load_line("after"))


def cmd_hits(args) -> None:
    """Hit ratio against DRAM per node, no churn: each size warmed well past filling its DRAM (a
    node fills in about blocks / 8 s at the default rate)."""
    from loadtest.sim_cluster import SimSettings, simulate

    print(f"\nHit ratio vs DRAM per node ({args.nodes} nodes, conversation load, no churn)")
    print("| blocks per node | DRAM per node (GiB) | holds (s of writes) | hit ratio | reads GB/s per node "
          "(mean / busiest) |\n|---|---|---|---|---|", flush=True)
    for blocks in args.blocks:
        settings = SimSettings(nodes=args.nodes, blocks_per_node=blocks, seed=args.seed, events=(),
                               warmup_s=0.4 * blocks + 60 + args.window, window_s=args.window,
                               gap_s=args.window)
        r = simulate(settings)
        print(f"| {blocks} | {blocks * settings.nic.block_bytes / 2**30:,.0f} | {r.retention_s:.0f} "
              f"| {r.steady_hit:.3f} | {r.read_gbps_per_node[0]:.2f} / {r.read_gbps_per_node[1]:.2f} |",
              flush=True)


def cmd_map(args) -> None:
    from loadtest.sim_slotmap import map_growth

    for nodes in args.nodes:
        map_growth(nodes, args.seed)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench_scale",
                                 description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("replay", help="every policy x admission mode at scale")
    rp.add_argument("--requests", type=int, default=1_000_000)
    rp.add_argument("--instances", type=int, default=256, help="prefill and decode instances each")
    rp.add_argument("--full", nargs="*", metavar="POLICY:MODE",
                    help="only these run at --requests (default: all)")
    rp.add_argument("--others", type=int, default=100_000, help="requests for the rest (0: skip them)")
    rp.add_argument("--seed", type=int, default=0)
    gp = sub.add_parser("growth", help="wall time vs requests and vs instances")
    gp.add_argument("--policy", default="kvcache-centric:none", metavar="POLICY:MODE")
    gp.add_argument("--requests", type=int, nargs=3, default=[100_000, 300_000, 1_000_000],
                    help="sizes of the requests table (the caches fill in the first ~100,000)")
    gp.add_argument("--instances", type=int, nargs=3, default=[64, 256, 1024])
    gp.add_argument("--seconds", type=float, default=920.0,
                    help="simulated seconds each row of the instance table replays (the same "
                    "stretch of traffic at every size; 920 s is 100,000 requests on 256P)")
    cp = sub.add_parser("cluster", help="the store cluster under churn (sim_cluster)")
    cp.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 256])
    cp.add_argument("--blocks-per-node", type=int, default=1024)
    cp.add_argument("--seed", type=int, default=1)
    cp.add_argument("--hot-reads", type=float, default=100.0,
                    help="reads per second that make a block hot (its copies grow with its load past it)")
    cp.add_argument("--events", nargs="+", choices=("join", "leave", "crash", "crash-leader"),
                    help="the churn events, one a minute (default: join leave crash crash-leader join leave)")
    hp = sub.add_parser("hits", help="hit ratio vs DRAM per node (sim_cluster, no churn)")
    hp.add_argument("--nodes", type=int, default=16)
    hp.add_argument("--blocks", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    hp.add_argument("--seed", type=int, default=1)
    hp.add_argument("--window", type=float, default=300.0, help="seconds the hit ratio is measured over")
    mp = sub.add_parser("map", help="slot map size as nodes join one by one")
    mp.add_argument("--nodes", type=int, nargs="+", default=[256])
    mp.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    commands = {"replay": cmd_replay, "growth": cmd_growth, "cluster": cmd_cluster, "hits": cmd_hits,
                "map": cmd_map}
    commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
