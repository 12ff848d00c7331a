"""Puts that return before their commit is acknowledged: `put_nowait` and `flush`.

An engine saves KV asynchronously (it hands a block over and waits for all of
them later), so a put need not wait for the node's reply. `PutPipeline` keeps
one connection of its own and, for each put:

- on the local fast path, copies the value into an extent reserved on that
  connection (``KV.RESERVE`` reserves several extents of a size in one round
  trip, so most puts make no round trip at all) and sends ``KV.PUBLISH``
  without reading its reply;
- over the wire, sends ``KV.PUT`` without reading its reply.

The replies are read later, in order: when a reservation round trip needs the
connection anyway, when too many are outstanding (`MAX_PENDING`), when a read of
this client names a key with a pending commit (read-your-writes), and at
`flush`, which reads every reply so far and raises `PutsFailed` naming the keys
whose commit failed (an error reply such as OOM, or a connection that broke:
then every key not yet acknowledged). Another client sees a block once its
commit is acknowledged (after `flush`, at the latest).

Extents reserved ahead are used only while half of their lifetime is left (the
rule every reservation follows); older ones are given back with the next
request, and the node reclaims all of them when the connection closes.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from client.buffers import Key, key_bytes, readable_view
from client.errors import ConnectionError, KVError, TimeoutError
from client.operations import put_options
from proto import fastpath as fp
from proto import wire

MAX_PENDING = 256                # replies outstanding at most before the oldest are read
CORK = 4                         # arena publishes held back to go out together (one wake-up of the node)
CORK_S = 0.002                   # ... or until the next put after this long
RESERVE_AHEAD = 8                # extents reserved in one round trip for a stream of one size
RESERVE_SHARE = 16               # ... holding at most 1/16 of the arena
RESERVE_SIZES = 4                # sizes with extents reserved ahead
FAST_PUT_MIN = 256 * 1024        # smaller values go over the wire (as with `put`)


class PutsFailed(KVError):
    """Commits that failed since the last flush: ``failures`` maps each key to its error."""

    def __init__(self, failures: dict[bytes, Exception]):
        self.failures = failures
        names = ", ".join(k.decode(errors="replace") for k in list(failures)[:8])
        more = f" and {len(failures) - 8} more" if len(failures) > 8 else ""
        first = next(iter(failures.values()))
        super().__init__(f"{len(failures)} put(s) failed: {names}{more} (first error: {first})")

    @property
    def keys(self) -> list[bytes]:
        return list(self.failures)


@dataclass(slots=True)
class _Extent:
    reservation_id: int
    offset: int
    use_until: float



class PutPipeline:
    """One connection carrying puts whose replies are read later (thread-safe)."""

    def __init__(self, connect: Callable[[], Any], fast: Any, reservation_ttl_ms: int):
        self._connect = connect
        self._fast = fast
        self._ttl_ms = reservation_ttl_ms
        self._conn: Any = None
        self._arena: Any = None                      # the mapping the extents below belong to
        self._lock = threading.RLock()
        self._pending: deque[list[bytes]] = deque()  # per request sent, the keys its reply commits
        self._pending_keys: dict[bytes, int] = {}
        self._extents: dict[int, deque[_Extent]] = {}
        self._ahead: dict[int, int] = {}             # per size, extents to reserve next time (doubling)
        self._held = 0                               # bytes of extents reserved and not written
        self._given_up: list[int] = []
        self._failures: dict[bytes, Exception] = {}
        self._corked: list[tuple[tuple, bytes]] = []   # publishes copied in, not yet sent
        self._corked_since = 0.0
        self.acknowledged = 0

    # ------------------------------------------------------------ puts

    def put(self, key: Key, value: Any, parent: Key | None, overwrite: bool) -> None:
        self.batch_put([(key, value)], [parent], overwrite)

    def batch_put(self, pairs: list[tuple[Key, Any]], parents: list[Key | None], overwrite: bool) -> None:
        with self._lock:
            for (key, value), parent in zip(pairs, parents):
                self._put_one(key_bytes(key), readable_view(value), parent, overwrite)

    def _put_one(self, key: bytes, view: memoryview, parent: Key | None, overwrite: bool) -> None:
        try:
            self._connection()
            request = self._through_arena(key, view, parent, overwrite) if view.nbytes >= FAST_PUT_MIN else None
            if request is None:
                self._corked.append(((wire.KV_PUT, key, view, *put_options(parent, overwrite)), key))
                self._uncork()
                return
            if not self._corked:
                self._corked_since = time.monotonic()
            self._corked.append((request, key))
            if len(self._corked) >= CORK or time.monotonic() - self._corked_since > CORK_S:
                self._uncork()
        except (ConnectionError, TimeoutError) as exc:
            self._broken(exc, [key])
        except KVError as exc:                       # the reservation was refused (OOM, ...)
            self._failures[key] = exc

    def _uncork(self, *more: tuple) -> None:
        """Send the publishes held back (and any give-backs), then ``more`` (replies all read later)."""
        requests = [request for request, _ in self._corked]
        keys = [[key] for _, key in self._corked]
        if self._given_up:
            requests.insert(0, (fp.KV_UNRESERVE, *self._given_up))
            keys.insert(0, [])
            self._given_up = []
        self._corked = []
        if not requests and not more:
            return
        try:
            self._conn.send([*requests, *more])
        except (ConnectionError, TimeoutError) as exc:
            self._broken(exc, [k for sent in keys for k in sent])
            raise
        for sent in keys:
            self._sent(sent)
        if len(self._pending) > MAX_PENDING:
            self._read(len(self._pending) - MAX_PENDING // 2)

    def _through_arena(self, key: bytes, view: memoryview, parent: Key | None, overwrite: bool) -> tuple | None:
        """Copy into a reserved extent: the KV.PUBLISH to send, or None (use the wire)."""
        fast = self._fast
        if fast.unavailable is not None or fast.arena() is None:
            return None
        arena = fast.mapping
        if arena is not self._arena:                 # a new mapping: extents of the old one are void
            self._clear_extents()
            self._arena = arena
        extent = self._extent(arena, view.nbytes)
        if extent is None:
            return None
        arena.write(extent.offset, view)
        fast.stats.writes += 1
        return (fp.KV_PUBLISH, extent.reservation_id, key, *put_options(parent, overwrite))

    def _extent(self, arena: Any, size: int) -> _Extent | None:
        """An extent of ``size`` reserved on this connection. A size put again and again gets
        more reserved per round trip (1, 2, 4, ... `RESERVE_AHEAD`); spares of sizes no longer put
        and of more than `RESERVE_SIZES` sizes are given back, and all of them stay within 1/16
        of the arena."""
        queue = self._extents.pop(size, None) or deque()
        self._extents[size] = queue                  # most recently put size last
        now = time.monotonic()
        while queue and queue[0].use_until <= now:
            self._give_up(queue.popleft(), size)
        while len(self._extents) > RESERVE_SIZES:
            old_size, old = next(iter(self._extents.items()))
            del self._extents[old_size]
            for extent in old:
                self._give_up(extent, old_size)
        if not queue:
            ahead = self._ahead.get(size, 0)
            budget = (arena.size // RESERVE_SHARE - self._held) // size
            count = max(1, min(ahead, budget))
            self._ahead[size] = min(RESERVE_AHEAD, max(1, ahead * 2))
            started = time.monotonic()
            reply = self._round_trip([(fp.KV_RESERVE, arena.token, self._ttl_ms, *([size] * count))])
            if isinstance(reply, KVError) and str(reply).startswith("OOM") and count > 1:
                reply = self._round_trip([(fp.KV_RESERVE, arena.token, self._ttl_ms, size)])
            if self._fast.detour(reply) is not None:         # STALEARENA / NOTINARENA; errors raised
                return None
            use_until = started + self._ttl_ms / 2000
            queue.extend(_Extent(rid, offset, use_until) for rid, offset in reply)
            self._held += size * len(reply)
        self._held -= size
        return queue.popleft()

    def _clear_extents(self) -> None:
        self._extents.clear()
        self._held = 0

    def _give_up(self, extent: _Extent, size: int) -> None:
        self._given_up.append(extent.reservation_id)
        self._held -= size

    # ------------------------------------------------------------ replies

    def settle(self, keys: Any = None) -> None:
        """Read replies until none of ``keys`` (all, when None) has a commit pending; failures
        are kept for `flush`."""
        with self._lock:
            if self._corked:
                try:
                    self._uncork()
                except (ConnectionError, TimeoutError):
                    return
            if not self._pending:
                return
            count = len(self._pending)
            if keys is not None:
                wanted = {key_bytes(k) for k in keys}
                if not wanted.intersection(self._pending_keys):
                    return
                count = 1 + max(i for i, sent in enumerate(self._pending) if wanted.intersection(sent))
            try:
                self._read(count)
            except (ConnectionError, TimeoutError):  # recorded as failures of the keys: for flush
                pass

    def flush(self) -> int:
        """Wait for every commit sent so far; how many were acknowledged since the last flush.
        Raises PutsFailed naming the keys whose commit failed."""
        with self._lock:
            try:
                self.settle()
                if self._given_up and self._conn is not None:       # stale extents: give them back
                    self._uncork()
                    self._read(len(self._pending))
            except (ConnectionError, TimeoutError) as exc:
                self._broken(exc, [])
            done, self.acknowledged = self.acknowledged, 0
            if self._failures:
                failures, self._failures = self._failures, {}
                raise PutsFailed(failures)
            return done

    def pending(self) -> int:
        """Commits not yet acknowledged (held back, or sent and not read)."""
        return len(self._pending) + len(self._corked)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self._pending.clear()
            self._pending_keys.clear()
            self._corked = []
            self._clear_extents()

    def _connection(self) -> Any:
        if self._conn is None:
            self._conn = self._connect()
            self._clear_extents()                    # reservations end with their connection
            self._given_up = []
        return self._conn

    def _sent(self, keys: list[bytes]) -> None:
        self._pending.append(keys)
        for key in keys:
            self._pending_keys[key] = self._pending_keys.get(key, 0) + 1

    def _round_trip(self, requests: list[tuple]) -> Any:
        """Send ``requests`` after the pending ones and read everything: the last reply."""
        conn = self._connection()
        self._uncork(*requests)
        self._read(len(self._pending))
        return conn.receive([None] * len(requests))[-1]

    def _read(self, count: int) -> None:
        if not count:
            return
        try:
            replies = self._conn.receive([None] * count)
        except (ConnectionError, TimeoutError) as exc:
            self._broken(exc, [])
            raise
        for reply in replies:
            keys = self._pending.popleft()
            for key in keys:
                self._forget(key)
                if isinstance(reply, KVError):
                    self._failures[key] = reply
                else:
                    self.acknowledged += 1

    def _forget(self, key: bytes) -> None:
        left = self._pending_keys.pop(key) - 1
        if left:
            self._pending_keys[key] = left

    def _broken(self, exc: Exception, more: list[bytes]) -> None:
        """The connection failed: every commit not acknowledged is a failure."""
        for keys in self._pending:
            for key in keys:
                self._failures[key] = exc
        for _, key in self._corked:
            self._failures[key] = exc
        for key in more:
            self._failures[key] = exc
        self._corked = []
        self._pending.clear()
        self._pending_keys.clear()
        self._clear_extents()
        self._given_up = []
        if self._conn is not None:
            self._conn.close()
            self._conn = None
