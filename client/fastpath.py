"""The local fast path's state: the mode, the arena mapping and what is held in it.

A client on the same host as the node maps the node's DRAM arena once
(`client.arena`). After that the socket carries only small control messages
and the bytes move with one memcpy: gets in `arena_reads`, puts in
`arena_writes`, tensors and layers in `layers`, CUDA destinations in `gpu`.
This module keeps what those procedures share, for both clients:

- the mapping, made on first use; ``fast_path="auto"`` falls back to the
  wire when the node has no arena this process can map, ``"required"``
  raises `FastPathUnavailable` instead;
- the replies that turn an operation away from the arena (`detour`):
  STALEARENA (the node restarted: a new arena, so every fast-path command
  carries the token of the mapping it was made with, and the mapping and
  everything held in it are dropped, to be made again) and NOTINARENA (the
  value is staged outside the arena: read it over the socket);
- the reads served from the node's shared index (`shared_index`), which the
  node did not see: their keys are reported (KV.TOUCH, so they count as hits
  for recency, heat and stats) with the next request, or on their own once
  `TOUCH_BATCH` of them are waiting;
- the leases held after gets (`lease_cache`), the spare reservations kept
  for the next puts (`reservation_pool`), and the releases that ride along
  with the next request (or are left to the node, which reclaims everything
  a closed connection held);
- the GPU arena opened over CUDA IPC (`gpu`), which belongs to the same node
  and is dropped with the mapping.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from client.arena import Arena, attach
from client.errors import ConnectionError, FastPathUnavailable, KVError, TimeoutError
from client.lease_cache import LeaseCache
from client.reservation_pool import ReservationPool
from client.shared_index import USABLE as INDEX_USABLE
from client.sockets import Endpoint
from proto import fastpath as fp

FAST_PATH_MODES = ("auto", "off", "required")
LEASE_RETRIES = 3
CACHE_ENTRIES = 256              # leases held at most after gets
CACHE_ARENA_SHARE = 8            # ... on at most 1/8 of the arena
POOL_PER_SIZE = 2                # spare reservations per recently put size
POOL_SIZES = 4                   # sizes with spares
POOL_ARENA_SHARE = 16            # spares take at most 1/16 of the arena
TOUCH_BATCH = 256                # reads from the shared index reported at once, at the latest


class Detour:
    """An operation's outcome when the arena cannot carry it now."""

    def __init__(self, why: str):
        self.why = why

    def __repr__(self) -> str:
        return f"Detour({self.why!r})"


REMAPPED = Detour("the node's arena changed: map it again and run the operation again")
OVER_WIRE = Detour("the node cannot serve the value from its arena: use the wire")


@dataclass
class FastPathStats:
    """What the fast path did: for tests and for an operator wondering which path ran."""

    reads: int = 0
    writes: int = 0
    wire_calls: int = 0
    cached_reads: int = 0        # values copied under a lease held from an earlier get
    index_reads: int = 0         # values found in the shared index and copied with no round trip
    index_races: int = 0         # ... found, but changed under the copy (then leased instead)
    ssd_reads: int = 0           # ... of those, values on SSD alone read from the node's RocksDB files here
    pooled_writes: int = 0       # values copied into a spare reserved by an earlier put
    releases_deferred: int = 0
    lease_retries: int = 0
    remaps: int = 0              # mappings dropped because the node's arena changed
    gpu_ipc_reads: int = 0       # CUDA destinations filled device to device from the node's GPU arena
    gpu_fallbacks: int = 0       # GPU arenas this process could not open (CUDA destinations staged)
    gpu_reopens: int = 0         # GPU mappings dropped because the node's GPU arena changed


class FastPath:
    """The mode, the mapping, and the leases, spares and GPU mapping held in it."""

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
        self.mapping: Arena | None = None            # the arena as mapped now (never maps)
        self.lock = threading.Lock()
        self._deferred: list[int] = []
        self._touched: list[bytes] = []
        self.index_reads = INDEX_USABLE              # False: a first get always asks the node (KV.LEASE)
        self.cache_entries = CACHE_ENTRIES           # 0: keep no lease (every get asks the node)
        self.leases = LeaseCache(0, 0)
        self.spares = ReservationPool(POOL_PER_SIZE, POOL_SIZES, 0)
        self.gpu: Any = False                        # False: not looked for; None: none; else a GPUPath

    # ------------------------------------------------------------ the mapping

    def arena(self) -> Arena | None:
        """The mapping, made on first use; None when the wire must be used."""
        if self.needs_mapping():
            with self.lock:
                if self.needs_mapping():
                    self._map()
        return self.mapping

    def needs_mapping(self) -> bool:
        return self.mapping is None and self.unavailable is None

    def _map(self) -> None:
        """Map the arena; in "auto" mode a node without a fast path means the wire from now
        on, and a node that cannot be reached now means the wire for this call."""
        try:
            arena = attach(self._endpoint, self._password, self._timeout)
        except FastPathUnavailable as exc:
            if self.mode == "required":
                raise
            self.unavailable = str(exc)
            return
        except (ConnectionError, TimeoutError):
            if self.mode == "required":
                raise
            return
        self.leases = LeaseCache(self.cache_entries, arena.size // CACHE_ARENA_SHARE)
        self.spares = ReservationPool(POOL_PER_SIZE, POOL_SIZES, arena.size // POOL_ARENA_SHARE)
        self.mapping = arena

    def detour(self, reply: Any) -> Detour | None:
        """Read a fast-path command's reply: a Detour when the node turns the operation away
        from the arena, None when the reply is usable; other error replies are raised."""
        if not isinstance(reply, KVError):
            return None
        code = str(reply).split(" ", 1)[0]
        if code == "STALEARENA":
            return self.drop_mapping()
        if code == "NOTINARENA":
            return OVER_WIRE
        raise reply

    def drop_mapping(self, arena: Arena | None = None) -> Detour:
        """Forget a mapping of an arena the node no longer has (``arena``, when it is still the
        mapping: another thread may have mapped the new one already), and all that was held in
        it: REMAPPED, the outcome that has the operation run again on a new mapping."""
        with self.lock:
            if arena is not None and self.mapping is not arena:
                return REMAPPED
            arena, self.mapping = self.mapping, None
            self.leases = LeaseCache(0, 0)
            self.spares = ReservationPool(POOL_PER_SIZE, POOL_SIZES, 0)
            self._deferred = []
            self._touched = []
            gpu, self.gpu = self.gpu, False
            self.stats.remaps += 1
        if arena is not None:
            arena.close()
        if gpu:
            gpu.close()
        return REMAPPED

    # ------------------------------------------------------------ releases

    def housekeeping(self) -> list[tuple]:
        """Reads to report and releases of given-up leases and reservations, to send ahead of
        the next request."""
        with self.lock:
            touched, self._touched = self._touched, []
            leases, self._deferred = self._deferred, []
            reservations = self.spares.given_up()
        return [*([(fp.KV_TOUCH, *touched)] if touched else []),
                *([(fp.KV_RELEASE, *leases)] if leases else []),
                *([(fp.KV_UNRESERVE, *reservations)] if reservations else [])]

    def has_housekeeping(self) -> bool:
        """Whether `housekeeping` has anything to send (read without the lock: a hint)."""
        return bool(self._touched or self._deferred or self.spares.has_given_up())

    def reports_due(self) -> bool:
        """Whether enough reads wait to be reported that the next read should send them."""
        return len(self._touched) >= TOUCH_BATCH

    def touched(self, keys: list[bytes]) -> bool:
        """Report reads served from the shared index with the next request; True when enough
        are waiting to be worth a round trip of their own."""
        with self.lock:
            self._touched.extend(keys)
            self.stats.index_reads += len(keys)
            return len(self._touched) >= TOUCH_BATCH

    def release_later(self, lease_ids: list[int]) -> None:
        """Release leases with the next request (their copies are already proven whole)."""
        with self.lock:
            self.give_up(lease_ids)

    def give_up(self, lease_ids: list[int]) -> None:
        """`release_later`, for a caller that holds the lock."""
        self._deferred.extend(lease_ids)
        self.stats.releases_deferred += len(lease_ids)

    def close(self) -> None:
        """Forget the mapping; what it held ends with the connections (the node reclaims it)."""
        with self.lock:
            gpu, self.gpu = self.gpu, None
            self.leases.clear()
            self.spares.clear()
            self._deferred = []
            self._touched = []
            arena, self.mapping = self.mapping, None
        if arena is not None:
            arena.close()
        if gpu:
            gpu.close()
