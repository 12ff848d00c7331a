"""The local fast path: gets and puts through the node's shared-memory arena.

A client on the same host as the node maps the node's DRAM arena once
(`attach`: over the Unix socket the arena's memfd arrives with the KV.ARENA
reply; over TCP the client opens /proc/<pid>/fd/<fd>; either way a token the
node wrote into the arena proves the mapping is that node's, so a remote node
is detected and the wire is used). After that the socket carries only small
control messages and the bytes move with one memcpy:

- get: ``KV.LEASE`` pins the values and says where they are; the client copies
  them into the caller's buffers; the leases are released.
- put: ``KV.RESERVE`` hands out extents; the client copies the values in;
  ``KV.PUBLISH`` commits them under their keys (puts smaller than
  `FAST_PUT_MIN` in all go over the wire, where one round trip is cheaper).

Why a get costs one round trip, not two: a lease is only ever ended early by
its deadline or by its owner connection closing. The client notes the time
before it asks for the leases; if its copy is finished before that time plus
the TTL (less a margin) and the connection it holds has not been closed by
the node, no lease can have ended during the copy, so the data is whole and
the release can wait: it rides along with the next request (or is sent at
close, or expires). Otherwise the client releases at once, and the release
reply says whether every lease was still valid; if one was not, the copy may
be torn and the read is retried (`LeaseExpired` after `LEASE_RETRIES`).

The transport wraps a wire transport: calls that are not gets or puts, and
every call when the arena cannot be mapped (``fast_path="auto"``), go over
the wire; ``"required"`` raises `FastPathUnavailable` instead.
"""
from __future__ import annotations

import asyncio
import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from client.connection import Connection
from client.errors import (BufferTooSmall, ConnectionError, FastPathUnavailable, KVError, LeaseExpired,
                           TimeoutError)
from client.operations import Call, LocalRead, LocalWrite
from client.sockets import Endpoint
from proto import fastpath as fp

FAST_PATH_MODES = ("auto", "off", "required")
FAST_PUT_MIN = 256 * 1024        # a put of fewer bytes in all goes over the wire
PROOF_MARGIN_S = 0.002           # clock slack kept when proving a lease outlived the copy
LEASE_RETRIES = 3
MAX_DEFERRED = 1024              # releases held back at most before they are sent anyway
THREAD_COPY_MIN = 1 << 20        # the asyncio transport copies at least this much off the loop


class Arena:
    """This process's mapping of a node's DRAM arena.

    The node faulted the pages in, but this process's page tables start
    empty, and a first touch costs ~2 us a page (a 4 MiB put into a fresh
    extent would spend 2 ms faulting): MAP_POPULATE maps them all at once.
    """

    def __init__(self, fd: int, size: int, token: bytes):
        self.token = token
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        self.size = size
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def read_into(self, offset: int, size: int, dest: memoryview) -> None:
        np.copyto(np.frombuffer(dest, np.uint8, size), self.array[offset:offset + size])

    def write(self, offset: int, src: memoryview) -> None:
        np.copyto(self.array[offset:offset + src.nbytes], np.frombuffer(src, np.uint8))

    def view(self, offset: int, size: int) -> np.ndarray:
        return self.array[offset:offset + size]


def attach(endpoint: Endpoint, password: str | None, timeout: float | None) -> Arena:
    """Map the arena of the node at ``endpoint``; FastPathUnavailable says why not."""
    conn = Connection(endpoint, timeout, password)
    try:
        replies, fds = conn.round_trip_fds([(fp.KV_ARENA,)])
    finally:
        conn.close()
    reply = replies[0]
    if isinstance(reply, KVError):
        for fd in fds:
            os.close(fd)
        raise FastPathUnavailable(f"{endpoint} has no fast path: {reply}")
    try:
        size, pid, fd_number, token_offset, token, _ = reply
    except (TypeError, ValueError):
        raise FastPathUnavailable(f"{endpoint} answered {fp.KV_ARENA} with {reply!r:.80}") from None
    fd = fds[0] if fds else _open_proc_fd(pid, fd_number, endpoint)
    try:
        arena = Arena(fd, size, bytes(token))
    except (OSError, ValueError) as exc:
        raise FastPathUnavailable(f"cannot map the arena of {endpoint}: {exc}") from exc
    finally:
        for extra in (fds or [fd]):
            os.close(extra)
    if bytes(arena.view(token_offset, len(token))) != bytes(token):
        raise FastPathUnavailable(f"{endpoint} is not on this host (its arena token does not match)")
    return arena


def _open_proc_fd(pid: int, fd_number: int, endpoint: Endpoint) -> int:
    try:
        return os.open(f"/proc/{pid}/fd/{fd_number}", os.O_RDWR)
    except OSError as exc:
        raise FastPathUnavailable(f"cannot open the arena of {endpoint} through /proc: {exc}") from exc


@dataclass
class FastPathStats:
    """What the fast path did: for tests and for an operator wondering which path ran."""

    reads: int = 0
    writes: int = 0
    wire_calls: int = 0
    releases_deferred: int = 0
    lease_retries: int = 0


class FastPath:
    """The mode, the mapping and the per-client state both transports share."""

    def __init__(self, endpoint: Endpoint, password: str | None, timeout: float | None, mode: str,
                 lease_ttl_ms: int = fp.LEASE_TTL_MS, reservation_ttl_ms: int = fp.RESERVATION_TTL_MS):
        if mode not in FAST_PATH_MODES:
            raise ValueError(f"fast_path must be one of {FAST_PATH_MODES}, not {mode!r}")
        self.mode = mode
        self.lease_ttl_ms = lease_ttl_ms
        self.reservation_ttl_ms = reservation_ttl_ms
        self.stats = FastPathStats()
        self.unavailable: str | None = "fast path is off" if mode == "off" else None
        self._endpoint, self._password, self._timeout = endpoint, password, timeout
        self._arena: Arena | None = None
        self._lock = threading.Lock()
        self._deferred: list[int] = []

    def arena(self) -> Arena | None:
        """The mapping, made on first use; None when the wire must be used."""
        if self._arena is None and self.unavailable is None:
            with self._lock:
                if self._arena is None and self.unavailable is None:
                    self._map()
        return self._arena

    def _map(self) -> None:
        """Map the arena; in "auto" mode a node without a fast path means the wire from now
        on, and a node that cannot be reached now means the wire for this call."""
        try:
            self._arena = attach(self._endpoint, self._password, self._timeout)
        except FastPathUnavailable as exc:
            if self.mode == "required":
                raise
            self.unavailable = str(exc)
        except (ConnectionError, TimeoutError):
            if self.mode == "required":
                raise

    @property
    def needs_mapping(self) -> bool:
        return self._arena is None and self.unavailable is None

    def eligible(self, call: Call) -> bool:
        """Whether the call is a get or a put the fast path would carry (no I/O)."""
        local = call.local
        if local is None or self.unavailable is not None:
            return False
        return not isinstance(local, LocalWrite) or (local.nbytes >= FAST_PUT_MIN and all(v.nbytes for v in local.views))

    def serves(self, call: Call) -> bool:
        return self.eligible(call) and self.arena() is not None

    def remap_if_stale(self, reply: Any) -> bool:
        """True (and the mapping dropped, to be made again) when the node's arena changed."""
        if isinstance(reply, KVError) and str(reply).startswith("STALEARENA"):
            self._arena = None
            return True
        return False

    # ------------------------------------------------------------ reads

    def lease_requests(self, keys: list) -> list[tuple]:
        return [*self.release_requests(), (fp.KV_LEASE, self._arena.token, self.lease_ttl_ms, *keys)]

    def release_requests(self) -> list[tuple]:
        """The deferred releases, to send ahead of the next request."""
        with self._lock:
            ids, self._deferred = self._deferred, []
        return [(fp.KV_RELEASE, *ids)] if ids else []

    def copy_out(self, local: LocalRead, entries: list) -> tuple[list[Any], list[int]]:
        """Copy leased values to their destinations: (results shaped as wire replies, lease ids)."""
        results, leases = [], []
        for key, entry, view in zip(local.keys, entries, local.views):
            if entry is None:
                results.append(None)
                continue
            lease_id, offset, size = entry
            leases.append(lease_id)
            if view is None:
                out = bytearray(size)
                self._arena.read_into(offset, size, memoryview(out))
                results.append(out)
            elif size > view.nbytes:
                results.append(BufferTooSmall(key, size, view.nbytes))
            else:
                self._arena.read_into(offset, size, view)
                results.append(size)
        self.stats.reads += 1
        return results, leases

    def proven(self, started: float) -> bool:
        """True when every lease granted after ``started`` is certainly still valid now."""
        return time.monotonic() < started + self.lease_ttl_ms / 1000 - PROOF_MARGIN_S

    def defer(self, leases: list[int]) -> None:
        with self._lock:
            self._deferred.extend(leases)
            self.stats.releases_deferred += len(leases)

    def has_too_many_deferred(self) -> bool:
        return len(self._deferred) >= MAX_DEFERRED

    # ------------------------------------------------------------ writes

    def reserve_requests(self, local: LocalWrite) -> list[tuple]:
        return [*self.release_requests(),
                (fp.KV_RESERVE, self._arena.token, self.reservation_ttl_ms, *(v.nbytes for v in local.views))]

    def copy_in(self, local: LocalWrite, entries: list, started: float) -> list[tuple] | None:
        """Copy the values into their reservations; the KV.PUBLISH requests, or None when
        the reservations are too old to write into safely (the caller gives them back)."""
        half_life = started + self.reservation_ttl_ms / 2000
        for (_, offset), view in zip(entries, local.views):
            if time.monotonic() > half_life:
                return None
            self._arena.write(offset, view)
        self.stats.writes += 1
        return [_publish_args(rid, key, parent, local.overwrite)
                for (rid, _), key, parent in zip(entries, local.keys, local.parents)]

    def close(self) -> None:
        self._arena = None


def _publish_args(reservation_id: int, key, parent, overwrite: bool) -> tuple:
    args: tuple = (fp.KV_PUBLISH, reservation_id, key)
    if parent is not None:
        args += ("PARENT", parent)
    if not overwrite:
        args += ("NX",)
    return args


REMAPPED = object()      # a call's result when the node's arena changed under it: run it again


def _remapped() -> Any:
    return REMAPPED


def _raise(error: KVError) -> Callable[[], Any]:
    def fail() -> Any:
        raise error
    return fail


def _reservations_too_old() -> TimeoutError:
    return TimeoutError("the copy into reserved extents took longer than half their lifetime")


class FastTransport:
    """Blocking gets and puts through the arena; everything else through the wrapped wire transport."""

    def __init__(self, wire, fast: FastPath):
        self.wire = wire
        self.fast = fast
        self.endpoint = wire.endpoint

    def execute(self, call: Call) -> Any:
        for _ in range(2):
            if not self.fast.serves(call):
                self.fast.stats.wire_calls += 1
                return self.wire.execute(call)
            if isinstance(call.local, LocalRead):
                result = self.wire.run(lambda conn: self._read(conn, call), True)
            else:
                result = self.wire.run(lambda conn: self._write(conn, call), call.idempotent)
            if result is not REMAPPED:
                return result
        return self.wire.execute(call)

    def _read(self, conn, call: Call) -> Callable[[], Any]:
        fast = self.fast
        for _ in range(LEASE_RETRIES):
            started = time.monotonic()
            entries = conn.round_trip(fast.lease_requests(call.local.keys))[-1]
            if fast.remap_if_stale(entries):
                return _remapped
            if isinstance(entries, KVError):
                return _raise(entries)
            results, leases = fast.copy_out(call.local, entries)
            if fast.proven(started) and not conn.is_stale() and not fast.has_too_many_deferred():
                fast.defer(leases)
                return lambda: call.finish(results)
            if not leases or all(conn.round_trip([(fp.KV_RELEASE, *leases)])[0]):
                return lambda: call.finish(results)
            fast.stats.lease_retries += 1
        return _raise(LeaseExpired(f"leases expired during {LEASE_RETRIES} copies in a row"))

    def _write(self, conn, call: Call) -> Callable[[], Any]:
        fast = self.fast
        started = time.monotonic()
        entries = conn.round_trip(fast.reserve_requests(call.local))[-1]
        if fast.remap_if_stale(entries):
            return _remapped
        if isinstance(entries, KVError):
            return _raise(entries)
        publish = fast.copy_in(call.local, entries, started)
        if publish is None:
            conn.round_trip([(fp.KV_UNRESERVE, *(rid for rid, _ in entries))])
            return _raise(_reservations_too_old())
        replies = conn.round_trip(publish)
        return lambda: call.finish(replies)

    def close(self) -> None:
        """Close the connections: the node reclaims the leases still deferred with them."""
        self.wire.close()
        self.fast.close()


class AsyncFastTransport:
    """The asyncio form: copies of a megabyte or more run on a worker thread, so the
    loop keeps other calls' round trips moving while the bytes are copied."""

    def __init__(self, wire, fast: FastPath):
        self.wire = wire
        self.fast = fast
        self.endpoint = wire.endpoint

    async def execute(self, call: Call) -> Any:
        fast = self.fast
        for _ in range(2):
            if fast.eligible(call) and fast.needs_mapping:
                await asyncio.to_thread(fast.arena)
            if not fast.serves(call):
                fast.stats.wire_calls += 1
                return await self.wire.execute(call)
            if isinstance(call.local, LocalRead):
                result = await self.wire.run(lambda conn: self._read(conn, call), True)
            else:
                result = await self.wire.run(lambda conn: self._write(conn, call), call.idempotent)
            if result is not REMAPPED:
                return result
        return await self.wire.execute(call)

    async def _read(self, conn, call: Call) -> Callable[[], Any]:
        fast = self.fast
        for _ in range(LEASE_RETRIES):
            started = time.monotonic()
            entries = (await conn.round_trip(fast.lease_requests(call.local.keys)))[-1]
            if fast.remap_if_stale(entries):
                return _remapped
            if isinstance(entries, KVError):
                return _raise(entries)
            results, leases = await _maybe_in_thread(_nbytes(entries), fast.copy_out, call.local, entries)
            if fast.proven(started) and not conn.is_stale() and not fast.has_too_many_deferred():
                fast.defer(leases)
                return lambda: call.finish(results)
            if not leases or all((await conn.round_trip([(fp.KV_RELEASE, *leases)]))[0]):
                return lambda: call.finish(results)
            fast.stats.lease_retries += 1
        return _raise(LeaseExpired(f"leases expired during {LEASE_RETRIES} copies in a row"))

    async def _write(self, conn, call: Call) -> Callable[[], Any]:
        fast = self.fast
        started = time.monotonic()
        entries = (await conn.round_trip(fast.reserve_requests(call.local)))[-1]
        if fast.remap_if_stale(entries):
            return _remapped
        if isinstance(entries, KVError):
            return _raise(entries)
        publish = await _maybe_in_thread(call.local.nbytes, fast.copy_in, call.local, entries, started)
        if publish is None:
            await conn.round_trip([(fp.KV_UNRESERVE, *(rid for rid, _ in entries))])
            return _raise(_reservations_too_old())
        replies = await conn.round_trip(publish)
        return lambda: call.finish(replies)

    def close(self) -> None:
        self.wire.close()
        self.fast.close()


def _nbytes(entries: list) -> int:
    return sum(e[2] for e in entries if e is not None)


async def _maybe_in_thread(nbytes: int, fn, *args):
    if nbytes >= THREAD_COPY_MIN:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
