"""This process's mapping of a node's DRAM arena, its lease validity words and its index.

A client on the same host as the node maps the node's arena once: over the
Unix socket the three memfds (the arena, the lease table's validity words and
the shared index) arrive with the KV.ARENA reply; over TCP the client opens
/proc/<pid>/fd/<fd> for each. Either way a token the node wrote into the
arena proves the mapping is that node's, so a node on another host (where
the pid means nothing) is detected and the wire is used instead.

A node with an SSD tier also names its RocksDB directory, which the client
reads as a follower for values published on SSD alone (client/ssd_reads.py).

The validity words and the index are mapped read-only: the node alone writes
them. A lease's word holds the lease's tag while the lease is live; a copy
made under the lease is whole when the word, read *after* the copy, still
holds the tag (kvstore/local/leases.py explains the ordering). The index says where
each DRAM value is (client/shared_index.py). A dead node clears neither, so
the connection that asked for KV.ARENA stays open with the mapping: while it
is, the node that wrote them is alive (`node_alive`).
"""
from __future__ import annotations

import mmap
import os
from collections import deque

import numpy as np

from client.connection import Connection
from client.errors import FastPathUnavailable, KVError
from client.shared_index import SharedIndexView
from client.sockets import Endpoint
from client.ssd_reads import SSDReads
from proto import fastpath as fp
from proto import hugepages


PAGE = 4096                      # shared memory's page here: no huge pages for shmem on these hosts
WALK_MIN = 512 * 1024            # copies this large load one byte a page first (`_walk`) ...
WALKED_RECENTLY = 4              # ... unless one of the last ranges walked: still cached, its pages mapped


class Arena:
    """The node's arena and validity words, mapped here.

    The node faulted the arena's pages in, but this process's page tables
    start empty, and a first touch costs ~2 us a page (a 4 MiB put into a
    fresh extent would spend 2 ms faulting): MAP_POPULATE maps them all at once.

    A copy of a block that is not in any cache streams within a 4 KiB page,
    but each new page starts with a TLB miss (a nested page walk in a virtual
    machine) and a cache miss that the hardware prefetcher, which stops at
    page boundaries, does not hide: one after another, 256 times a MiB. Loading
    one byte of every page first (`_walk`) issues those misses together, as
    independent loads overlap, so the copy that follows streams. Measured
    here, alternating with plain copies: a copy out of the arena of 1 MiB
    81 -> 64 us, 4 MiB 432 -> 353 us; into a fresh extent 1 MiB 107 -> 102 us,
    4 MiB 437 -> 396 us; under 512 KiB the walk costs more than it saves,
    and so it does for a range walked a moment ago (a block read again and
    again is still in cache: 2-4 us on a 31 us copy).
    """

    def __init__(self, fd: int, size: int, token: bytes, words_fd: int, n_words: int,
                 index: SharedIndexView, conn: Connection):
        self.token = token
        self.index = index
        self.ssd: SSDReads | None = None     # the node's SSD tier read here (client/ssd_reads.py), if any
        self._conn = conn
        huge = hugepages.wanted()                            # advise before faulting in, then populate
        flags = mmap.MAP_SHARED | (0 if huge else getattr(mmap, "MAP_POPULATE", 0))
        self._map = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        self.size = size
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.hugepages = hugepages.advise(self._map) if huge else "off"
        if huge:
            hugepages.populate(self._map, self.array)
        self._words_map = mmap.mmap(words_fd, n_words * 8, mmap.MAP_SHARED, mmap.PROT_READ)
        self._words = np.frombuffer(self._words_map, dtype=np.uint64)
        self._walked: deque[int] = deque(maxlen=WALKED_RECENTLY)

    def read_into(self, offset: int, size: int, dest: memoryview) -> None:
        self._walk(offset, size)
        np.copyto(np.frombuffer(dest, np.uint8, size), self.array[offset:offset + size])

    def write(self, offset: int, src: memoryview) -> None:
        self._walk(offset, src.nbytes)
        np.copyto(self.array[offset:offset + src.nbytes], np.frombuffer(src, np.uint8))

    def _walk(self, offset: int, size: int) -> None:
        """Load a byte of each page of a large range about to be copied (see the class comment).
        Only a hint: threads racing on ``_walked`` cost at most a walk too many or too few."""
        if size < WALK_MIN or offset in self._walked:
            return
        self._walked.append(offset)
        self.array[offset:offset + size:PAGE].tobytes()

    def view(self, offset: int, size: int) -> np.ndarray:
        return self.array[offset:offset + size]

    def still_valid(self, word: int, tag: int) -> bool:
        """Whether the lease of ``word``/``tag`` is live: read after the copy made under it."""
        return word >= 0 and int(self._words[word]) == tag

    def node_alive(self) -> bool:
        """Whether the node that mapped this arena still runs (its KV.ARENA connection is open)."""
        return not self._conn.peer.closed()

    def close(self) -> None:
        """Close the mapping's connection; the memory goes with the last reference."""
        self._conn.close()
        if self.ssd is not None:
            self.ssd.close()


def attach(endpoint: Endpoint, password: str | None, timeout: float | None) -> Arena:
    """Map the arena of the node at ``endpoint``; FastPathUnavailable says why not."""
    conn = Connection(endpoint, timeout, password)
    try:
        arena = _map(conn, endpoint)
    except BaseException:
        conn.close()
        raise
    return arena


def _map(conn: Connection, endpoint: Endpoint) -> Arena:
    """Ask ``conn`` for the arena and map it; the mapping keeps ``conn`` open."""
    replies, fds = conn.round_trip_fds([(fp.KV_ARENA,)])
    reply = replies[0]
    try:
        if isinstance(reply, KVError):
            raise FastPathUnavailable(f"{endpoint} has no fast path: {reply}")
        try:
            (size, pid, fd_number, token_offset, token, _, words_fd_number, n_words,
             index_fd_number, buckets, ssd_dir) = reply
        except (TypeError, ValueError):
            raise FastPathUnavailable(f"{endpoint} answered {fp.KV_ARENA} with {reply!r:.80}") from None
        if not fds:
            for number in (fd_number, words_fd_number, index_fd_number):
                fds.append(_open_proc_fd(pid, number, endpoint))
        try:
            arena = Arena(fds[0], size, bytes(token), fds[1], n_words, SharedIndexView(fds[2], buckets), conn)
        except (OSError, ValueError, IndexError) as exc:
            raise FastPathUnavailable(f"cannot map the arena of {endpoint}: {exc}") from exc
    finally:
        for fd in fds:
            os.close(fd)
    if bytes(arena.view(token_offset, len(token))) != bytes(token):
        raise FastPathUnavailable(f"{endpoint} is not on this host (its arena token does not match)")
    if ssd_dir:
        arena.ssd = SSDReads(bytes(ssd_dir).decode())     # opened at the first value read from SSD
    return arena


def _open_proc_fd(pid: int, fd_number: int, endpoint: Endpoint) -> int:
    try:
        return os.open(f"/proc/{pid}/fd/{fd_number}", os.O_RDWR)
    except OSError as exc:
        raise FastPathUnavailable(f"cannot open the arena of {endpoint} through /proc: {exc}") from exc
