"""The part of etcd's API that cluster membership uses, as one small interface.

Membership needs six things from its store: leases (grant, keep alive,
revoke), a prefix read with its revision, a transaction of equality compares
and puts/deletes, and a prefix watch that starts at a revision. `EtcdKV`
(etcd_kv.py) speaks them to a real etcd through aetcd; `FakeEtcd`
(fake_etcd.py) implements the same semantics in process, on the event loop's
clock, for tests and simulations. Membership logic is written once against
this interface, so a simulation runs the very code a node runs.

Failures are two exceptions: `Unavailable` (etcd cannot be reached: keep the
last state, retry) and `Compacted` (a watch asked for history etcd no longer
has: read everything again).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass


class Unavailable(Exception):
    """etcd did not answer (down, partitioned, timed out)."""


class Compacted(Exception):
    """A watch's start revision is older than etcd's history."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int          # for a delete event: the revision of the delete
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Event:
    deleted: bool
    kv: KeyValue


@dataclass(frozen=True, slots=True)
class Compare:
    """``target`` of ``key`` equals ``value``: target is "create", "mod" (revisions) or "value"."""
    target: str
    key: bytes
    value: int | bytes


@dataclass(frozen=True, slots=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: bytes


class KV(ABC):
    """An etcd-like store; every method may raise `Unavailable`."""

    @abstractmethod
    async def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease: ``(lease id, granted ttl in seconds)`` (etcd may raise a too-small ttl)."""

    @abstractmethod
    async def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; its remaining ttl, 0 or less when it has expired."""

    @abstractmethod
    async def revoke(self, lease: int) -> None:
        """End ``lease`` now, deleting its keys."""

    @abstractmethod
    async def get_prefix(self, prefix: bytes) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` and the store's revision when read."""

    @abstractmethod
    async def txn(self, compares: list[Compare], ops: list[Put | Delete]) -> tuple[bool, int]:
        """Apply ``ops`` atomically if every compare holds: ``(succeeded, revision)``."""

    @abstractmethod
    def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[Event]:
        """Events under ``prefix`` from ``start_revision`` on; raises `Unavailable` or `Compacted` when it ends."""

    @abstractmethod
    async def close(self) -> None:
        """Drop the connection (leases are not revoked: they expire)."""
