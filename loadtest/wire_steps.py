"""Where a node's CPU goes in one redis-py-style SET or GET: the daemon's code path, step by step.

    python -m loadtest.wire_steps [--size BYTES] [--ops N] [--rounds R]

A `Connection` of a real `Server` sits on one end of a loopback TCP pair and
this process plays the client on the other, writing each SET as redis-py does
(the header, the value, the CRLF) before the node's turn. The loop's events
are delivered by hand, so what is timed is the node's own work for a request:
its receive calls, parsing, running the command, the reply's send. Each step
is measured in CPU time of this thread (`time.thread_time_ns`, which a busy
host disturbs far less than wall time) and printed as the minimum and the
median over the rounds, per operation, in µs; `turn` is a whole readable
event, `turns` how many one operation took. The event loop's wait for the
socket and the wakeups around it are not here (see docs/benchmarks.md for the
daemon's CPU per operation, which includes them). Timing a step costs about
0.3 µs per wrapper, so the steps' sum is above a turn measured without them
(printed on the line `untimed turn`).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

from kvstore.admin.config import Config
from kvstore.net.connection import Connection
from kvstore.net.server import Server

SYSCALLS = ("recv_into", "recvmsg_into", "send", "sendmsg")


class HandDrivenLoop:
    """The loop calls a connection makes; its events are delivered by `WireSteps` instead."""

    def add_reader(self, *args) -> None: ...
    def remove_reader(self, *args) -> None: ...
    def add_writer(self, *args) -> None: ...
    def remove_writer(self, *args) -> None: ...
    def call_soon(self, *args) -> None: ...
    def call_later(self, *args) -> None: ...


class TimedSocket:
    """The node's socket, its receive and send calls timed as steps."""

    def __init__(self, sock: socket.socket, timed: Callable):
        self._sock = sock
        for name in SYSCALLS:
            setattr(self, name, timed(f"kernel {name}", getattr(sock, name)))

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


class WireSteps:
    """One node connection driven by hand, with per-step CPU totals."""

    def __init__(self, steps: bool):
        self.totals: dict[str, int] = defaultdict(int)
        self.server = Server(Config(dram_size=256 << 20, port=0))
        self.server.loop = HandDrivenLoop()
        with socket.create_server(("127.0.0.1", 0)) as listener:
            self.client = socket.create_connection(listener.getsockname())
            node_sock, _ = listener.accept()
        for sock in (self.client, node_sock):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        node_sock.setblocking(False)
        self.conn = Connection(self.server, node_sock, 1)
        if steps:
            self._time_steps()

    def timed(self, name: str, fn: Callable) -> Callable:
        totals, clock = self.totals, time.thread_time_ns

        def step(*args, **kwargs):
            started = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += clock() - started
        return step

    def _time_steps(self) -> None:
        conn, reader, engine = self.conn, self.conn.reader, self.server.engine
        conn.sock = TimedSocket(conn.sock, self.timed)
        reader.parse = self.timed("parse", reader.parse)
        engine.reserve = self.timed("reserve an extent", engine.reserve)
        conn._run_backlog = self.timed("run", conn._run_backlog)
        engine.commit = self.timed("run: commit", engine.commit)
        engine.put = self.timed("run: put", engine.put)
        conn.write_value = self.timed("run: write_value", conn.write_value)
        conn.flush = self.timed("reply: flush", conn.flush)

    def turn(self) -> None:
        started = time.thread_time_ns()
        self.conn.on_readable()
        self.totals["turn"] += time.thread_time_ns() - started
        self.totals["turns"] += 1

    def exchange(self, request: list[bytes], reply_size: int) -> None:
        """Write the request's parts, then deliver readable events until the reply is back."""
        for part in request:
            self.client.sendall(part)
        got = 0
        self.client.setblocking(False)
        try:
            while got < reply_size:
                self.turn()
                try:
                    got += len(self.client.recv(reply_size + 64))
                except BlockingIOError:
                    pass
        finally:
            self.client.setblocking(True)


def set_request(key: bytes, value: bytes) -> list[bytes]:
    """SET as redis-py writes it: the value on its own between the header and the CRLF."""
    return [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(value)), value, b"\r\n"]


def get_request(key: bytes) -> list[bytes]:
    return [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key)]


def measure(size: int, ops: int, rounds: int, steps: bool) -> dict[str, dict[str, list[float]]]:
    """{operation: {step: per-operation µs of each round}} for SET and GET of ``size`` bytes."""
    wire = WireSteps(steps)
    value, key = os.urandom(size), b"bench:wire"
    requests = {"SET": (set_request(key, value), len(b"+OK\r\n")),
                "GET": (get_request(key), size + len(b"$%d\r\n\r\n" % size))}
    results: dict[str, dict[str, list[float]]] = {}
    for name, (request, reply_size) in requests.items():
        samples: dict[str, list[float]] = defaultdict(list)
        for _ in range(rounds):
            for _ in range(max(ops // 10, 1)):
                wire.exchange(request, reply_size)      # untimed: first touches, caches
            wire.totals.clear()
            for _ in range(ops):
                wire.exchange(request, reply_size)
            for step, total in wire.totals.items():
                samples[step].append(total / ops / (1 if step == "turns" else 1000))
        results[name] = samples
    wire.client.close()
    wire.conn.close()
    wire.server.engine.close()
    return results


def print_table(size: int, timed: dict, untimed: dict) -> None:
    print(f"node CPU per operation, {size}-byte values, µs (min / median over rounds)")
    for name, samples in timed.items():
        print(f"\n{name}")
        for step in sorted(samples, key=lambda s: (s != "turns", s != "turn", s)):
            values = samples[step]
            print(f"  {step:28s} {min(values):8.2f} / {statistics.median(values):8.2f}")
        values = untimed[name]["turn"]
        print(f"  {'untimed turn(s)':28s} {min(values):8.2f} / {statistics.median(values):8.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.wire_steps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=64 * 1024, help="value size in bytes (default 65536)")
    parser.add_argument("--ops", type=int, default=500, help="operations per round (default 500)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds; min and median are printed (default 9)")
    args = parser.parse_args(argv)
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    untimed = measure(args.size, args.ops, args.rounds, steps=False)
    timed = measure(args.size, args.ops, args.rounds, steps=True)
    print_table(args.size, timed, untimed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
