"""`KV` over a real etcd, through the aetcd client.

aetcd maps gRPC failures to its own exceptions; here every one of them (and a
timeout) becomes `Unavailable`, and a compacted watch becomes `Compacted`, so
membership has two cases to handle. gRPC's reconnect backoff is capped at one
second: after an etcd restart nodes are back within a second, not after
gRPC's default of up to two minutes.

Each watched prefix gets a client (a gRPC channel and watch stream) of its
own: aetcd multiplexes the watches of one client over one stream, and when
that stream breaks, watches re-created on it concurrently can be left without
events (seen with two watches over an etcd restart).
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import aetcd
from aetcd import exceptions as aetcd_errors

from kvstore.cluster.kv import KV, Compacted, Compare, Delete, Event, KeyValue, Put, Unavailable

CHANNEL_OPTIONS = {"grpc.initial_reconnect_backoff_ms": 100, "grpc.min_reconnect_backoff_ms": 100,
                   "grpc.max_reconnect_backoff_ms": 1000}


def _unavailable_on_error(method):
    """Turn client and gRPC failures into `Unavailable` (compaction into `Compacted`)."""
    @functools.wraps(method)
    async def wrapper(*args, **kwargs):
        try:
            return await method(*args, **kwargs)
        except aetcd_errors.RevisionCompactedError as e:
            raise Compacted(str(e)) from None
        except (aetcd_errors.ClientError, asyncio.TimeoutError, OSError) as e:
            raise Unavailable(str(e) or type(e).__name__) from None
    return wrapper


def _kv(raw) -> KeyValue:
    return KeyValue(raw.key, raw.value, raw.create_revision, raw.mod_revision, raw.lease)


class EtcdKV(KV):
    """One aetcd client; ``timeout`` bounds every unary call (seconds)."""

    def __init__(self, host: str, port: int, timeout: float = 2.0):
        self.host, self.port, self.timeout = host, port, timeout
        self.client = aetcd.Client(host, port, timeout=timeout, options=CHANNEL_OPTIONS)
        self.ops = self.client.transactions
        self.watchers: dict[bytes, aetcd.Client] = {}    # per watched prefix (the first one: self.client)

    def _watcher(self, prefix: bytes) -> aetcd.Client:
        if prefix not in self.watchers:
            self.watchers[prefix] = (aetcd.Client(self.host, self.port, timeout=self.timeout, options=CHANNEL_OPTIONS)
                                     if self.watchers else self.client)
        return self.watchers[prefix]

    @_unavailable_on_error
    async def grant(self, ttl: int) -> tuple[int, int]:
        lease = await self.client.lease(ttl)
        return lease.id, lease.ttl

    @_unavailable_on_error
    async def keepalive(self, lease: int) -> int:
        reply = await self.client.refresh_lease(lease)
        return reply.TTL if reply is not None else 0

    @_unavailable_on_error
    async def revoke(self, lease: int) -> None:
        try:
            await self.client.revoke_lease(lease)
        except aetcd_errors.ClientError as e:
            if "lease not found" not in str(e):
                raise

    @_unavailable_on_error
    async def get_prefix(self, prefix: bytes) -> tuple[int, list[KeyValue]]:
        found = await self.client.get_prefix(prefix)
        return found.header.revision, [_kv(raw) for raw in found.kvs]

    @_unavailable_on_error
    async def txn(self, compares: list[Compare], ops: list[Put | Delete]) -> tuple[bool, int]:
        succeeded, responses = await self.client.transaction(
            compare=[self._compare(c) for c in compares], success=[self._op(op) for op in ops], failure=[])
        if not succeeded:
            return False, 0
        first = responses[0]
        header = first.response_put.header if first.HasField("response_put") else first.response_delete_range.header
        return True, header.revision

    def _compare(self, compare: Compare):
        target = {"create": self.ops.create, "mod": self.ops.mod, "value": self.ops.value}[compare.target]
        return target(compare.key) == compare.value

    def _op(self, op: Put | Delete):
        if isinstance(op, Put):
            return self.ops.put(op.key, op.value, lease=op.lease or None)
        return self.ops.delete(op.key)

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[Event]:
        watch = await _unavailable_on_error(self._watcher(prefix).watch_prefix)(prefix, start_revision=start_revision)
        try:
            events = aiter(watch)
            while True:
                event = await _unavailable_on_error(anext)(events, None)
                if event is None:
                    raise Unavailable("watch stream ended")
                yield Event(event.kind == "DELETE", _kv(event.kv))
        finally:
            try:
                await watch.cancel()
            except (aetcd_errors.ClientError, RuntimeError):
                pass            # the stream is already gone

    async def close(self) -> None:
        for client in {id(c): c for c in [self.client, *self.watchers.values()]}.values():
            try:
                await client.close()
            except (aetcd_errors.ClientError, asyncio.TimeoutError):
                pass
