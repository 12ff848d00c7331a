"""`kvstore llm up`: a store, the conductor, N prefill and M decode workers and the gateway, as one command.

Each part is its own `python -m kvstore ...` process (the same commands a
deployment would run by hand), started in dependency order: the store (one
node; or `kvstore cluster up` with `--cluster-nodes N`; none when `--store`
or `--cluster` names one), the conductor (hashing prompts under the workers' model
namespace and block size, so its `KV.MATCH` sees their blocks), the workers (side by side),
the gateway. Each is ready when it prints its first line; the launcher then
prints one JSON object (gateway URL, store, conductor, workers) and waits. On
SIGINT or SIGTERM, or when the store, the conductor or the gateway exits, it
stops everything it started, newest first.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from workers.flags import DEFAULT_BLOCK_TOKENS, DEFAULT_GATEWAY_PORT, UsageError, address
from workers.catalog import MODELS, SMOLLM2, converted_dir, namespace_of

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 10.0


def llm_parser(parser_class: type[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    from conductor.admission import MODES
    from conductor.policy import POLICIES

    p = parser_class(prog="kvstore llm", description="Start a whole serving deployment on this host.")
    p.add_argument("action", choices=("up",))
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--model", choices=MODELS, default=SMOLLM2)
    p.add_argument("--policy", choices=list(POLICIES), default="kvcache-centric")
    p.add_argument("--rejection", choices=MODES, default="none", help="admission mode (default none)")
    p.add_argument("--ttft-slo", type=float, default=30.0, help="TTFT SLO in seconds (default 30)")
    p.add_argument("--tbt-slo", type=float, default=1.0, help="TBT SLO in seconds (default 1)")
    p.add_argument("--calibrate", metavar="TIMINGS", help="the conductor's cost model fitted to these timings")
    p.add_argument("--report-timeout", type=float, metavar="S", help="seconds without a worker's load report before the "
                   "conductor stops sending it work (default: the conductor's)")
    p.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT, help="gateway HTTP port (0: any free one)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--store", metavar="HOST:PORT", help="use this store instead of starting one")
    where.add_argument("--cluster", metavar="etcd://HOST:PORT/NAME", help="use this store cluster")
    where.add_argument("--cluster-nodes", type=int, metavar="N",
                       help="start a store cluster of N nodes (`kvstore cluster up`) instead of one node")
    p.add_argument("--dram-size", default="1gb", help="the started store's DRAM arena, per node (default 1gb)")
    p.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS)
    p.add_argument("--threads", type=int, help="torch threads per worker (default: cores / workers)")
    return p


@dataclass
class Deployment:
    """The processes started so far, newest last, and what they printed; ``stopping`` cuts a start short."""

    stopping: threading.Event = field(default_factory=threading.Event)
    procs: list[subprocess.Popen] = field(default_factory=list)
    workers: list[dict] = field(default_factory=list)

    def start(self, args: list[str], ready_line: bool = True) -> str:
        """Start ``kvstore ARGS``; return its first stdout line (the ready signal)."""
        proc = self.spawn(args)
        return self.ready(proc) if ready_line else ""

    def spawn(self, args: list[str]) -> subprocess.Popen:
        """Start ``kvstore ARGS`` without waiting for it (several may then start side by side)."""
        proc = subprocess.Popen([sys.executable, "-m", "kvstore", *args], stdout=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True)
        self.procs.append(proc)
        return proc

    def ready(self, proc: subprocess.Popen) -> str:
        """The process's first stdout line, once it has printed it; UsageError if it never does."""
        line = _first_line(proc, self.stopping)
        if self.stopping.is_set():
            raise UsageError("stopped while starting")
        if not line:
            raise UsageError(f"`kvstore {' '.join(proc.args[3:5])}` exited with {proc.poll()} before it was ready")
        return line

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _first_line(proc: subprocess.Popen, stopping: threading.Event) -> str:
    """The process's first stdout line; "" when it exits, stalls START_TIMEOUT_S, or a stop is asked."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while reader.is_alive() and time.monotonic() < deadline and not stopping.is_set():
        reader.join(0.1)
    return box[0].strip() if box else ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_store(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)
    raise UsageError("the store did not start")


@dataclass
class StoreFlags:
    """How the conductor and the workers reach the store: its printed name and their flags."""

    name: str
    flags: list[str]
    worker_flags: list[str] = field(default_factory=list)     # same host only: the node's Unix socket


def _start_store(d: Deployment, args: argparse.Namespace, folder: Path) -> StoreFlags:
    if args.store:
        address(args.store, "--store")
        return StoreFlags(args.store, ["--store", args.store])
    if args.cluster:
        return StoreFlags(args.cluster, ["--cluster", args.cluster])
    if args.cluster_nodes is not None:
        if args.cluster_nodes < 1:
            raise UsageError("--cluster-nodes must be at least 1")
        up = json.loads(d.start(["cluster", "up", "--nodes", str(args.cluster_nodes), "--dram-size",
                                 args.dram_size]))
        return StoreFlags(up["etcd"], ["--cluster", up["etcd"]])
    port, sock = _free_port(), str(folder / "kvstore.sock")
    d.start(["serve", "--port", str(port), "--unixsocket", sock, "--dram-size", args.dram_size], ready_line=False)
    _wait_for_store(port, d.procs[-1])
    return StoreFlags(f"127.0.0.1:{port}", ["--store", f"127.0.0.1:{port}"], ["--store-socket", sock])


def _start_conductor(d: Deployment, args: argparse.Namespace, store: StoreFlags) -> str:
    flags = ["conductor", "--port", "0", *store.flags, "--model", namespace_of(args.model),
             "--block-tokens", str(args.block_tokens), "--policy", args.policy, "--rejection", args.rejection,
             "--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo)]
    if args.report_timeout is not None:
        flags += ["--report-timeout", str(args.report_timeout)]
    if args.calibrate:
        flags += ["--calibrate", args.calibrate]
    line = d.start(flags)
    # "conductor listening on HOST:PORT (...)"
    return line.split(" on ", 1)[1].split()[0]


def _start_workers(d: Deployment, args: argparse.Namespace, store: StoreFlags, conductor: str) -> None:
    threads = args.threads or max(1, (os.cpu_count() or 1) // (args.prefill + args.decode))
    common = [*store.flags, *store.worker_flags, "--conductor", conductor, "--model", args.model,
              "--block-tokens", str(args.block_tokens), "--threads", str(threads)]
    started = [d.spawn(["worker", role, "--id", f"{role}-{i}", *common])
               for role, count in (("prefill", args.prefill), ("decode", args.decode)) for i in range(count)]
    d.workers += [json.loads(d.ready(proc)) for proc in started]      # they load the model side by side


def launch(args: argparse.Namespace) -> int:
    if args.prefill < 1 or args.decode < 1:
        raise UsageError("--prefill and --decode must be at least 1")
    if args.report_timeout is not None and args.report_timeout <= 0:
        raise UsageError(f"--report-timeout must be positive, got {args.report_timeout:g}")
    if args.model == SMOLLM2:
        converted_dir()                  # convert once here, not in every worker at the same time
    d = Deployment()
    stop = d.stopping
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="kvstore-llm-") as folder:
        try:
            store = _start_store(d, args, Path(folder))
            conductor = _start_conductor(d, args, store)
            _start_workers(d, args, store, conductor)
            gateway = json.loads(d.start(["gateway", "--conductor", conductor, "--model", args.model,
                                          "--port", str(args.port)]))["gateway"]
            print(json.dumps({"gateway": gateway, "store": store.name, "conductor": conductor,
                              "workers": d.workers}), flush=True)
            essential = [p for p in d.procs if p.args[3] in ("serve", "cluster", "conductor", "gateway")]
            while not stop.wait(0.5):
                if any(p.poll() is not None for p in essential):
                    print("error: a core process exited; stopping", file=sys.stderr)
                    return 1
            return 0
        finally:
            d.stop()
