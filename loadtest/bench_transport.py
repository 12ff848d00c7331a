"""CPU seconds per GB of remote block reads and writes over RESP, beside a raw socket, memcpy
and the control commands an RDMA transport would keep.

    python -m loadtest.bench_transport [--quick] [--repeats N] [--mib N] [--markdown]

What a remote block read or write costs the two machines' CPUs decides how
many cores a node needs to keep a 100-400 Gbit/s NIC busy over RESP, and so
what an RDMA transport (docs/transport.md) would save. Nodes and client run
on loopback, as between two hosts but without a NIC. For blocks of 1 MiB
and 4 MiB it reads (into a caller's buffer) and writes (overwriting a
working set of 256 MiB) one block per round trip, and counts the client's
CPU (this process: `time.process_time`) and the server's (its threads'
`/proc/<pid>/task/*/schedstat`, in ns) per GB moved, over four paths:

- RESP: `RespTransport` (client/block_transport.py) over a `KVClient` with
  the fast path off, so every byte crosses the socket (GET, KV.PUT);
- socket, the reference: the same bytes over a raw loopback socket between
  this process and a child (a 9-byte request, the block, a 1-byte reply for
  a write; `recv_into` a reused buffer, `sendall` from one): the floor of
  any socket transport in Python, kernel copies and wake-ups only;
- memcpy: one copy of each block from the working set into a reused buffer;
- control: the RESP commands the RDMA design keeps per block, without the
  bytes (`ControlPath`), on a second node: what RDMA would still cost.

Each repeat runs RESP, the socket and the control path back to back (taking
turns going first); cells are medians, ratios the median of per-repeat ratios.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import struct
import sys
import time
from typing import Callable

import numpy as np

from client import KVClient
from client.block_transport import RespTransport
from client.connection import Connection
from client.sockets import Endpoint
from loadtest.procs import HOST, ProcessGroup, Server, start_kvstore
from proto.fastpath import KV_ARENA, KV_LEASE, KV_PUBLISH, KV_RELEASE, KV_RESERVE, KV_UNRESERVE, LEASE_TTL_MS
from loadtest.report import Table, log, machine_info, turns

MIB = 1 << 20
SIZES = (MIB, 4 * MIB)
WORKING_SET = 256 * MIB              # distinct blocks read and overwritten: bigger than any cache here
NIC_GBPS = 12.5                      # 100 Gbit/s, for the "cores to fill a NIC" note
RESP, SOCKET, MEMCPY, CONTROL = "RESP", "socket", "memcpy", "control"
REQUEST = struct.Struct("!cQ")       # the raw socket's request: b"R" or b"W", then the block's size


# ------------------------------------------------------------------ CPU clocks

def task_cpu_seconds(pid: int) -> float:
    """CPU time of every live thread of ``pid`` (schedstat: ns, where /proc/pid/stat counts 10 ms ticks)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass                                  # a thread that ended meanwhile
    return total / 1e9


def measure(run: Callable[[], int], server_pid: int | None) -> tuple[float, float, float]:
    """(GB/s, client CPU s per GB, server CPU s per GB) of ``run()``, which returns the bytes it moved."""
    server0 = task_cpu_seconds(server_pid) if server_pid else 0.0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    moved = run()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    server = task_cpu_seconds(server_pid) - server0 if server_pid else 0.0
    gb = moved / 1e9
    return gb / wall, cpu / gb, server / gb


# ------------------------------------------------------------------ the raw socket

def serve_raw(listener: socket.socket, block_size: int) -> None:
    """The raw socket's server (a child process): answers one connection until it closes."""
    block = np.random.default_rng(0).integers(0, 256, block_size, dtype=np.uint8)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = bytearray(REQUEST.size)
    with conn:
        while _recv_exactly(conn, memoryview(head)):
            op, size = REQUEST.unpack(head)
            if op == b"R":
                conn.sendall(memoryview(block)[:size])
            else:
                _recv_exactly(conn, memoryview(block)[:size])
                conn.sendall(b"+")


def _recv_exactly(conn: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``conn``; False when the peer closed before the first byte."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError("peer closed mid-block")
        got += n
    return True


class RawSocket:
    """A child process serving blocks of one size over loopback TCP, and this side's connection."""

    def __init__(self, block_size: int):
        with socket.create_server((HOST, 0)) as listener:
            self.process = multiprocessing.get_context("fork").Process(
                target=serve_raw, args=(listener, block_size), daemon=True)
            self.process.start()
            self.sock = socket.create_connection(listener.getsockname())
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def read(self, into: memoryview) -> None:
        self.sock.sendall(REQUEST.pack(b"R", len(into)))
        _recv_exactly(self.sock, into)

    def write(self, block: memoryview) -> None:
        """Request and block in one sendmsg, as the SDK sends a put; the rest when it took part."""
        head = REQUEST.pack(b"W", len(block))
        sent = self.sock.sendmsg([head, block])
        if sent < len(head):
            self.sock.sendall(head[sent:])
            sent = len(head)
        self.sock.sendall(block[sent - len(head):])
        self.sock.recv(1)

    def close(self) -> None:
        self.sock.close()
        self.process.join(5)


# ------------------------------------------------------------------ RDMA's share: the control commands

class ControlPath:
    """The RESP commands the RDMA design (docs/transport.md) keeps per block, sent without the bytes.

    A read is KV.LEASE (the extent's offset, for a one-sided read) with the
    previous block's KV.RELEASE riding in the same round trip; a write is
    KV.PUBLISH ... NEXT, which commits the extent the block was written into
    and reserves the next one. What these cost both CPUs per GB is what an
    RDMA transport would still spend: the bytes would be the NICs' work. The
    node's arena token comes from KV.ARENA, which also starts the node's
    shared index, so this path gets a node of its own.
    """

    def __init__(self, host: str, port: int):
        self.conn = Connection(Endpoint(host, port), 60)
        self.token = self.conn.round_trip([(KV_ARENA,)])[0][4]

    def reads(self, keys: list[str], count: int) -> None:
        held: list[tuple] = []
        for i in range(count):
            replies = self.conn.round_trip([*held, (KV_LEASE, self.token, LEASE_TTL_MS, keys[i % len(keys)])])
            held = [(KV_RELEASE, replies[-1][0][0])]
        self.conn.round_trip(held)

    def writes(self, keys: list[str], size: int, count: int) -> None:
        spare = self.conn.round_trip([(KV_RESERVE, self.token, LEASE_TTL_MS, size)])[0][0][0]
        for i in range(count):
            stored, following = self.conn.round_trip([(KV_PUBLISH, spare, keys[i % len(keys)], "NEXT",
                                                       LEASE_TTL_MS)])[0]
            spare = following[0]
        self.conn.round_trip([(KV_UNRESERVE, spare)])

    def close(self) -> None:
        self.conn.close()


# ------------------------------------------------------------------ one sample per path

def keys_of(size: int, count: int) -> list[str]:
    return [f"bench:transport:{size}:{i}" for i in range(count)]


def blocks_of(size: int) -> np.ndarray:
    """The working set: WORKING_SET bytes of random blocks of ``size``, one per row."""
    return np.random.default_rng(size).integers(0, 256, (WORKING_SET // size, size), dtype=np.uint8)


def resp_sample(blocks: RespTransport, op: str, rows: np.ndarray, count: int, node_pid: int):
    keys, into = keys_of(rows.shape[1], len(rows)), np.empty(rows.shape[1], dtype=np.uint8)

    def run() -> int:
        for i in range(count):
            if op == "read":
                blocks.read_into(keys[i % len(keys)], into)
            else:
                blocks.write(keys[i % len(keys)], rows[i % len(rows)], overwrite=True)
        return count * rows.shape[1]
    return measure(run, node_pid)


def socket_sample(raw: RawSocket, op: str, rows: np.ndarray, count: int):
    into = memoryview(np.empty(rows.shape[1], dtype=np.uint8))

    def run() -> int:
        for i in range(count):
            if op == "read":
                raw.read(into)
            else:
                raw.write(memoryview(rows[i % len(rows)]))
        return count * rows.shape[1]
    return measure(run, raw.process.pid)


def control_sample(control: ControlPath, op: str, rows: np.ndarray, count: int, node_pid: int):
    size, keys = rows.shape[1], keys_of(rows.shape[1], len(rows))

    def run() -> int:
        if op == "read":
            control.reads(keys, count)
        else:
            control.writes(keys, size, count)
        return count * size
    return measure(run, node_pid)


def memcpy_sample(rows: np.ndarray, count: int) -> tuple[float, float, float]:
    into = np.empty(rows.shape[1], dtype=np.uint8)

    def run() -> int:
        for i in range(count):
            np.copyto(into, rows[i % len(rows)])
        return count * rows.shape[1]
    return measure(run, None)


# ------------------------------------------------------------------ the table

def add_sample(table: Table, case: str, column: str, sample: tuple[float, float, float]) -> None:
    gbps, client, server = sample
    table.row(f"{case}: throughput", "GB/s").add(column, gbps)
    table.row(f"{case}: client CPU", "s/GB").add(column, client)
    if column != MEMCPY:
        table.row(f"{case}: node CPU", "s/GB").add(column, server)
    table.row(f"{case}: both sides", "s/GB").add(column, client + server)


def run_case(table: Table, nodes: tuple[Server, Server], op: str, size: int, repeats: int, moved: int) -> None:
    """One operation and block size: RESP, the raw socket and the control path in turns, then memcpy."""
    case, rows, count = f"{op} {size // MIB} MiB", blocks_of(size), max(moved // size, 1)
    node, control_node = nodes
    for target in nodes:                                        # the blocks a read finds on each node
        with KVClient(target.host, target.port, fast_path="off", timeout=60) as setup:
            setup.batch_put(zip(keys_of(size, len(rows)), rows), overwrite=True)
    raw, control = RawSocket(size), ControlPath(control_node.host, control_node.port)
    with RespTransport(KVClient(node.host, node.port, fast_path="off", timeout=60)) as blocks:
        paths = {RESP: lambda: resp_sample(blocks, op, rows, count, node.process.pid),
                 SOCKET: lambda: socket_sample(raw, op, rows, count),
                 CONTROL: lambda: control_sample(control, op, rows, count, control_node.process.pid)}
        for path in paths.values():
            path()                                              # warm: connections, pages, caches
        for column, path in turns(paths, repeats):
            add_sample(table, case, column, path())
    raw.close()
    control.close()
    for _ in range(repeats):
        add_sample(table, case, MEMCPY, memcpy_sample(rows, count))
    log(f"  {case}: done")


def cores_note(table: Table) -> list[str]:
    """Per case, the cores both sides would spend to fill a 100 Gbit/s NIC over each path."""
    notes = []
    for name, row in table.rows.items():
        if name.endswith("both sides") and all(row.median(c) is not None for c in (RESP, SOCKET, CONTROL)):
            notes.append(f"{name.removesuffix(': both sides')}: to move {NIC_GBPS:g} GB/s (a 100 Gbit/s NIC) "
                         f"client and node together spend {row.median(RESP) * NIC_GBPS:.1f} cores over RESP, "
                         f"{row.median(SOCKET) * NIC_GBPS:.1f} over a raw socket, "
                         f"{row.median(CONTROL) * NIC_GBPS:.2f} on RDMA's control commands")
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 repeats of 64 MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mib", type=int, default=512, help="MiB moved per sample")
    parser.add_argument("--markdown", action="store_true")
    opts = parser.parse_args(argv)
    repeats, moved = (2, 64 * MIB) if opts.quick else (opts.repeats, opts.mib * MIB)
    table = Table("Remote block reads and writes, CPU per GB: RESP vs a raw loopback socket "
                  "(one stream, one block a round trip)", subject=RESP, reference=SOCKET, extras=(MEMCPY, CONTROL))
    with ProcessGroup() as group:
        nodes = (start_kvstore(group, "1gb"), start_kvstore(group, "1gb", name="kvstore-control"))
        for op in ("read", "write"):
            for size in SIZES:
                run_case(table, nodes, op, size, repeats, moved)
    table.notes += cores_note(table)
    machine = machine_info()
    print(table.render_markdown(machine) if opts.markdown else table.render_text(machine))
    return 0


if __name__ == "__main__":
    log("bench_transport: two nodes (RESP, RDMA's control commands) and a raw socket on loopback")
    sys.exit(main())
