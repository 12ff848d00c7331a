"""GET throughput over TLS as a ratio to plain TCP, on the same node in the same run.

    python -m loadtest.bench_tls [--quick] [--repeats N] [--size BYTES] [--markdown]

One `kvstore serve` listens on a plain port and a --tls-port (a throwaway CA
from loadtest/certs.py, client certificates required). Each repeat times a
loop of GETs of one value (1 MiB by default) on both ports, taking turns
going first, with two clients: redis-py (ssl=True) and the SDK (KVClient
with tls=, fast path off so every byte crosses the socket). The table gives
GB/s on each port and the ratio TLS/plain, the median of the per-repeat
ratios. TLS costs an AES-GCM pass over every byte on each side plus a copy
into records of 16 KiB, so the ratio says how much of the plain path's
throughput those leave.
"""
from __future__ import annotations

import argparse
import ssl
import sys
import tempfile
import time
from pathlib import Path

import redis

from client import KVClient
from loadtest.certs import Certificates, make_certificates
from loadtest.procs import DEFAULT_KVSTORE_CMD, HOST, ProcessGroup, free_port, start_kvstore
from loadtest.report import Table, log, machine_info, record, turns

MIB = 1 << 20
PLAIN, TLS = "plain", "tls"
ERRORS = (OSError, redis.RedisError, RuntimeError)


def redis_py(port: int, certs: Certificates | None) -> redis.Redis:
    if certs is None:
        return redis.Redis(host=HOST, port=port)
    return redis.Redis(host=HOST, port=port, ssl=True, ssl_ca_certs=certs.ca, ssl_certfile=certs.client_cert,
                       ssl_keyfile=certs.client_key)


def sdk(port: int, certs: Certificates | None) -> KVClient:
    tls = None
    if certs is not None:
        tls = ssl.create_default_context(cafile=certs.ca)
        tls.load_cert_chain(certs.client_cert, certs.client_key)
    return KVClient(HOST, port, tls=tls, fast_path="off", timeout=30)


def get_throughput(client, key: bytes, size: int, seconds: float) -> float:
    """GB/s of GETs of one ``size``-byte value for about ``seconds`` (after two untimed ones)."""
    for _ in range(2):
        assert len(client.get(key)) == size
    count, start = 0, time.perf_counter()
    while True:
        client.get(key)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and count >= 3:
            return count * size / elapsed / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 repeats of 0.3 s")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    parser.add_argument("--size", type=int, default=MIB)
    parser.add_argument("--markdown", action="store_true")
    opts = parser.parse_args(argv)
    repeats, seconds = (2, 0.3) if opts.quick else (opts.repeats, opts.seconds)
    table = Table(f"GET {opts.size // 1024} KiB over TLS and plain TCP, one client, same node",
                  subject=TLS, reference=PLAIN)
    with tempfile.TemporaryDirectory(prefix="bench-tls-") as folder, ProcessGroup() as group:
        certs = make_certificates(Path(folder) / "certs")
        tls_port = free_port()
        node = start_kvstore(group, "256mb", DEFAULT_KVSTORE_CMD + f" --tls-port {tls_port} "
                             + " ".join(certs.server_flags("yes")))
        ports = {PLAIN: (node.port, None), TLS: (tls_port, certs)}
        value = bytes(range(256)) * (opts.size // 256) + b"x" * (opts.size % 256)
        with redis_py(node.port, None) as setup:
            setup.set(b"bench:tls", value)
        for name, make in (("redis-py", redis_py), ("SDK", sdk)):
            row = table.row(f"{name} GET", "GB/s")
            for column, (port, port_certs) in turns(ports, repeats):
                def measure(port=port, port_certs=port_certs):
                    with make(port, port_certs) as client:
                        return [get_throughput(client, b"bench:tls", opts.size, seconds)]
                record([row], column, measure, ERRORS)
    machine = machine_info()
    print(table.render_markdown(machine) if opts.markdown else table.render_text(machine))
    return 0 if all(row.samples.get(TLS) and row.samples.get(PLAIN) for row in table.rows.values()) else 1


if __name__ == "__main__":
    log("bench_tls: one node, plain and TLS ports")
    sys.exit(main())
