"""The local fast path: gets and puts through the node's shared-memory arena.

A client on the same host as the node maps the node's DRAM arena once
(`client.arena`). After that the socket carries only small control messages
and the bytes move with one memcpy:

- get: ``KV.LEASE`` pins the values and says where they are and which
  validity word vouches for each lease; the client copies them into the
  caller's buffers and then reads the words. A word that still holds its
  lease's tag proves the copy whole and current (kvstore/leases.py); any
  other value means the lease ended during the copy (the value changed, or
  the lease expired) and the get is retried.
- repeated get: the client keeps the lease (`lease_cache`), so the next get
  of the key is a memcpy and a word check, with no round trip at all; a word
  that no longer holds the tag (the value was overwritten, deleted or
  evicted, or the lease ended) sends the get to the node.
- put: a spare extent reserved ahead for this size (`reservation_pool`), or
  else ``KV.RESERVE``; the client copies the values in; ``KV.PUBLISH``
  commits them under their keys, and the same round trip reserves the spares
  for the next put (puts smaller than `FAST_PUT_MIN` in all go over the wire,
  where one round trip is cheaper).

Lease releases and given-up reservations ride along with the next request
(or are left to the node, which reclaims everything a closed connection
held). A lease that got no validity word (the node ran out) is released at
once, and the release reply says whether it was still valid.

The transport wraps a wire transport: calls that are not gets or puts, and
every call when the arena cannot be mapped (``fast_path="auto"``), go over
the wire; ``"required"`` raises `FastPathUnavailable` instead.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from client.arena import Arena, attach
from client.errors import BufferTooSmall, ConnectionError, FastPathUnavailable, KVError, LeaseExpired, TimeoutError
from client.lease_cache import HeldLease, LeaseCache, cache_key
from client.operations import Call, LocalRead, LocalWrite
from client.reservation_pool import ReservationPool, Spare
from client.sockets import Endpoint
from proto import fastpath as fp

FAST_PATH_MODES = ("auto", "off", "required")
FAST_PUT_MIN = 256 * 1024        # a put of fewer bytes in all goes over the wire
LEASE_RETRIES = 3
THREAD_COPY_MIN = 1 << 20        # the asyncio transport copies at least this much off the loop
CACHE_ENTRIES = 256              # leases held at most after gets
CACHE_ARENA_SHARE = 8            # ... on at most 1/8 of the arena
POOL_PER_SIZE = 2                # spare reservations per recently put size
POOL_SIZES = 4                   # sizes with spares
POOL_ARENA_SHARE = 16            # spares take at most 1/16 of the arena


@dataclass
class FastPathStats:
    """What the fast path did: for tests and for an operator wondering which path ran."""

    reads: int = 0
    writes: int = 0
    wire_calls: int = 0
    cached_reads: int = 0        # values copied under a lease held from an earlier get
    pooled_writes: int = 0       # values copied into a spare reserved by an earlier put
    releases_deferred: int = 0
    lease_retries: int = 0


class FastPath:
    """The mode, the mapping, the held leases and spare reservations both transports share."""

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
        self.cache_entries = CACHE_ENTRIES           # 0: keep no lease (every get asks the node)
        self.leases = LeaseCache(0, 0)
        self.spares = ReservationPool(POOL_PER_SIZE, POOL_SIZES, 0)

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
        # Held leases and spares of an earlier mapping belonged to a node that is gone.
        self.leases = LeaseCache(self.cache_entries, arena.size // CACHE_ARENA_SHARE)
        self.spares = ReservationPool(POOL_PER_SIZE, POOL_SIZES, arena.size // POOL_ARENA_SHARE)
        self._deferred = []
        self._arena = arena

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

    def housekeeping(self) -> list[tuple]:
        """Releases of given-up leases and reservations, to send ahead of the next request."""
        with self._lock:
            leases, self._deferred = self._deferred, []
            reservations = self.spares.given_up()
        return [*([(fp.KV_RELEASE, *leases)] if leases else []),
                *([(fp.KV_UNRESERVE, *reservations)] if reservations else [])]

    def release_later(self, lease_ids: list[int]) -> None:
        """Release leases with the next request (their copies are already proven whole)."""
        with self._lock:
            self._give_up(lease_ids)

    def _give_up(self, lease_ids: list[int]) -> None:
        self._deferred.extend(lease_ids)
        self.stats.releases_deferred += len(lease_ids)

    # ------------------------------------------------------------ reads

    def read_held(self, local: LocalRead) -> tuple[list[Any], list[int]]:
        """Serve what held leases can: the results so far and the indices still to lease."""
        arena, results, misses = self._arena, [None] * len(local.keys), []
        self.stats.reads += 1
        with self._lock:
            self._give_up(self.leases.due(time.monotonic()))
            held = [self.leases.lookup(cache_key(key)) for key in local.keys]
        for i, lease in enumerate(held):
            if lease is None:
                misses.append(i)
                continue
            results[i] = self._copy(arena, local, i, lease.offset, lease.size)
            if arena.still_valid(lease.word, lease.tag):
                self.stats.cached_reads += 1
                continue
            with self._lock:
                self.leases.forget(cache_key(local.keys[i]), lease)
            misses.append(i)
        return results, misses

    def held_bytes(self, local: LocalRead) -> int:
        with self._lock:
            return sum(held.size for key in local.keys if (held := self.leases.lookup(cache_key(key))))

    def lease_requests(self, keys: list) -> list[tuple]:
        return [*self.housekeeping(), (fp.KV_LEASE, self._arena.token, self.lease_ttl_ms, *keys)]

    def copy_leased(self, local: LocalRead, indices: list[int], entries: list, results: list[Any],
                    started: float) -> tuple[list[int], list[tuple[int, int]]]:
        """Copy freshly leased values into ``results``; the indices whose lease ended during the
        copy (to lease again), and (index, lease id) pairs without a word (to release and check)."""
        arena, retry, unchecked, keep, done = self._arena, [], [], [], []
        for i, entry in zip(indices, entries):
            if entry is None:
                results[i] = None
                continue
            lease_id, offset, size, word, tag, hold_ms = entry
            results[i] = self._copy(arena, local, i, offset, size)
            if word < 0:
                unchecked.append((i, lease_id))
            elif not arena.still_valid(word, tag):
                retry.append(i)
            elif hold_ms > 0:
                use_until = started + hold_ms / 1000
                keep.append((cache_key(local.keys[i]), HeldLease(lease_id, offset, size, word, tag, use_until)))
            else:
                done.append(lease_id)
        with self._lock:
            self._give_up(done)
            for key, held in keep:
                self._give_up(self.leases.keep(key, held))
        return retry, unchecked

    @staticmethod
    def _copy(arena: Arena, local: LocalRead, i: int, offset: int, size: int) -> Any:
        view = local.views[i]
        if view is None:
            out = bytearray(size)
            arena.read_into(offset, size, memoryview(out))
            return out
        if size > view.nbytes:
            return BufferTooSmall(local.keys[i], size, view.nbytes)
        arena.read_into(offset, size, view)
        return size

    # ------------------------------------------------------------ writes

    def take_spares(self, local: LocalWrite, owner: Any) -> list[Spare | None]:
        """A spare reservation for each value where the pool has one reserved on ``owner``."""
        now = time.monotonic()
        with self._lock:
            spares = [self.spares.take(view.nbytes, now, owner) for view in local.views]
        self.stats.pooled_writes += sum(spare is not None for spare in spares)
        return spares

    def reserve_request(self, sizes: list[int]) -> tuple:
        return (fp.KV_RESERVE, self._arena.token, self.reservation_ttl_ms, *sizes)

    def fill_spares(self, spares: list[Spare | None], local: LocalWrite, reply: list, started: float,
                    owner: Any) -> None:
        """Put the extents of a KV.RESERVE reply where ``spares`` has none."""
        missing = [i for i, spare in enumerate(spares) if spare is None]
        fresh = self._spares_of(reply, [local.views[i].nbytes for i in missing], started, owner)
        for i, spare in zip(missing, fresh):
            spares[i] = spare

    def _spares_of(self, reply: list, sizes: list[int], started: float, owner: Any) -> list[Spare]:
        use_until = started + self.reservation_ttl_ms / 2000
        return [Spare(rid, offset, size, use_until, owner) for (rid, offset), size in zip(reply, sizes)]

    def publish_round(self, local: LocalWrite, spares: list[Spare], owner: Any) -> PublishRound | None:
        """Copy the values into their reservations and make the round trip that publishes them
        and reserves the next put's spares; None when a reservation is too old to write into
        safely (the caller gives them back)."""
        for spare, view in zip(spares, local.views):
            if time.monotonic() > spare.use_until:
                return None
            self._arena.write(spare.offset, view)
        self.stats.writes += 1
        before = self.housekeeping()
        publish = [_publish_args(spare.reservation_id, key, parent, local.overwrite)
                   for spare, key, parent in zip(spares, local.keys, local.parents)]
        with self._lock:
            ahead = self.spares.wanted([view.nbytes for view in local.views], owner)
        requests = [*before, *publish, *([self.reserve_request(ahead)] if ahead else [])]
        return PublishRound(requests, len(before), len(publish), ahead, time.monotonic())

    def publish_done(self, sent: PublishRound, replies: list, owner: Any) -> list:
        """Keep the spares reserved ahead; the publish replies."""
        if sent.ahead and not isinstance(replies[-1], KVError):
            with self._lock:
                self.spares.add(self._spares_of(replies[-1], sent.ahead, sent.started, owner))
        return replies[sent.first:sent.first + sent.count]

    def close(self) -> None:
        """Forget the mapping; what it held ends with the connections (the node reclaims it)."""
        with self._lock:
            self.leases.clear()
            self.spares.clear()
            self._deferred = []
        self._arena = None


@dataclass
class PublishRound:
    """The requests that publish a put (after any releases riding along) and reserve ahead."""

    requests: list[tuple]
    first: int                   # index of the first KV.PUBLISH
    count: int
    ahead: list[int]             # sizes reserved ahead by the last request, if any
    started: float


def _unreserve(spares: list[Spare]) -> list[tuple]:
    return [(fp.KV_UNRESERVE, *(spare.reservation_id for spare in spares))]


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


def _leases_kept_expiring() -> LeaseExpired:
    return LeaseExpired(f"leases expired during {LEASE_RETRIES} copies in a row")


def _reservations_too_old() -> TimeoutError:
    return TimeoutError("the copy into reserved extents took longer than half their lifetime")


def _release_check(unchecked: list[tuple[int, int]]) -> list[tuple]:
    return [(fp.KV_RELEASE, *(lease_id for _, lease_id in unchecked))] if unchecked else []


def _failed_checks(unchecked: list[tuple[int, int]], replies: list) -> list[int]:
    return [i for (i, _), valid in zip(unchecked, replies[0] if replies else []) if not valid]


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
                results, misses = self.fast.read_held(call.local)
                if not misses:
                    return call.finish(results)
                result = self.wire.run(lambda conn: self._read(conn, call, results, misses), True)
            else:
                result = self.wire.run(lambda conn: self._write(conn, call), call.idempotent)
            if result is not REMAPPED:
                return result
        return self.wire.execute(call)

    def _read(self, conn, call: Call, results: list, misses: list[int]) -> Callable[[], Any]:
        fast = self.fast
        for _ in range(LEASE_RETRIES):
            started = time.monotonic()
            entries = conn.round_trip(fast.lease_requests([call.local.keys[i] for i in misses]))[-1]
            if fast.remap_if_stale(entries):
                return _remapped
            if isinstance(entries, KVError):
                return _raise(entries)
            misses, unchecked = fast.copy_leased(call.local, misses, entries, results, started)
            misses += _failed_checks(unchecked, conn.round_trip(_release_check(unchecked)))
            if not misses:
                return lambda: call.finish(results)
            fast.stats.lease_retries += 1
        return _raise(_leases_kept_expiring())

    def _write(self, conn, call: Call) -> Callable[[], Any]:
        fast, local = self.fast, call.local
        spares = fast.take_spares(local, conn)
        if None in spares:
            started = time.monotonic()
            sizes = [view.nbytes for view, spare in zip(local.views, spares) if spare is None]
            reply = conn.round_trip([*fast.housekeeping(), fast.reserve_request(sizes)])[-1]
            if fast.remap_if_stale(reply):
                return _remapped
            if isinstance(reply, KVError):
                return _raise(reply)
            fast.fill_spares(spares, local, reply, started, conn)
        sent = fast.publish_round(local, spares, conn)
        if sent is None:
            conn.round_trip(_unreserve(spares))
            return _raise(_reservations_too_old())
        replies = conn.round_trip(sent.requests)
        return lambda: call.finish(fast.publish_done(sent, replies, conn))

    def close(self) -> None:
        """Close the connections: the node reclaims the leases and spares held with them."""
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
                results, misses = await _maybe_in_thread(fast.held_bytes(call.local), fast.read_held, call.local)
                if not misses:
                    return call.finish(results)
                result = await self.wire.run(lambda conn: self._read(conn, call, results, misses), True)
            else:
                result = await self.wire.run(lambda conn: self._write(conn, call), call.idempotent)
            if result is not REMAPPED:
                return result
        return await self.wire.execute(call)

    async def _read(self, conn, call: Call, results: list, misses: list[int]) -> Callable[[], Any]:
        fast = self.fast
        for _ in range(LEASE_RETRIES):
            started = time.monotonic()
            entries = (await conn.round_trip(fast.lease_requests([call.local.keys[i] for i in misses])))[-1]
            if fast.remap_if_stale(entries):
                return _remapped
            if isinstance(entries, KVError):
                return _raise(entries)
            misses, unchecked = await _maybe_in_thread(_nbytes(entries), fast.copy_leased, call.local, misses,
                                                       entries, results, started)
            misses += _failed_checks(unchecked, await conn.round_trip(_release_check(unchecked)))
            if not misses:
                return lambda: call.finish(results)
            fast.stats.lease_retries += 1
        return _raise(_leases_kept_expiring())

    async def _write(self, conn, call: Call) -> Callable[[], Any]:
        fast, local = self.fast, call.local
        spares = fast.take_spares(local, conn)
        if None in spares:
            started = time.monotonic()
            sizes = [view.nbytes for view, spare in zip(local.views, spares) if spare is None]
            reply = (await conn.round_trip([*fast.housekeeping(), fast.reserve_request(sizes)]))[-1]
            if fast.remap_if_stale(reply):
                return _remapped
            if isinstance(reply, KVError):
                return _raise(reply)
            fast.fill_spares(spares, local, reply, started, conn)
        sent = await _maybe_in_thread(local.nbytes, fast.publish_round, local, spares, conn)
        if sent is None:
            await conn.round_trip(_unreserve(spares))
            return _raise(_reservations_too_old())
        replies = await conn.round_trip(sent.requests)
        return lambda: call.finish(fast.publish_done(sent, replies, conn))

    def close(self) -> None:
        self.wire.close()
        self.fast.close()


def _nbytes(entries: list) -> int:
    return sum(e[2] for e in entries if e is not None)


async def _maybe_in_thread(nbytes: int, fn, *args):
    if nbytes >= THREAD_COPY_MIN:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
