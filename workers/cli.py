"""`kvstore worker`, `kvstore gateway` and `kvstore llm`: the serving command lines.

The `kvstore` dispatcher calls `worker_main`, `gateway_main` and `llm_main`
with the arguments after the subcommand. A process that is ready prints one
JSON line on stdout (what it is and where it listens) and runs until SIGINT or
SIGTERM. User errors print one `error: ...` line on stderr and return 2.

torch and transformers take seconds to import here, so a worker checks its
flags and reaches its store first and imports them only then: `--help`, a
flag error or an unreachable store answer at once. The model's names come
from `workers.catalog`, which imports neither.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from workers.catalog import MODELS, SMOLLM2, ModelError
from workers.flags import (DEFAULT_BLOCK_TOKENS, DEFAULT_GATEWAY_PORT, DEFAULT_STORE, CommandLineParser, UsageError,
                           address, positive)
from workers.launcher import launch, llm_parser

def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def worker_parser() -> argparse.ArgumentParser:
    p = CommandLineParser(prog="kvstore worker", description="Run a prefill or decode worker of a LLaMA model.")
    p.add_argument("role", choices=("prefill", "decode"))
    where = p.add_mutually_exclusive_group()
    where.add_argument("--store", metavar="HOST:PORT", help=f"the store node (default {DEFAULT_STORE})")
    where.add_argument("--cluster", metavar="etcd://HOST:PORT/NAME",
                       help="a store cluster: its nodes are read from this etcd, blocks spread over them")
    p.add_argument("--store-socket", metavar="PATH", help="the store's Unix socket (same host: faster)")
    p.add_argument("--password", help="the store's password")
    p.add_argument("--conductor", required=True, metavar="HOST:PORT", help="the conductor to register with")
    p.add_argument("--model", choices=MODELS, default=SMOLLM2)
    p.add_argument("--id", help="instance id (default: ROLE-PID)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="gRPC port (default 0: any free one)")
    p.add_argument("--block-tokens", type=positive, default=DEFAULT_BLOCK_TOKENS,
                   help=f"tokens per KV block (default {DEFAULT_BLOCK_TOKENS}; the conductor's must match)")
    p.add_argument("--threads", type=positive, help="torch CPU threads (default: torch's)")
    p.add_argument("--max-batch", type=positive, default=32, help="decode: sequences in the batch at most")
    return p


def _open_store(args: argparse.Namespace):
    """The store named by --store or --cluster, connected; UsageError when it cannot be reached."""
    from conductor.stores import StoreError, open_store

    if args.cluster and args.store_socket:
        raise UsageError("--store-socket is one node's socket: give it with --store, not --cluster")
    node = None if args.cluster else address(args.store or DEFAULT_STORE, "--store")
    try:
        return open_store(node, args.cluster, unix_socket=args.store_socket, password=args.password)
    except StoreError as exc:
        raise UsageError(str(exc)) from None


def _run_worker(args: argparse.Namespace) -> int:
    address(args.conductor, "--conductor")
    store = _open_store(args)            # flags and the store are checked before torch is imported

    import torch

    from workers.decode import DecodeEngine
    from workers.kvio import make_connector
    from workers.model import load_model
    from workers.prefill import PrefillEngine
    from workers.service import ConductorLink, WorkerService, serve
    from workers.timings import Timings

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    timings = Timings()
    connector = make_connector(store, loaded, args.block_tokens)
    if args.role == "prefill":
        prefill = PrefillEngine(loaded, connector, timings)
        service = WorkerService(timings, prefill=prefill)

        def load() -> tuple[float, int, int]:
            return prefill.queued_seconds(), 0, 0
    else:
        decode = DecodeEngine(loaded, connector, timings, args.max_batch)
        service = WorkerService(timings, decode=decode)

        def load() -> tuple[float, int, int]:
            return (0.0, *decode.load())
    server, bound = serve(service, args.host, args.port)
    instance_id = args.id or f"{args.role}-{os.getpid()}"
    link = ConductorLink(args.conductor, instance_id, args.role, f"{args.host}:{bound}", load)
    try:
        link.start()
    except Exception as exc:
        server.stop(0)
        raise UsageError(f"cannot register with the conductor at {args.conductor}: {exc}") from None
    print(json.dumps({"id": instance_id, "role": args.role, "address": f"{args.host}:{bound}", "pid": os.getpid()}),
          flush=True)
    _wait_for_signal()
    link.stop()
    server.stop(grace=1).wait()
    store.close()
    return 0


def gateway_parser() -> argparse.ArgumentParser:
    p = CommandLineParser(prog="kvstore gateway",
                description="Serve OpenAI's /v1/completions and /v1/chat/completions through the conductor.")
    p.add_argument("--conductor", required=True, metavar="HOST:PORT")
    p.add_argument("--model", choices=MODELS, default=SMOLLM2, help="the model the workers serve")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT,
                   help=f"HTTP port (default {DEFAULT_GATEWAY_PORT}; 0 picks a free one)")
    return p


def _run_gateway(args: argparse.Namespace) -> int:
    from workers.gateway import Router
    from workers.http_app import GatewayServer
    from workers.metrics import GatewayMetrics
    from workers.catalog import load_tokenizer

    address(args.conductor, "--conductor")
    tokenizer, context = load_tokenizer(args.model)
    router = Router(args.conductor, args.model, tokenizer, context, getattr(tokenizer, "eos_token_id", None),
                    GatewayMetrics())
    try:
        server = GatewayServer(router, args.host, args.port)
    except OSError as exc:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {exc}") from None
    server.start()
    print(json.dumps({"gateway": server.url, "model": args.model}), flush=True)
    _wait_for_signal()
    server.stop()
    return 0


def _main(parser: argparse.ArgumentParser, run, argv: list[str]) -> int:
    try:
        return run(parser.parse_args(argv))
    except (UsageError, ModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def worker_main(argv: list[str]) -> int:
    """`kvstore worker prefill|decode --conductor HOST:PORT [flags]`; returns the exit status."""
    return _main(worker_parser(), _run_worker, argv)


def gateway_main(argv: list[str]) -> int:
    """`kvstore gateway --conductor HOST:PORT [--port 8000]`; returns the exit status."""
    return _main(gateway_parser(), _run_gateway, argv)


def llm_main(argv: list[str]) -> int:
    """`kvstore llm up --prefill N --decode M [flags]`; returns the exit status."""
    return _main(llm_parser(CommandLineParser), launch, argv)
