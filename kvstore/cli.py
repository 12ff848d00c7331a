"""The `kvstore` command line: the one door to the node, the conductor and the replay.

`serve` runs a store node with Redis-style flags (or a TOML file with the same
keys). The conductor's subcommands import their package only when used, so the
store never depends on the conductor.
"""
from __future__ import annotations

import argparse
import logging
import sys

from kvstore import __version__
from kvstore.admin.config import (EVICTION_POLICIES, LOG_LEVELS, SSD_COMPRESSIONS, SSD_WRITE_POLICIES, Config,
                                  ConfigError, parse_size)
from proto.wire import DEFAULT_HOST, DEFAULT_PORT


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="run a store node",
                       description="Run a kvstore node speaking RESP on TCP (and a Unix socket).")
    p.add_argument("--config", metavar="FILE", help="TOML file with the same keys as these flags "
                   "(dram-size = \"4gb\"); flags given on the command line win")
    p.add_argument("--bind", metavar="ADDR", help=f"addresses to listen on, space separated (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, metavar="N", help=f"TCP port, 0 for none chosen by the OS (default {DEFAULT_PORT})")
    p.add_argument("--unixsocket", metavar="PATH", help="also listen on this Unix socket")
    p.add_argument("--dram-size", type=_size, metavar="SIZE",
                   help="bytes of the shared-memory DRAM arena that holds values, e.g. 256mb, 4gb (default 1gb)")
    p.add_argument("--maxmemory-policy", choices=EVICTION_POLICIES,
                   help="what to do when the arena is full (default allkeys-lru)")
    p.add_argument("--evict-companions", metavar="'SUFFIX SUFFIX ...'",
                   help="pairs of key suffixes evicted together: when eviction takes <stem><one>, <stem><other> "
                   "goes too (default 'kv_bytes metadata', LMCache's two keys a chunk; '' for none)")
    p.add_argument("--requirepass", metavar="PASS", help="password clients must AUTH with")
    p.add_argument("--proto-max-bulk-len", type=_size, metavar="SIZE",
                   help="largest bulk string a client may send (default 512mb)")
    p.add_argument("--maxclients", type=int, metavar="N", help="most clients connected at once (default 10000)")
    p.add_argument("--loglevel", choices=tuple(LOG_LEVELS),
                   help="log verbosity (default notice)")
    tiers = p.add_argument_group("tiers")
    tiers.add_argument("--ssd-dir", metavar="DIR", help="enable the SSD tier: RocksDB in this directory "
                       "(values survive restarts)")
    tiers.add_argument("--ssd-size", type=_size, metavar="SIZE", help="capacity of the SSD tier (default 64gb)")
    tiers.add_argument("--ssd-write-policy", choices=SSD_WRITE_POLICIES,
                       help="write-back: values reach SSD when demoted; write-through: every put also "
                       "lands on SSD, asynchronously (default write-back)")
    tiers.add_argument("--ssd-compression", choices=SSD_COMPRESSIONS,
                       help="lz4 per value, kept only when it saves space (default auto)")
    tiers.add_argument("--gpu-size", type=_size, metavar="SIZE", help="enable the GPU tier with a device "
                       "arena of this size (an error without a usable GPU; default: no GPU tier)")
    tiers.add_argument("--gpu-device", type=int, metavar="N", help="CUDA device of the GPU tier (default 0)")
    tiers.add_argument("--high-watermark", type=float, metavar="F", help="fill of a tier above which its "
                       "coldest values move down (default 0.90)")
    tiers.add_argument("--low-watermark", type=float, metavar="F", help="fill a tier is brought back to "
                       "(default 0.85)")
    tiers.add_argument("--promote-hits", type=int, metavar="N", help="hits within the window that make a "
                       "value in a lower tier move up (default 2)")
    tiers.add_argument("--promote-window-ms", type=int, metavar="MS", help="the heat window (default 10000)")
    cluster = p.add_argument_group("cluster")
    cluster.add_argument("--cluster", metavar="URL", help="join the cluster etcd://HOST:PORT/NAME "
                         "(membership and the slot map live in that etcd)")
    cluster.add_argument("--announce", metavar="HOST:PORT", help="address other nodes and clients reach "
                         "this node at (default: the first bound address and the port)")
    cluster.add_argument("--cluster-node-timeout", type=float, metavar="S",
                         help="seconds without a keep-alive before a node counts as gone (default 5)")
    cluster.add_argument("--cluster-move-budget", type=float, metavar="S",
                         help="seconds a clean join or leave spends moving the moving slots' values, hottest "
                         "first; the rest are dropped (default 5; 0: none move); at least 1.5 x DRAM / NIC")
    cluster.add_argument("--cluster-nic-gbps", type=float, metavar="GBPS",
                         help="this node's NIC in Gbit/s, what a clean move's budget is derived from (default 100)")
    cluster.add_argument("--hot-reads", type=float, metavar="N",
                         help="reads per second above which a block is copied to other nodes (default 100; "
                         "0: never)")
    cluster.add_argument("--hot-replicas", type=int, metavar="K", help="nodes a hot block is copied to "
                         "at least, more as its load needs (default 2)")
    p.add_argument("--metrics-port", type=int, metavar="N", help="serve Prometheus /metrics on this port "
                   "(default: off)")
    security = p.add_argument_group("security (docs/security.md)")
    security.add_argument("--aclfile", metavar="FILE", help="ACL users, one 'user NAME rules...' line each; "
                          "ACL LOAD and ACL SAVE read and write it")
    security.add_argument("--protected-mode", choices=("yes", "no"), help="refuse clients from other hosts "
                          "while the default user has no password (default yes)")
    security.add_argument("--tls-port", type=int, metavar="N", help="also accept TLS clients on this port")
    security.add_argument("--tls-cert-file", metavar="FILE", help="the node's certificate (PEM)")
    security.add_argument("--tls-key-file", metavar="FILE", help="the certificate's private key (PEM)")
    security.add_argument("--tls-ca-cert-file", metavar="FILE", help="CA that signs client (and node) "
                          "certificates")
    security.add_argument("--tls-auth-clients", choices=("yes", "no", "optional"),
                          help="require a client certificate, verify one if offered, or ask for none "
                          "(default yes)")
    security.add_argument("--tls-cluster", choices=("yes", "no"),
                          help="announce the TLS port to the cluster; nodes talk to each other over TLS "
                          "with this node's certificate (default no)")
    security.add_argument("--client-output-buffer-limit", metavar="LIMITS", help="'normal HARD SOFT SECONDS': "
                          "close a client whose unread replies pass HARD, or SOFT for SECONDS (default "
                          "'normal 0 0 0': no limit)")
    security.add_argument("--client-query-buffer-limit", type=_size, metavar="SIZE",
                          help="close a client whose request in progress holds more (default 1gb)")
    return p


def build_config(args: argparse.Namespace) -> Config:
    cfg = Config.from_toml(args.config) if args.config else Config()
    for name in vars(args):
        value = getattr(args, name)
        if name in ("command", "config"):
            continue
        if value is not None:
            cfg.set(name, value)
    cfg.validate()
    return cfg


def setup_logging(level: str) -> None:
    logging.basicConfig(level=LOG_LEVELS[level], stream=sys.stderr,
                        format="%(process)d:M %(asctime)s.%(msecs)03d * %(message)s",
                        datefmt="%d %b %Y %H:%M:%S")


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        cfg = build_config(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.loglevel)
    from kvstore.net.server import run
    return run(cfg, args.config)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Subcommands owned by other packages parse their own flags.
    if argv and argv[0] == "replay":
        from conductor.cli import replay_main
        return replay_main(argv[1:])
    if argv and argv[0] == "conductor":
        from conductor.cli import conductor_main
        return conductor_main(argv[1:])
    if argv and argv[0] == "tracegen":
        from conductor.cli import tracegen_main
        return tracegen_main(argv[1:])
    if argv and argv[0] == "cluster":
        from kvstore.cluster.subcommand import cluster_main
        return cluster_main(argv[1:])
    if argv and argv[0] in ("worker", "gateway", "llm"):
        from workers import cli as workers_cli
        return getattr(workers_cli, f"{argv[0]}_main")(argv[1:])
    parser = argparse.ArgumentParser(prog="kvstore", description="A KV-cache store for LLM serving "
                                     "that speaks the Redis protocol.")
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = serve_parser(sub)
    # `kvstore --help` documents the node's flags too, not only the subcommand names.
    parser.epilog = serve.format_help()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub.add_parser("replay", help="replay a Mooncake trace through the conductor's simulator "
                   "(kvstore replay --help)", add_help=False)
    sub.add_parser("conductor", help="run the cache-aware conductor service (kvstore conductor --help)",
                   add_help=False)
    sub.add_parser("tracegen", help="generate a Mooncake-format trace (kvstore tracegen --help)",
                   add_help=False)
    sub.add_parser("cluster", help="start a local cluster or show one's slots (kvstore cluster --help)",
                   add_help=False)
    sub.add_parser("worker", help="run a prefill or decode worker (kvstore worker --help)", add_help=False)
    sub.add_parser("gateway", help="serve OpenAI /v1/completions (kvstore gateway --help)", add_help=False)
    sub.add_parser("llm", help="start store, conductor, workers and gateway (kvstore llm up --help)",
                   add_help=False)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
