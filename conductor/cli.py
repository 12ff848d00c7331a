"""`kvstore replay`, `kvstore conductor` and `kvstore tracegen`: the conductor's command lines.

The `kvstore` dispatcher calls `replay_main(argv)`, `conductor_main(argv)` and
`tracegen_main(argv)` with the arguments after the subcommand. User errors (bad flags, a bad trace,
an unreachable store) print one `error: ...` line on stderr and return 2;
nothing a user can cause prints a traceback.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from conductor.admission import MODES, Admission, Slo
from conductor.costmodel import CalibrationError, CostModel, fit_cost_model, read_timings
from conductor.live import DEFAULT_REPORT_TIMEOUT_S
from conductor.policy import POLICIES
from conductor.simulator import SimConfig, replay, stderr_progress
from conductor.trace import TraceError, load_trace
from proto.wire import DEFAULT_HOST, DEFAULT_PORT

DEFAULT_CONDUCTOR_PORT = 50051


class UsageError(Exception):
    """A user error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise UsageError(message)


def _positive(kind: type, flag: str, zero: bool = False):
    """A parser of numbers above 0 (or at least 0, with ``zero``)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got '{text}'") from None
        if not (value > 0 or (zero and value == 0)):     # NaN is neither
            need = "at least 0" if zero else "positive"
            raise argparse.ArgumentTypeError(f"{flag} must be {need}, got {text}")
        return value
    return parse


def _slo_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", choices=list(POLICIES), default="kvcache-centric")
    p.add_argument("--rejection", choices=MODES, default="none",
                   help="admission mode (default none); audited follows whichever of "
                   "baseline, early and predictive its shadow replays show serving the most")
    p.add_argument("--ttft-slo", type=_positive(float, "--ttft-slo"), default=30.0,
                   help="TTFT SLO in seconds (default 30)")
    p.add_argument("--tbt-slo", type=_positive(float, "--tbt-slo"), default=0.1,
                   help="TBT SLO in seconds (default 0.1)")
    p.add_argument("--cache-tokens-per-node", type=_positive(int, "--cache-tokens-per-node"),
                   default=3_000_000, help="prefix cache per prefill node (default 3M tokens)")
    p.add_argument("--balancing-threshold", type=_positive(float, "--balancing-threshold"),
                   default=1.0, help="fetch a remote prefix when it is this many times "
                   "longer than the local one (kvcache-centric; default 1.0)")
    p.add_argument("--calibrate", metavar="TIMINGS",
                   help="fit the cost model to measured timings (JSON or CSV) first")


def _cost_model(path: str | None) -> CostModel:
    return fit_cost_model(read_timings(path)) if path else CostModel.from_testbed()


def replay_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvstore replay",
                description="Replay a Mooncake-format trace in the cluster simulator.")
    p.add_argument("trace", help="JSONL trace: timestamp (ms), input_length, output_length, "
                   "hash_ids")
    p.add_argument("--prefill", type=_positive(int, "--prefill"), default=8,
                   help="prefill instances (default 8)")
    p.add_argument("--decode", type=_positive(int, "--decode"), default=8,
                   help="decode instances (default 8)")
    p.add_argument("--speed", type=_positive(float, "--speed"), default=1.0,
                   help="replay speed: timestamps are divided by this (default 1)")
    _slo_flags(p)
    p.add_argument("--decode-wait", type=_positive(float, "--decode-wait", zero=True),
                   default=0.0, metavar="S", help="seconds a KV that finds its decode "
                   "instance full may wait for a slot, within the TTFT SLO (default 0: "
                   "refused at once, as in the paper)")
    p.add_argument("--compare", action="store_true", help="run all four policies")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="PNG", help="write TTFT CDF and load-over-time plots")
    p.add_argument("--seed", type=int, default=0)
    return p


def _run_replay(args: argparse.Namespace) -> int:
    cost = _cost_model(args.calibrate)
    trace = load_trace(args.trace)
    policies = list(POLICIES) if args.compare else [args.policy]
    runs = []
    for policy in policies:
        config = SimConfig(prefill=args.prefill, decode=args.decode, policy=policy,
                           admission=args.rejection, speed=args.speed,
                           slo=Slo(args.ttft_slo, args.tbt_slo),
                           cache_tokens_per_node=args.cache_tokens_per_node,
                           balancing_threshold=args.balancing_threshold, seed=args.seed,
                           decode_wait_s=args.decode_wait)
        runs.append(replay(trace, config, cost, stderr_progress(policy)))
    summaries = [s for s, _ in runs]
    if args.json:
        docs = [s.as_dict() for s in summaries]
        if args.calibrate:
            for d in docs:
                d["cost_model"] = cost.as_dict()
        print(json.dumps(docs if args.compare else docs[0]))
    else:
        from conductor.report import format_table
        print(format_table(summaries))
        if args.calibrate:
            print("cost model: " + json.dumps(cost.as_dict()))
    if args.plot:
        from conductor.plot import plot_runs
        plot_runs(runs, args.plot, title=f"{args.trace} at {args.speed:g}x")
    return 0


def replay_main(argv: list[str]) -> int:
    """`kvstore replay TRACE [flags]`; returns the exit status."""
    try:
        args = replay_parser().parse_args(argv)
        return _run_replay(args)
    except (UsageError, TraceError, CalibrationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def conductor_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvstore conductor",
                description="Serve scheduling decisions over gRPC against a live store.")
    p.add_argument("--host", default=DEFAULT_HOST, help="address to listen on")
    p.add_argument("--port", type=int, default=DEFAULT_CONDUCTOR_PORT,
                   help=f"gRPC port (default {DEFAULT_CONDUCTOR_PORT}; 0 picks a free one)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--store", default=f"{DEFAULT_HOST}:{DEFAULT_PORT}", metavar="HOST:PORT",
                       help="the store node answering KV.MATCH and KV.LOCATE")
    where.add_argument("--cluster", metavar="etcd://HOST:PORT/NAME",
                       help="a store cluster instead: its nodes are read from this etcd")
    p.add_argument("--report-timeout", type=_positive(float, "--report-timeout"),
                   default=DEFAULT_REPORT_TIMEOUT_S, help="seconds without a load report after which an "
                   f"instance gets no requests until it reports again (default {DEFAULT_REPORT_TIMEOUT_S:g})")
    p.add_argument("--password", help="the store's password (AUTH)")
    p.add_argument("--model", default="default",
                   help="namespace that token ids are hashed under (must match the workers')")
    p.add_argument("--block-tokens", type=_positive(int, "--block-tokens"), default=512)
    _slo_flags(p)
    return p


def _store_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--store must be HOST:PORT, got '{text}'")
    return host, int(port)


def _run_conductor(args: argparse.Namespace) -> int:
    from client import BlockHasher
    from conductor.live import LiveConductor
    from conductor.policy import make_policy
    from conductor.service import serve
    from conductor.stores import StoreError, open_store

    try:
        store = open_store(None if args.cluster else _store_address(args.store), args.cluster,
                           password=args.password)
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    cost = _cost_model(args.calibrate)
    live = LiveConductor(make_policy(args.policy, cost, 0, args.balancing_threshold),
                         Admission(args.rejection, Slo(args.ttft_slo, args.tbt_slo)), cost,
                         store, BlockHasher(args.model, args.block_tokens),
                         args.cache_tokens_per_node, args.report_timeout)
    try:
        server, bound = serve(live, args.host, args.port)
    except (OSError, RuntimeError) as exc:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {exc}") from None
    print(f"conductor listening on {args.host}:{bound} (store {args.cluster or args.store}, "
          f"policy {args.policy}, admission {args.rejection})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=1).wait()
    store.close()
    return 0


def conductor_main(argv: list[str]) -> int:
    """`kvstore conductor --port N --store HOST:PORT [flags]`; returns the exit status."""
    try:
        return _run_conductor(conductor_parser().parse_args(argv))
    except (UsageError, CalibrationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def tracegen_parser() -> argparse.ArgumentParser:
    from conductor.tracegen import PRESETS, SPEC_FIELDS, Lengths

    p = _Parser(prog="kvstore tracegen",
                description="Generate a Mooncake-format trace (JSONL) with a chosen arrival "
                "process, length distributions and prefix sharing. Lengths are "
                "MEDIAN:SIGMA[:WEIGHT],...[@LOW-HIGH]: a mixture of clipped log-normals.")
    p.add_argument("--preset", choices=list(PRESETS),
                   help="start from a named parameter set: conversation (reproduces the public "
                   "conversation trace's statistics) or documents (shared-document QA, about "
                   "65 %% of blocks reusable)")
    p.add_argument("-o", "--output", metavar="FILE", help="write here (default stdout)")
    p.add_argument("--stats", action="store_true",
                   help="print the generated trace's statistics instead of the trace")
    p.add_argument("--compare", metavar="TRACE",
                   help="with --stats: put a trace file's statistics beside them")
    kinds = {"int": int, "float": float, "str": str, "Lengths": Lengths.parse}
    for name, f in SPEC_FIELDS.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=_spec_value(kinds[f.type]),
                       metavar=f.type.upper(), help=f"{f.metadata['help']} (default {f.default})")
    return p


def _spec_value(parse):
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


def _run_tracegen(args: argparse.Namespace) -> int:
    from conductor.tracegen import SPEC_FIELDS, generate, spec_from, write_jsonl

    overrides = {k: getattr(args, k) for k in SPEC_FIELDS if getattr(args, k) is not None}
    try:
        spec = spec_from(args.preset, **overrides)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.stats:
        from conductor.tracestats import comparison_table, measure

        columns = {"generated": measure(list(generate(spec)))}
        if args.compare:
            columns[args.compare] = measure(load_trace(args.compare))
        print(comparison_table(columns))
        return 0
    if args.output is None:
        write_jsonl(generate(spec), sys.stdout)
        return 0
    try:
        with open(args.output, "w", encoding="utf-8") as out:
            write_jsonl(generate(spec), out)
    except OSError as exc:
        raise UsageError(f"cannot write {args.output}: {exc.strerror}") from None
    return 0


def tracegen_main(argv: list[str]) -> int:
    """`kvstore tracegen [--preset NAME] [--FIELD VALUE ...] [-o FILE]`; returns the exit status."""
    try:
        return _run_tracegen(tracegen_parser().parse_args(argv))
    except (UsageError, TraceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def main() -> int:
    """`python -m conductor.cli replay|conductor|tracegen ...` (the `kvstore` command is the
    usual door)."""
    commands = {"replay": replay_main, "conductor": conductor_main, "tracegen": tracegen_main}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print("usage: python -m conductor.cli {replay|conductor|tracegen} ...", file=sys.stderr)
        return 2
    return commands[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
