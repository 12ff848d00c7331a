"""Leases and reservations: what local clients hold while they copy through the arena.

A local client reads a value by copying it straight out of its own mapping of
the DRAM arena, and writes one by copying into an extent reserved for it. The
node must keep those bytes in place meanwhile, yet a client may die or hang at
any moment, so everything it holds is a record here with an id, an owner
connection and a deadline:

- a *lease* pins a value (the engine's read lease: eviction skips it, and a
  delete or overwrite frees the bytes only after the last unlease). It ends
  when the client releases it, when its deadline passes (the cron), or when
  its owner connection closes. Release answers whether the lease was still
  valid, so a client whose lease ended mid-copy knows its copy may be torn
  and retries; a release that arrives after the deadline is answered "not
  valid" even when the cron has not run yet.
- a *reservation* is an uncommitted extent a client writes into. Publishing
  commits it under a key; otherwise it is given back on expiry or on close.
  Reservations live longer than leases (30 s by default): a writer that is
  still copying when its reservation is reclaimed would scribble on bytes that
  may belong to another value by then, so the client refuses to start a copy
  into a reservation with less than half of its life left.

Validity words: a client may keep a lease after its copy and copy again
from the same extent later (a cached lease), with no round trip, because each
lease also owns one 8-byte word in a small shared control area
(`ValidityWords`: a second memfd the client maps read-only, as it maps the
arena). The word holds the lease's tag while the lease is live and is set to
0 *before* the lease's bytes are let go, in every way a lease ends: released,
expired, its owner connection closed, or its value leaving the index
(deleted, overwritten, evicted, expired or flushed: the engine's drop
listener, `on_drop`). A leased DRAM value is never moved or rewritten in
place meanwhile (the engine pins it: no eviction, no demotion, no in-place
overwrite), so while the word holds the tag the bytes at the lease's offset
are the key's current value.

The client copies first and reads the word after. On x86 (TSO) loads are not
reordered with older loads, and stores are seen by every core in the order
they were made. The node's stores go: clear the word, then (only after that)
free the extent, which a later writer may fill. So a copy that read any byte
written after the clear is followed by a word load that sees the clear, and
a word that still holds the tag after the copy proves every byte copied
belonged to the leased value. Tags come from a counter, never reused, so a
word recycled for a new lease never matches an old one. When the node runs
out of words a lease gets word -1 and the client falls back to asking (a
release answers whether the lease was still valid).

Ids are random 63-bit integers, so one client cannot release another's lease
by guessing. The server makes one table (`Server.leases`), puts its expiry
on the cron and its drop listener on the engine, and the table counts what
happened for KV.LEASES and INFO.
"""
from __future__ import annotations

import itertools
import mmap
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvstore.store.arena import Extent
from proto.fastpath import VALIDITY_WORDS

ARENA_TOKEN_BYTES = 16


class ValidityWords:
    """The control area: one 8-byte word per live lease, in a memfd local clients map read-only."""

    def __init__(self, count: int = VALIDITY_WORDS):
        self.count = count
        self.fd = os.memfd_create("kvstore-leases", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, count * 8)
        self._map = mmap.mmap(self.fd, count * 8, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.words = np.frombuffer(self._map, dtype=np.uint64)
        self._free = list(range(count - 1, -1, -1))
        self._tags = itertools.count(1)

    def take(self) -> tuple[int, int]:
        """A free word set to a fresh tag: (index, tag); (-1, 0) when every word is in use."""
        if not self._free:
            return -1, 0
        index, tag = self._free.pop(), next(self._tags)
        self.words[index] = tag
        return index, tag

    def clear(self, index: int) -> None:
        """Mark the lease of word ``index`` ended: done before its bytes are let go."""
        if index >= 0:
            self.words[index] = 0
            self._free.append(index)

    @property
    def in_use(self) -> int:
        return self.count - len(self._free)


@dataclass(slots=True)
class Lease:
    id: int
    owner: int
    deadline: float
    nbytes: int
    unpin: Callable[[], None]
    still_valid: Callable[[], bool] | None = None    # a further check (GPU values) made at release
    entry: int | None = None                          # ended when this engine entry is dropped
    word: int = -1                                   # its validity word, -1 when none was free
    tag: int = 0


@dataclass(slots=True)
class Reservation:
    id: int
    owner: int
    deadline: float
    extent: Extent


@dataclass
class LeaseStats:
    leases_granted: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    leases_reclaimed: int = 0
    leases_invalid_at_release: int = 0
    leases_invalidated: int = 0                      # ended because their value left the index
    reservations_granted: int = 0
    reservations_published: int = 0
    reservations_cancelled: int = 0
    reservations_expired: int = 0
    reservations_reclaimed: int = 0


@dataclass
class LeaseTable:
    """Every lease and reservation of one node, by id and by owner connection."""

    engine: object
    words: ValidityWords = field(default_factory=ValidityWords)
    leases: dict[int, Lease] = field(default_factory=dict)
    reservations: dict[int, Reservation] = field(default_factory=dict)
    stats: LeaseStats = field(default_factory=LeaseStats)
    _by_owner: dict[int, set[int]] = field(default_factory=dict)
    _watched: set[int] = field(default_factory=set)
    _by_entry: dict[int, set[int]] = field(default_factory=dict)

    # ------------------------------------------------------------ leases

    def grant(self, conn, nbytes: int, ttl_ms: int, unpin: Callable[[], None],
              still_valid: Callable[[], bool] | None = None, entry: int | None = None) -> Lease:
        """A lease with a validity word; with ``entry`` it also ends when that entry is dropped."""
        word, tag = self.words.take()
        lease = Lease(self._new_id(), self._watch(conn), time.monotonic() + ttl_ms / 1000, nbytes,
                      unpin, still_valid, entry, word, tag)
        self.leases[lease.id] = lease
        self._by_owner[lease.owner].add(lease.id)
        if entry is not None:
            self._by_entry.setdefault(entry, set()).add(lease.id)
        self.stats.leases_granted += 1
        return lease

    def release(self, lease_id: int) -> bool:
        """End a lease; True when it was valid until now (the copy made under it is whole)."""
        lease = self.leases.get(lease_id)
        if lease is None:
            self.stats.leases_invalid_at_release += 1
            return False
        valid = time.monotonic() < lease.deadline and (lease.still_valid is None or lease.still_valid())
        self._drop_lease(lease)
        self.stats.leases_released += 1
        if not valid:
            self.stats.leases_invalid_at_release += 1
        return valid

    def on_drop(self, entry: int, key: bytes) -> None:
        """Engine drop listener: the value of ``entry`` is leaving the index; end its leases."""
        for lease_id in self._by_entry.pop(entry, ()):
            self._drop_lease(self.leases[lease_id])
            self.stats.leases_invalidated += 1

    # ------------------------------------------------------------ reservations

    def reserve(self, conn, size: int, ttl_ms: int) -> Reservation:
        """A fresh extent of ``size`` bytes for ``conn`` to write (OutOfMemory when none)."""
        extent = self.engine.reserve(size, owner=conn.user.tenant)
        reservation = Reservation(self._new_id(), self._watch(conn), time.monotonic() + ttl_ms / 1000, extent)
        self.reservations[reservation.id] = reservation
        self._by_owner[reservation.owner].add(reservation.id)
        self.stats.reservations_granted += 1
        return reservation

    def take(self, reservation_id: int) -> Reservation | None:
        """Remove a live reservation to publish it; None when unknown or expired."""
        reservation = self.reservations.pop(reservation_id, None)
        if reservation is None:
            return None
        self._forget(reservation.owner, reservation_id)
        if time.monotonic() >= reservation.deadline:
            self.engine.release(reservation.extent)
            self.stats.reservations_expired += 1
            return None
        return reservation

    def published(self) -> None:
        self.stats.reservations_published += 1

    def cancel(self, reservation_id: int) -> bool:
        reservation = self.take(reservation_id)
        if reservation is None:
            return False
        self.engine.release(reservation.extent)
        self.stats.reservations_cancelled += 1
        return True

    # ------------------------------------------------------------ reclamation

    def expire(self) -> None:
        """Cron: end leases and reservations whose deadline has passed."""
        now = time.monotonic()
        for lease in [x for x in self.leases.values() if x.deadline <= now]:
            self._drop_lease(lease)
            self.stats.leases_expired += 1
        for reservation in [r for r in self.reservations.values() if r.deadline <= now]:
            self._drop_reservation(reservation)
            self.stats.reservations_expired += 1

    def on_close(self, conn) -> None:
        """The owner connection is gone: give back all it held."""
        self._watched.discard(conn.id)
        for item_id in self._by_owner.pop(conn.id, ()):
            if item_id in self.leases:
                self._drop_lease(self.leases[item_id])
                self.stats.leases_reclaimed += 1
            elif item_id in self.reservations:
                self.engine.release(self.reservations.pop(item_id).extent)
                self.stats.reservations_reclaimed += 1

    def info(self) -> dict[str, int]:
        """Counters for KV.LEASES and INFO."""
        return {"leases_active": len(self.leases),
                "leased_bytes": sum(x.nbytes for x in self.leases.values()),
                "lease_words_in_use": self.words.in_use,
                "reservations_active": len(self.reservations),
                "reserved_bytes": sum(r.extent.size for r in self.reservations.values()),
                **vars(self.stats)}

    # ------------------------------------------------------------ internals

    def _drop_lease(self, lease: Lease) -> None:
        """End a lease: its word is cleared before its bytes are let go (see the module comment)."""
        del self.leases[lease.id]
        self._forget(lease.owner, lease.id)
        if lease.entry is not None:
            on_entry = self._by_entry.get(lease.entry)
            if on_entry is not None:
                on_entry.discard(lease.id)
                if not on_entry:
                    del self._by_entry[lease.entry]
        self.words.clear(lease.word)
        lease.unpin()

    def _drop_reservation(self, reservation: Reservation) -> None:
        del self.reservations[reservation.id]
        self._forget(reservation.owner, reservation.id)
        self.engine.release(reservation.extent)

    def _new_id(self) -> int:
        while True:
            item_id = secrets.randbits(63) or 1
            if item_id not in self.leases and item_id not in self.reservations:
                return item_id

    def _watch(self, conn) -> int:
        """Register the close callback once per connection; returns the owner id."""
        if conn.id not in self._watched:
            self._watched.add(conn.id)
            self._by_owner.setdefault(conn.id, set())
            conn.close_callbacks.append(self.on_close)
        return conn.id

    def _forget(self, owner: int, item_id: int) -> None:
        owned = self._by_owner.get(owner)
        if owned is not None:
            owned.discard(item_id)


def claim_arena_identity(engine) -> tuple[int, bytes]:
    """Write a random token into a small extent of the arena: (offset, token).

    A client proves its mapping is of this node's current arena by finding the
    token at the offset; a node that restarted has a new arena and a new token,
    so a client still holding the old mapping is told to map again (STALEARENA)
    instead of being handed offsets into memory the node no longer shares.
    """
    extent = engine.reserve(ARENA_TOKEN_BYTES)
    token = secrets.token_bytes(ARENA_TOKEN_BYTES)
    extent.view[:] = token
    extent.committed = True
    return extent.offset, token
