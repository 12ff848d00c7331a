"""Gets through the node's arena: held leases, then the shared index, then KV.LEASE; one
memcpy a value.

- A get of a key whose lease the client holds (`lease_cache`) is a memcpy
  from the mapping and a look at the lease's validity word, with no round
  trip at all. The word holds the lease's tag while the lease is live
  (kvstore/local/leases.py), and the node clears it before it lets the bytes go,
  so a word read *after* the copy that still holds the tag proves the copy
  whole and current. A node that died cannot clear its words, but its death
  closes the connection that took the lease: a lease is used only while that
  connection is open, so a restarted node's client never reads the dead
  node's bytes.
- A get of any other key the node has in DRAM is found in the node's shared
  index (`shared_index`): a lookup, a memcpy and a second look at the
  bucket's sequence word, again with no round trip; the copy is trusted
  while the connection that mapped the arena is open. The reads are
  reported to the node with the next request (KV.TOUCH), so they count as
  hits there.
- A blocking ``get_into`` of one key first tries both with no operation
  built at all (`get_into_here`): its whole cost is then the copy and a
  few microseconds of Python.
- The rest (a key not in DRAM, not published, or changing under the copy)
  are leased (``KV.LEASE``, carrying the token of the mapping: STALEARENA
  after a restart), copied, and their words read after the copy; a lease
  that ended during the copy is taken again (`LEASE_RETRIES` times, then
  `LeaseExpired`). A lease that got no validity word (the node ran out) is
  released at once, and the release reply says whether it stayed valid. The
  node says how long a lease may be kept (half its TTL; 0 for a key with an
  expiry); kept leases and the releases of the others ride along with the
  next request.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Any

from client.arena import Arena
from client.buffers import Key, key_bytes, writable_view
from client.errors import BufferTooSmall, LeaseExpired
from client.fastpath import LEASE_RETRIES, REMAPPED, Detour, FastPath
from client.lease_cache import HeldLease
from client.operations import Call, LocalRead
from client.steps import THREAD_COPY_MIN, Local, RoundTrip, Steps
from proto import fastpath as fp

ASK_NODE = Detour("no held lease or published value serves this get: run the whole operation")


def read(core, call: Call) -> Steps:
    """A get or a batch of gets: what held leases and the shared index serve, then the rest
    leased on a connection."""
    fast, local = core.fast, call.local
    fast.stats.reads += 1
    if core.offloading and core.offloads(_copy_bound(fast, local)):
        outcome = yield Local(partial(read_local, fast, local))
    else:                                          # a first or warm get's whole work: kept lean
        outcome = read_local(fast, local)
    if isinstance(outcome, Detour):
        return outcome
    results, misses, report = outcome
    if misses or report:
        outcome = yield from core.on_connection(partial(_lease_and_copy, core, local, results, misses), True)
        if isinstance(outcome, Detour):
            return outcome
    return call.finish(results)


def read_local(fast: FastPath, local: LocalRead) -> tuple[list[Any], list[int], bool] | Detour:
    """Serve what held leases and the shared index can, with no round trip: the results so
    far, the indices still to lease, and whether reads wait to be reported to the node."""
    keys = [key_bytes(key) for key in local.keys]
    results = [None] * len(keys)
    held = None
    with fast.lock:
        arena, leases = fast.mapping, fast.leases
        if leases:                                 # none held: a first get skips the cache
            fast.give_up(leases.due(time.monotonic()))
            held = [leases.lookup(key) for key in keys]
    misses = list(range(len(keys))) if held is None else read_held(fast, arena, local, keys, held, results)
    if not misses or arena is None or not fast.index_reads:
        return results, misses, False
    return read_indexed(fast, arena, local, keys, misses, results)


def get_into_here(fast: FastPath, key: Key, buffer: Any) -> int | Detour:
    """``get_into`` of one key when a held lease or the shared index serves it, on the calling
    thread: its length; `ASK_NODE` when it takes a round trip (the caller then runs the whole
    operation, whose copy replaces any made here). A first or warm get of a cached block
    thus pays for no operation, transport or step machinery, which on a cold CPU cache
    (a block is read once) costs tens of microseconds of Python.
    """
    arena = fast.mapping
    if arena is None or fast.reports_due():
        return ASK_NODE
    if fast.leases or not fast.index_reads:        # a held lease may serve it: the general way
        outcome = read_local(fast, LocalRead([key], [writable_view(buffer)]))
        if isinstance(outcome, Detour) or outcome[1]:
            return ASK_NODE
        result = outcome[0][0]
    else:                                          # a first get: the index alone, no lists built
        result = from_index(fast, arena, key, writable_view(buffer))
        if result is None:
            return ASK_NODE
        if not arena.node_alive():                 # a dead node's table: map the new node's
            fast.drop_mapping(arena)
            return ASK_NODE
        fast.touched([key_bytes(key)])
    fast.stats.reads += 1
    if isinstance(result, BufferTooSmall):
        raise result
    return result


def read_held(fast: FastPath, arena: Arena, local: LocalRead, keys: list[bytes],
              held: list[HeldLease | None], results: list[Any]) -> list[int]:
    """Copy what held leases vouch for into ``results``; the indices they could not serve."""
    misses, ended = [], []
    for i, lease in enumerate(held):
        if lease is None:
            misses.append(i)
            continue
        results[i] = _copy(arena, local.keys[i], local.views[i], lease.offset, lease.size)
        if arena.still_valid(lease.word, lease.tag) and not lease.peer.closed():
            fast.stats.cached_reads += 1
            continue
        results[i] = None
        ended.append((i, lease))
        misses.append(i)
    if ended:
        with fast.lock:
            for i, lease in ended:
                if fast.leases.forget(keys[i], lease):
                    fast.give_up([lease.lease_id])      # an ended lease answers 0: harmless
    return misses


def read_indexed(fast: FastPath, arena: Arena, local: LocalRead, keys: list[bytes],
                 misses: list[int], results: list[Any]) -> tuple[list[Any], list[int], bool] | Detour:
    """Copy what the shared index finds into ``results`` (client/shared_index.py: find, copy,
    check the bucket, check the node lives): the results, the indices still missing, and
    whether reads wait to be reported."""
    left, served = [], []
    for i in misses:
        result = from_index(fast, arena, local.keys[i], local.views[i])
        if result is None:
            left.append(i)
        else:
            results[i] = result
            served.append(keys[i])
    if not served:
        return results, left, False
    if not arena.node_alive():                 # a dead node's table: map the new node's
        return fast.drop_mapping(arena)
    return results, left, fast.touched(served)


def from_index(fast: FastPath, arena: Arena, key: Key, view: memoryview | None) -> Any:
    """Copy the value the shared index shows for ``key`` (client/shared_index.py: find, copy,
    check the bucket): its result as `_copy` makes it, or None when the index does not show it
    or it changed under the copy. The caller then checks that the node lives."""
    index = arena.index
    found = index.find(key_bytes(key))
    if found is None:
        return None
    at, seq, offset, size = found
    if offset & fp.INDEX_ON_SSD:
        return _from_ssd(fast, arena, key, view, found)
    if offset + size <= arena.size:
        result = _copy(arena, key, view, offset, size)
        if index.unchanged(at, seq):
            return result
    fast.stats.index_races += 1
    return None


def _from_ssd(fast: FastPath, arena: Arena, key: Key, view: memoryview | None,
              found: tuple[int, int, int, int]) -> Any:
    """`from_index` for a value the index shows on SSD alone: read from the node's RocksDB
    files here (client/ssd_reads.py), then the same check of the bucket."""
    at, seq, offset, size = found
    if arena.ssd is None or (view is not None and size > view.nbytes):
        return None                                # the node says how large it is, or reads it
    got = arena.ssd.read(key_bytes(key), size, offset & fp.INDEX_TAG_MASK, view)
    if got is None or not arena.index.unchanged(at, seq):
        return None
    fast.stats.ssd_reads += 1
    return got


def _copy_bound(fast: FastPath, local: LocalRead) -> int:
    """At most how many bytes will be copied with no round trip: the destinations' sizes when
    the caller gave them (a larger value is not copied), else the sizes of the leases held
    and of the values the shared index shows. A value read from SSD counts as at least
    `THREAD_COPY_MIN`: a read that misses the page cache waits on the disk, which the
    asyncio transport never does on its loop."""
    arena = fast.mapping
    reads_ssd = arena is not None and arena.ssd is not None and fast.index_reads
    if None not in local.views and not reads_ssd:
        return sum(view.nbytes for view in local.views)
    with fast.lock:
        held = [fast.leases.lookup(key_bytes(key)) for key in local.keys]
    bound = sum(lease.size for lease in held if lease is not None)
    if arena is not None and fast.index_reads:
        for key, lease in zip(local.keys, held):
            if lease is None and (found := arena.index.find(key_bytes(key))) is not None:
                bound += max(found[3], THREAD_COPY_MIN) if found[2] & fp.INDEX_ON_SSD else found[3]
    return bound


def _lease_and_copy(core, local: LocalRead, results: list[Any], misses: list[int], conn) -> Steps:
    """Lease the values still missing, copy them, and check the copies; ``results`` when done.
    With nothing missing, the round trip only reports reads (and releases)."""
    fast = core.fast
    arena = fast.mapping
    if arena is None:
        return REMAPPED
    if not misses:
        yield RoundTrip(fast.housekeeping())
        return results
    for _ in range(LEASE_RETRIES):
        started = time.monotonic()
        lease = (fp.KV_LEASE, arena.token, fast.lease_ttl_ms, *(local.keys[i] for i in misses))
        entries = (yield RoundTrip([*fast.housekeeping(), lease]))[-1]
        if (detour := fast.detour(entries)) is not None:
            return detour
        copy = partial(_copy_leased, fast, arena, local, misses, entries, results, started, conn.peer)
        misses, unchecked = yield from core.copy(copy, _nbytes(entries))
        if unchecked:
            valid = (yield RoundTrip([(fp.KV_RELEASE, *(lease_id for _, lease_id in unchecked))]))[0]
            misses += [i for (i, _), still in zip(unchecked, valid) if not still]
        if not misses:
            return results
        fast.stats.lease_retries += 1
    raise LeaseExpired(f"leases expired during {LEASE_RETRIES} copies in a row")


def _copy_leased(fast: FastPath, arena: Arena, local: LocalRead, indices: list[int], entries: list,
                 results: list[Any], started: float, peer) -> tuple[list[int], list[tuple[int, int]]]:
    """Copy freshly leased values into ``results``; the indices whose lease ended during the
    copy (to lease again), and (index, lease id) pairs without a word (to release and check)."""
    retry, unchecked, keep, done = [], [], [], []
    for i, entry in zip(indices, entries):
        if entry is None:
            results[i] = None
            continue
        lease_id, offset, size, word, tag, hold_ms = entry
        results[i] = _copy(arena, local.keys[i], local.views[i], offset, size)
        if word < 0:
            unchecked.append((i, lease_id))
        elif not arena.still_valid(word, tag):
            retry.append(i)
        elif hold_ms > 0:
            use_until = started + hold_ms / 1000
            keep.append((key_bytes(local.keys[i]), HeldLease(lease_id, offset, size, word, tag, use_until, peer)))
        else:
            done.append(lease_id)
    with fast.lock:
        fast.give_up(done)
        if fast.mapping is arena:
            for key, held in keep:
                fast.give_up(fast.leases.keep(key, held))
    return retry, unchecked


def _copy(arena: Arena, key: Key, view: memoryview | None, offset: int, size: int) -> Any:
    """Copy a value into ``view`` (its length), or into a new bytearray when there is none
    (the bytearray); BufferTooSmall, copying nothing, when it does not fit."""
    if view is None:
        out = bytearray(size)
        arena.read_into(offset, size, memoryview(out))
        return out
    if size > view.nbytes:
        return BufferTooSmall(key, size, view.nbytes)
    arena.read_into(offset, size, view)
    return size


def _nbytes(entries: list) -> int:
    return sum(e[2] for e in entries if e is not None)
