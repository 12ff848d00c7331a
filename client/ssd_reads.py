"""Reads of a local node's SSD tier straight from its files, with no round trip.

A value the node keeps only on SSD costs a get through the node a round trip,
a read on one of the node's threads, a copy into the arena and the client's
copy out of it. So the node publishes such values in its shared index too
(client/shared_index.py), not with an arena offset but with a *tag*: the low
63 bits of the xxh3-64 of the value's payload as stored (a plain payload is
the value's bytes; a compressed one is never published). A local client opens
the node's RocksDB directory as a *secondary* instance (RocksDB's read-only
follower: it reads the primary's files, never writes them, and sees new files
after `try_catch_up_with_primary`), reads the key's index record there (the
payload's segment, offset, length and xxh3: kvstore/tiers/segments.py), and
reads the payload with one ``preadv`` from the segment file straight into
the destination.

Why the bytes can be trusted. The payload is what the segment file held where
the record said, of the right size, and it hashes to the tag the node
published for the key's current value; any other payload (an older value of
the key, a record deleted, moved by a reclaim or not yet visible to the
secondary) fails the check and the get asks the node instead. The caller then
checks that the bucket did not change under the read
(`SharedIndexView.unchanged`) and that the node lives, as for a DRAM value:
the node retracts the bucket before the value changes or goes, so a copy that
passes both was the key's value while it was read. The hash also verifies
the bytes, as the node's own read would.

A secondary sees what the primary's files hold: its SST files, and the
writes in its WAL, which it replays into a memtable of its own (at most what
the primary has not flushed yet: index records only).
It does not see writes made since it last caught up: a payload it does not
find, or finds with another tag, makes it catch up (at most every
`CATCH_UP_S`, and less often when catching up takes long) and read once
more. Opening the secondary takes about 10 ms (more with a long WAL to
replay) and happens at the first value read from SSD; if it fails (the
directory is not readable here) the client asks the node for every SSD
value.
"""
from __future__ import annotations

import shutil
import struct
import tempfile
import threading
import time

import os

from proto import fastpath as fp

META_CF = "meta"            # the tier's index records (kvstore/tiers/ssd.py)
SEGMENTS_DIR = "segments"   # its value files (kvstore/tiers/segments.py)
LOCATION = struct.Struct("<IQQQ")   # segment, offset, length, xxh3-64: how an index record begins
MAX_SEGMENT_FDS = 64

CATCH_UP_S = 0.05        # at most one catch-up with the primary this often
MAX_OPEN_FILES = 64      # the follower's table files held open (a file the primary compacted
                         # away since is a failed read: a catch-up, then the node if need be)


class SSDReads:
    """A read-only follower of one node's SSD tier."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._values = None          # the index column family, once opened
        self._fds: dict[int, int] = {}   # segment files open here
        self._db = None
        self._scratch: str | None = None
        self._failed = False
        self._next_catch_up = 0.0
        self._recent = None          # the last payload read, kept alive (see `read`)
        self.reads = self.misses = 0

    def read(self, key: bytes, size: int, tag: int, out=None):
        """The payload of ``key`` when it is the value the index shows (``size`` bytes hashing to
        ``tag``), else None (the caller asks the node): read into ``out`` when given (its
        length is returned; on None ``out`` may hold anything), else into a new bytearray.

        The follower gives the index record (where the payload is in the node's segment
        files); the payload is one ``preadv`` from the file into the destination and an xxh3
        over it, which must match the tag (so a stale record, a payload moved or removed since,
        or damaged bytes are a miss).
        """
        values = self._values if self._values is not None else self.open()
        if values is None:
            return None
        dest = memoryview(out).cast("B") if out is not None else memoryview(bytearray(size))
        if dest.nbytes < size:
            return None
        dest = dest[:size]
        got = self._payload(values, key, size, tag, dest)
        if not got and self._catch_up():
            got = self._payload(values, key, size, tag, dest)
        if not got:
            self.misses += 1
            return None
        self.reads += 1
        return size if out is not None else dest.obj

    def _payload(self, values, key: bytes, size: int, tag: int, dest: memoryview) -> bool:
        try:
            record = values.get(key)
        except Exception:        # RocksDB's status text: a file the primary removed, a closed follower
            return False
        if record is None or len(record) < LOCATION.size:
            return False
        segment, offset, length, digest = LOCATION.unpack_from(record, 0)
        if length != size or digest & fp.INDEX_TAG_MASK != tag:
            return False
        fd = self._segment(segment)
        if fd is None:
            return False
        try:
            if size and os.preadv(fd, [dest], offset) != size:
                return False
        except OSError:
            return False
        return fp.ssd_tag(dest) == tag

    def _segment(self, segment: int) -> int | None:
        """A descriptor of the node's segment file (kept open: a file the node reclaims
        since stays readable through it, and the tag check decides what its bytes are)."""
        fd = self._fds.get(segment)
        if fd is not None:
            return fd
        try:
            fd = os.open(os.path.join(self.path, SEGMENTS_DIR, f"seg-{segment:08d}.kvs"), os.O_RDONLY)
        except OSError:
            return None
        with self._lock:
            if len(self._fds) >= MAX_SEGMENT_FDS:
                oldest = next(iter(self._fds))
                os.close(self._fds.pop(oldest))
            self._fds[segment] = fd
        return fd

    def open(self):
        """Open the follower (at the first value read from SSD: a client that reads none pays
        nothing, neither the ~10 ms nor the memtable a follower replays the primary's WAL into);
        its value column family, or None when it cannot be opened here."""
        with self._lock:
            if self._values is not None or self._failed:
                return self._values
            try:
                from rocksdict import AccessType, Options, Rdict
                self._scratch = tempfile.mkdtemp(prefix="kvstore-ssd-follower-")
                options = Options(raw_mode=True)
                options.set_max_open_files(MAX_OPEN_FILES)
                self._db = Rdict(self.path, options, column_families={
                    name: Options(raw_mode=True) for name in Rdict.list_cf(self.path, Options(raw_mode=True))},
                    access_type=AccessType.secondary(self._scratch))
                self._values = self._db.get_column_family(META_CF)
            except Exception:        # not readable from here, not a RocksDB directory, no rocksdict
                self._failed = True
                self._release()
            return self._values

    def _catch_up(self) -> bool:
        """Let the follower see the primary's newest files; whether it did.

        A catch-up replays what the primary wrote since the last one (its WAL into the
        follower's memtable), so under heavy writes it costs about a copy of every byte
        written: the next may start only `CATCH_UP_S`, or ten times as long as this one
        took, later, which keeps catching up under a tenth of one thread.
        """
        now = time.monotonic()
        with self._lock:
            if self._db is None or now < self._next_catch_up:
                return False
            try:
                self._db.try_catch_up_with_primary()
            except Exception:
                return False
            finally:
                took = time.monotonic() - now
                self._next_catch_up = now + max(CATCH_UP_S, 10 * took)
        return True

    def close(self) -> None:
        with self._lock:
            self._failed = True
            self._release()

    def _release(self) -> None:
        """Let the follower go: with its last reference, never under a read still in it (another
        thread may be inside a get, which holds the column family and so the instance)."""
        self._db = self._values = self._recent = None
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
