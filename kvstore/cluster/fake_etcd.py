"""An in-process etcd with the semantics membership relies on, on the event loop's clock.

What it keeps of etcd: one revision counter bumped once per write
transaction; keys carrying create/mod revisions and an optional lease;
leases with a minimum ttl, revoked by a sweep every half second once their
deadline passes (as etcd's lessor does), their keys deleted in one revision;
transactions of equality compares (a value compare on a missing key fails,
revision compares treat it as 0); prefix watches that replay history from a
start revision and raise `Compacted` when it is gone. `set_available(False)`
is an outage: calls raise `Unavailable`, watches break, and leases freeze;
when it ends every lease gets a fresh ttl, as when an etcd leader takes over
(or, ended with ``lapse``, those whose deadline passed expire, as a paused
etcd's do when it resumes).

Time is ``loop.time()``: under `simclock.VirtualClockLoop` a simulation of
hundreds of nodes with real ttls runs in moments. `stats` counts what a real
etcd would see (keep-alives, transactions, watch events delivered, bytes
written), which is how a simulation reports the load it would put on etcd.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvstore.cluster.kv import KV, Compacted, Compare, Delete, Event, KeyValue, Put, Unavailable

EXPIRY_CHECK_SECONDS = 0.5


@dataclass
class FakeEtcdStats:
    grants: int = 0
    keepalives: int = 0
    revokes: int = 0
    expired: int = 0
    reads: int = 0
    txns: int = 0
    txns_failed: int = 0
    watch_events: int = 0           # events delivered, summed over watchers
    watch_bytes: int = 0            # their keys and values, summed over watchers
    bytes_written: int = 0


@dataclass
class _Lease:
    ttl: int
    deadline: float
    keys: set[bytes] = field(default_factory=set)


@dataclass(eq=False)
class _Watch:
    prefix: bytes
    queue: asyncio.Queue
    client: "FakeEtcdClient"


class FakeEtcd:
    """The shared store; each node talks to it through its own `client()`."""

    def __init__(self, min_ttl: int = 2, history: int = 100_000):
        self.min_ttl = min_ttl
        self.revision = 1
        self.keys: dict[bytes, KeyValue] = {}
        self.leases: dict[int, _Lease] = {}
        self.history: deque[Event] = deque()
        self.history_limit = history
        self.compacted = 0
        self.watches: set[_Watch] = set()
        self.available = True
        self.stats = FakeEtcdStats()
        self._next_lease = 1
        self._sweeper: asyncio.TimerHandle | None = None

    def client(self) -> "FakeEtcdClient":
        return FakeEtcdClient(self)

    def set_available(self, available: bool, *, lapse: bool = False) -> None:
        """Start or end an outage; ``lapse`` ends it as a resumed (SIGCONT) etcd does: leases keep
        their deadlines, so those that passed meanwhile expire at the next sweep."""
        if available and not self.available and not lapse:
            now = asyncio.get_running_loop().time()
            for lease in self.leases.values():
                lease.deadline = now + lease.ttl
        self.available = available
        if not available:
            for watch in list(self.watches):
                watch.queue.put_nowait(Unavailable("etcd is down"))
            self.watches.clear()

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    # ---------------------------------------------------------------- writes

    def commit(self, ops: list[Put | Delete]) -> int:
        """Apply ``ops`` at one new revision and tell the watchers."""
        if any(isinstance(op, Put) and op.lease and op.lease not in self.leases for op in ops):
            raise Unavailable("etcdserver: requested lease not found")
        self.revision += 1
        events = [self._put(op) if isinstance(op, Put) else self._delete(op.key) for op in ops]
        for event in filter(None, events):
            self._record(event)
        return self.revision

    def _put(self, op: Put) -> Event:
        old = self.keys.get(op.key)
        if old is not None and old.lease and old.lease in self.leases:
            self.leases[old.lease].keys.discard(op.key)
        kv = KeyValue(op.key, op.value, old.create_revision if old else self.revision, self.revision, op.lease)
        self.keys[op.key] = kv
        if op.lease:
            self.leases[op.lease].keys.add(op.key)
        self.stats.bytes_written += len(op.key) + len(op.value)
        return Event(False, kv)

    def _delete(self, key: bytes) -> Event | None:
        old = self.keys.pop(key, None)
        if old is None:
            return None
        if old.lease in self.leases:
            self.leases[old.lease].keys.discard(key)
        return Event(True, KeyValue(key, b"", 0, self.revision, 0))

    def _record(self, event: Event) -> None:
        self.history.append(event)
        if len(self.history) > self.history_limit:
            self.compacted = self.history.popleft().kv.mod_revision
        for watch in self.watches:
            if event.kv.key.startswith(watch.prefix):
                watch.queue.put_nowait(event)

    def end_lease(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is not None and lease.keys:
            self.commit([Delete(key) for key in sorted(lease.keys)])

    def _arm_sweeper(self) -> None:
        if self._sweeper is None and self.leases:
            self._sweeper = asyncio.get_running_loop().call_later(EXPIRY_CHECK_SECONDS, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        if self.available:
            now = asyncio.get_running_loop().time()
            for lease_id in [i for i, lease in self.leases.items() if lease.deadline <= now]:
                self.stats.expired += 1
                self.end_lease(lease_id)
        self._arm_sweeper()


class FakeEtcdClient(KV):
    """One node's connection to a `FakeEtcd`."""

    def __init__(self, store: FakeEtcd):
        self.store = store
        self.closed = False

    def _check(self) -> FakeEtcd:
        if self.closed or not self.store.available:
            raise Unavailable("etcd is unreachable")
        return self.store

    async def grant(self, ttl: int) -> tuple[int, int]:
        store = self._check()
        lease_id, store._next_lease = store._next_lease, store._next_lease + 1
        granted = max(ttl, store.min_ttl)
        store.leases[lease_id] = _Lease(granted, asyncio.get_running_loop().time() + granted)
        store.stats.grants += 1
        store._arm_sweeper()
        return lease_id, granted

    async def keepalive(self, lease: int) -> int:
        store = self._check()
        store.stats.keepalives += 1
        found = store.leases.get(lease)
        now = asyncio.get_running_loop().time()
        if found is not None and found.deadline <= now:        # expired, not yet swept: etcd refuses it too
            store.stats.expired += 1
            store.end_lease(lease)
            found = None
        if found is None:
            return 0
        found.deadline = asyncio.get_running_loop().time() + found.ttl
        return found.ttl

    async def revoke(self, lease: int) -> None:
        store = self._check()
        store.stats.revokes += 1
        store.end_lease(lease)

    async def get_prefix(self, prefix: bytes) -> tuple[int, list[KeyValue]]:
        store = self._check()
        store.stats.reads += 1
        return store.revision, [kv for key, kv in sorted(store.keys.items()) if key.startswith(prefix)]

    async def txn(self, compares: list[Compare], ops: list[Put | Delete]) -> tuple[bool, int]:
        store = self._check()
        store.stats.txns += 1
        if not all(self._holds(c) for c in compares):
            store.stats.txns_failed += 1
            return False, 0
        return True, store.commit(ops)

    def _holds(self, compare: Compare) -> bool:
        kv = self.store.keys.get(compare.key)
        if compare.target == "value":
            return kv is not None and kv.value == compare.value
        revision = 0 if kv is None else (kv.create_revision if compare.target == "create" else kv.mod_revision)
        return revision == compare.value

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[Event]:
        store = self._check()
        if start_revision <= store.compacted:
            raise Compacted(f"revision {start_revision} is compacted (history starts after {store.compacted})")
        watch = _Watch(prefix, asyncio.Queue(), self)
        for event in store.history:
            if event.kv.mod_revision >= start_revision and event.kv.key.startswith(prefix):
                watch.queue.put_nowait(event)
        store.watches.add(watch)
        try:
            while True:
                item = await watch.queue.get()
                if isinstance(item, Exception):
                    raise item
                store.stats.watch_events += 1
                store.stats.watch_bytes += len(item.kv.key) + len(item.kv.value)
                yield item
        finally:
            store.watches.discard(watch)

    async def close(self) -> None:
        self.closed = True
        for watch in [w for w in self.store.watches if w.client is self]:
            watch.queue.put_nowait(Unavailable("client closed"))
            self.store.watches.discard(watch)
