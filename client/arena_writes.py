"""Puts through the node's arena: a reserved extent, one memcpy, and KV.PUBLISH.

A put copies each value into an extent reserved for it: a spare reserved
ahead by an earlier put of the same size on the same connection
(`reservation_pool`), or else a fresh one (``KV.RESERVE``, carrying the
token of the mapping: STALEARENA after a restart, before any byte is
written). One round trip then commits the values under their keys and
reserves the spares for the next put: ``KV.PUBLISH ... NEXT`` for each value
whose size wants a spare (one command a put, not a publish and a reserve to
parse and dispatch), one ``KV.MPUBLISH`` for the rest of a batch (one command,
not one a value). A reservation is written only while at least half of its
life is left; a copy that took longer, or a copy that failed, gives the
extents back at once (else they would stay reserved until their deadline)
and fails.

Puts smaller than `FAST_PUT_MIN` in all go over the wire, where one round
trip is cheaper.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from typing import Any

from client.arena import Arena
from client.errors import KVError, TimeoutError
from client.fastpath import REMAPPED, FastPath
from client.operations import Call, LocalWrite, put_options
from client.reservation_pool import Spare
from client.steps import RoundTrip, Steps
from proto import fastpath as fp

FAST_PUT_MIN = 256 * 1024        # a put of fewer bytes in all goes over the wire


def worth_writing(local: LocalWrite) -> bool:
    """Whether the arena beats the wire for this put (no empty values: an extent has a size)."""
    return local.nbytes >= FAST_PUT_MIN and all(view.nbytes for view in local.views)


def write(core, call: Call) -> Steps:
    """A put or a batch of puts, on one connection (the owner of its spares)."""
    return (yield from core.on_connection(partial(_reserve_copy_publish, core, call), call.idempotent))


@dataclass
class PublishRound:
    """The requests that publish a put or a batch (after any releases riding along): one
    KV.MPUBLISH for the values that reserve nothing ahead, then one KV.PUBLISH ... NEXT for each
    value whose size the next put will want a spare of."""

    requests: list[tuple]
    first: int                       # index of the first publishing request
    batched: list[int]               # the values KV.MPUBLISH commits, in order
    ahead: list[tuple[int, int]]     # (value, size) of each KV.PUBLISH ... NEXT, in order
    started: float

    def settle(self, fast: FastPath, replies: list, owner: Any) -> list:
        """One reply per value, in the values' order; the spares NEXT reserved go to the pool."""
        stored: list[Any] = [None] * (len(self.batched) + len(self.ahead))
        at = self.first
        if self.batched:
            many = replies[at]
            at += 1
            for i, reply in zip(self.batched, many if isinstance(many, list) else repeat(many)):
                stored[i] = reply
        spares = []
        for (i, size), reply in zip(self.ahead, replies[at:]):
            stored[i] = reply if isinstance(reply, KVError) else reply[0]
            if not isinstance(reply, KVError) and not isinstance(reply[1], KVError):    # NOSPARE: none
                spares += _spares_of(fast, [reply[1]], [size], self.started, owner)
        if spares:
            with fast.lock:
                fast.spares.add(spares)
        return stored


def _reserve_copy_publish(core, call: Call, conn) -> Steps:
    fast, local = core.fast, call.local
    arena = fast.mapping
    if arena is None:
        return REMAPPED
    spares = _take_spares(fast, local, conn)
    if None in spares:
        started = time.monotonic()
        sizes = [view.nbytes for view, spare in zip(local.views, spares) if spare is None]
        reply = (yield RoundTrip([*fast.housekeeping(), _reserve_request(fast, arena, sizes)]))[-1]
        if (detour := fast.detour(reply)) is not None:
            return detour
        missing = [i for i, spare in enumerate(spares) if spare is None]
        for i, spare in zip(missing, _spares_of(fast, reply, sizes, started, conn)):
            spares[i] = spare
    try:
        sent = yield from core.copy(partial(_copy_and_publish, fast, arena, local, spares, conn), local.nbytes)
    except Exception:                            # a source buffer that failed under the copy
        yield _unreserve(spares)
        raise
    if sent is None:
        yield _unreserve(spares)
        raise TimeoutError("the copy into reserved extents took longer than half their lifetime")
    return call.finish(sent.settle(fast, (yield RoundTrip(sent.requests)), conn))


def _unreserve(spares: list[Spare]) -> RoundTrip:
    """Give back reservations that will not be published (nothing was committed from them)."""
    return RoundTrip([(fp.KV_UNRESERVE, *(spare.reservation_id for spare in spares))])


def _take_spares(fast: FastPath, local: LocalWrite, owner: Any) -> list[Spare | None]:
    """A spare reservation for each value where the pool has one reserved on ``owner``."""
    now = time.monotonic()
    with fast.lock:
        spares = [fast.spares.take(view.nbytes, now, owner) for view in local.views]
    fast.stats.pooled_writes += sum(spare is not None for spare in spares)
    return spares


def _reserve_request(fast: FastPath, arena: Arena, sizes: list[int]) -> tuple:
    return (fp.KV_RESERVE, arena.token, fast.reservation_ttl_ms, *sizes)


def _spares_of(fast: FastPath, reply: list, sizes: list[int], started: float, owner: Any) -> list[Spare]:
    use_until = started + fast.reservation_ttl_ms / 2000
    return [Spare(rid, offset, size, use_until, owner) for (rid, offset), size in zip(reply, sizes)]


def _copy_and_publish(fast: FastPath, arena: Arena, local: LocalWrite, spares: list[Spare],
                      owner: Any) -> PublishRound | None:
    """Copy the values into their reservations; the round trip that publishes them and
    reserves the next put's spares, or None when a reservation is too old to write into
    safely (the caller gives them back)."""
    for spare, view in zip(spares, local.views):
        if time.monotonic() > spare.use_until:
            return None
        arena.write(spare.offset, view)
    fast.stats.writes += 1
    return _publish_round(fast, local, spares, owner)


def _publish_round(fast: FastPath, local: LocalWrite, spares: list[Spare], owner: Any) -> PublishRound:
    """The round trip after the copies: what rides along, the publishes, the trailing requests."""
    before = fast.housekeeping()
    sizes = [view.nbytes for view in local.views]
    with fast.lock:
        ahead = _reserving_ahead(sizes, fast.spares.wanted(sizes, owner))
    batched = [i for i, size in enumerate(ahead) if size is None]
    nexts = [(i, size) for i, size in enumerate(ahead) if size is not None]
    many = [(fp.KV_MPUBLISH, "OVERWRITE" if local.overwrite else "NX",
             *(arg for i in batched for arg in (spares[i].reservation_id, local.keys[i], local.parents[i] or "")))
            ] if batched else []
    singles = [(fp.KV_PUBLISH, spares[i].reservation_id, local.keys[i],
                *put_options(local.parents[i], local.overwrite), "NEXT", fast.reservation_ttl_ms) for i, _ in nexts]
    requests = [*before, *many, *singles, *local.trailing]
    return PublishRound(requests, len(before), batched, nexts, time.monotonic())


def _reserving_ahead(sizes: list[int], wanted: list[int]) -> list[int | None]:
    """Per value put, the size its publish reserves ahead with NEXT (the last values of each
    wanted size), or None."""
    ahead: list[int | None] = [None] * len(sizes)
    for i in range(len(sizes) - 1, -1, -1):
        if sizes[i] in wanted:
            wanted.remove(sizes[i])
            ahead[i] = sizes[i]
    return ahead
