"""Value files for the SSD tier: payloads in append-only segments, a RocksDB index.

The WiscKey layout (RocksDB's BlobDB does the same): a value's bytes are
appended to a plain *segment* file and RocksDB keeps only a small index
record under the value's key, saying where the bytes are. A read is one
``os.preadv`` straight into the caller's buffer and an xxh3 of what landed
there; no ``bytes`` object is made on the way. A write is one ``os.pwrite``
from the caller's buffer (both release the GIL) and one small RocksDB put.

Files. ``<dir>/seg-<id:08d>.kvs``, ``id`` a u32 counting up. Each file begins
with ``FILE_HEADER`` (magic ``KVSEG``, version, the id) and then holds
entries, back to back::

    magic     4s  b"KVE1"
    klen      H   length of the key
    pad       H   zero bytes between the key and the payload
    length    Q   payload bytes
    checksum  Q   xxh3-64 of the payload
    key       klen bytes
    (pad)     pad zero bytes: a payload of 16 KiB or more starts on a 4 KiB page
    payload   length bytes

The entry header and key are there for offline inspection and recovery; the
store itself never reads them back (the index says where every payload is).

Index record (the value in RocksDB under the key; ``LOCATION`` then the
caller's own bytes, e.g. the tier's record header)::

    segment   I   segment id
    offset    Q   where the payload starts in the file
    length    Q   payload bytes
    checksum  Q   xxh3-64 of the payload

Write order (what makes ``kill -9`` safe). 1: reserve ``[offset, offset +
entry)`` at the active segment's tail (under a lock, no I/O); 2: ``pwrite``
the entry; 3: with ``sync``, ``fdatasync`` the segment; 4: put the index
record. Nothing refers to the bytes before step 4, so a crash before it
leaves dead bytes in a segment, never an index record without its payload.
A crash after step 2 loses nothing to the page cache (the kernel still
writes it back); a power cut is covered only with ``sync``. Every read checks
the checksum anyway, so a payload torn or corrupted on disk is a miss (and a
log line and a dropped index record), never wrong bytes.

Restart. Opening reads the index records only (to learn each segment's live
bytes) and starts a new segment: it never appends to a tail a crash may have
torn, and it never scans a segment. Segments no index record points to are
removed.

Reclaim. Overwrites and deletes leave dead bytes behind. A segment whose
live fraction falls below ``reclaim_below`` (and that is not the active one)
is rewritten: its live payloads are copied to the active segment (read,
checked, appended) and each index record is moved with a compare-and-set
under the index lock, so a put or delete that raced the copy wins. Then the
file is removed; a reader that already opened it still reads it (the inode
lives until its last descriptor closes), one that had not gets a miss.
``reclaim`` copies at most ``rate_bytes_s`` a second, sleeping between
payloads, so it does not starve the foreground.
"""
from __future__ import annotations

import logging
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import xxhash

log = logging.getLogger(__name__)

FILE_MAGIC = b"KVSEG\x00\x00"
FILE_VERSION = 1
FILE_HEADER = struct.Struct("<7sBQ")          # magic, version, segment id
ENTRY_MAGIC = b"KVE1"
ENTRY_HEADER = struct.Struct("<4sHHQQ")       # magic, klen, pad, length, checksum
LOCATION = struct.Struct("<IQQQ")             # segment, offset, length, checksum
SEGMENT_NAME = re.compile(r"^seg-(\d{8})\.kvs$")
PAGE = 4096
ALIGN_FROM = 16 << 10                         # payloads this large start on a page
DEFAULT_SEGMENT_BYTES = 256 << 20
DEFAULT_RECLAIM_BELOW = 0.5
DEFAULT_RATE_BYTES_S = 256 << 20

# Steps of a write, named for the fault hook (tests stop the process at each).
STEPS = ("reserved", "written", "synced", "indexed")


def segment_name(seg: int) -> str:
    return f"seg-{seg:08d}.kvs"


def checksum(buf) -> int:
    return xxhash.xxh3_64_intdigest(buf)


@dataclass(frozen=True, slots=True)
class Location:
    segment: int
    offset: int
    length: int
    checksum: int

    def pack(self) -> bytes:
        return LOCATION.pack(self.segment, self.offset, self.length, self.checksum)

    @classmethod
    def unpack(cls, raw) -> Location:
        return cls(*LOCATION.unpack_from(raw, 0))


def split_record(raw: bytes) -> tuple[Location, bytes]:
    """An index record as (where the payload is, the caller's extra bytes)."""
    return Location.unpack(raw), bytes(raw[LOCATION.size:])


def read_into(fd: int, loc: Location, buffer, flags: int = 0) -> int | None:
    """Read ``loc``'s payload from an open segment into ``buffer``; None if short or bad.

    One ``preadv`` into the buffer (the GIL is released for the copy out of
    the page cache; ``flags`` as preadv2's) and an xxh3 over the buffer;
    nothing else is allocated.
    """
    view = memoryview(buffer).cast("B")
    if view.nbytes < loc.length:
        raise ValueError(f"buffer of {view.nbytes} bytes for a {loc.length}-byte value")
    dest = view[:loc.length]
    got = os.preadv(fd, [dest], loc.offset, flags) if loc.length else 0
    if got != loc.length or checksum(dest) != loc.checksum:
        return None
    return loc.length


def _pad(tail: int, key: bytes, length: int) -> int:
    """Zero bytes between an entry's key and its payload, so that a payload of
    ``ALIGN_FROM`` bytes or more starts on a page (a copy out of the page cache
    to an unaligned file offset costs about a quarter more: 1 MiB, 113 vs 89 us)."""
    if length < ALIGN_FROM:
        return 0
    return -(tail + ENTRY_HEADER.size + len(key)) % PAGE


class SegmentStore:
    """Payloads in segment files, located by index records in a RocksDB handle.

    ``index`` is anything with ``get``, ``__setitem__``, ``__delitem__`` and
    ``items()`` over bytes keys (an ``Rdict`` or one of its column families);
    the store owns every record in it. Index writes go through ``write_index``
    when given (a list of ``(key, record or None)`` to write together, e.g. one
    RocksDB WriteBatch with the caller's write options), else item by item.
    Thread-safe.
    """

    def __init__(self, directory: str, index, *, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 reclaim_below: float = DEFAULT_RECLAIM_BELOW,
                 rate_bytes_s: float = DEFAULT_RATE_BYTES_S, sync: bool = False,
                 fault: Callable[[str], None] | None = None,
                 write_index: Callable[[list[tuple[bytes, bytes | None]]], None] | None = None):
        self.dir = directory
        self.index = index
        self.segment_bytes = segment_bytes
        self.reclaim_below = reclaim_below
        self.rate_bytes_s = rate_bytes_s
        self.sync = sync
        self.fault = fault
        self.write_index = write_index           # writes index records (None: delete), e.g. as one batch
        self.checksum_failures = 0
        self.reclaimed_segments = 0
        self._tail_lock = threading.Lock()       # the active segment and its tail
        self._index_lock = threading.RLock()     # index records and live counts together
        self._fds: dict[int, int] = {}           # open segments (read and write)
        self._live: dict[int, int] = {}          # segment -> live entry bytes
        self._size: dict[int, int] = {}          # segment -> bytes appended (file size)
        self._pending: dict[int, int] = {}       # segment -> appends not yet indexed or given up
        self._closed = False
        os.makedirs(directory, exist_ok=True)
        self._open_existing()
        self._active = -1
        self._tail = 0
        self._roll(max(self._size, default=0) + 1)

    # -- opening --------------------------------------------------------------
    def _open_existing(self) -> None:
        on_disk = {}
        for name in os.listdir(self.dir):
            m = SEGMENT_NAME.match(name)
            if m:
                on_disk[int(m.group(1))] = os.path.join(self.dir, name)
        for key, raw in self.index.items():
            if len(raw) < LOCATION.size:
                continue                # not a record: its owner drops it
            loc = Location.unpack(raw)
            self._live[loc.segment] = self._live.get(loc.segment, 0) + self._entry_bytes(key, loc.length)
        for seg, path in on_disk.items():
            if self._live.get(seg, 0) == 0:
                os.unlink(path)        # nothing points there (all dead, or a crash before indexing)
                continue
            self._size[seg] = os.path.getsize(path)
            self._fds[seg] = os.open(path, os.O_RDWR)
        for seg in [s for s in self._live if s not in self._size]:
            log.error("segment store %s: segment %d is missing; its values are misses", self.dir, seg)
            self._size[seg] = 0

    def _roll(self, seg: int) -> None:
        path = os.path.join(self.dir, segment_name(seg))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.pwrite(fd, FILE_HEADER.pack(FILE_MAGIC, FILE_VERSION, seg), 0)
        self._fds[seg] = fd
        self._size[seg] = FILE_HEADER.size
        self._live.setdefault(seg, 0)
        self._active, self._tail = seg, FILE_HEADER.size

    @staticmethod
    def _entry_bytes(key: bytes, length: int) -> int:
        return ENTRY_HEADER.size + len(key) + length

    # -- writes ---------------------------------------------------------------
    def put(self, key: bytes, payload, extra: bytes = b"") -> Location:
        """Append ``payload`` and index it under ``key`` (with ``extra`` after the location)."""
        return self.put_many([(key, payload, extra)])[0]

    def put_many(self, items) -> list[Location]:
        """Append several ``(key, payload, extra)`` and index them in one index write
        (one RocksDB batch with the tier's writer: one WAL append for all)."""
        locs: list[Location] = []
        try:
            for key, payload, _ in items:
                locs.append(self._append(key, memoryview(payload).cast("B")))
            self._step("synced")
            with self._index_lock:
                self._check_open()
                last = {key: i for i, (key, _, _) in enumerate(items)}   # a key twice: the last wins
                kept = sorted(last.values())
                records = [(items[i][0], locs[i].pack() + items[i][2]) for i in kept]
                olds = [self.index.get(key) for key, _ in records]
                self._write_index(records)
                for (key, _), loc, old in zip(records, [locs[i] for i in kept], olds):
                    self._live[loc.segment] = self._live.get(loc.segment, 0) + self._entry_bytes(key, loc.length)
                    if old is not None:
                        self._forget(key, Location.unpack(old))
        finally:
            for loc in locs:
                self._settled(loc.segment)
        self._step("indexed")
        return locs

    def _write_index(self, records: list[tuple[bytes, bytes | None]]) -> None:
        if self.write_index is not None:
            self.write_index(records)
            return
        for key, raw in records:
            if raw is None:
                del self.index[key]
            else:
                self.index[key] = raw

    def _append(self, key: bytes, view: memoryview, digest: int | None = None) -> Location:
        if len(key) > 0xFFFF:
            raise ValueError("key longer than 65535 bytes")
        digest = checksum(view) if digest is None else digest
        with self._tail_lock:
            self._check_open()
            pad = _pad(self._tail, key, view.nbytes)
            entry = self._entry_bytes(key, view.nbytes) + pad
            if self._tail + entry > self.segment_bytes and self._tail > FILE_HEADER.size:
                self._roll(self._active + 1)
                pad = _pad(self._tail, key, view.nbytes)
                entry = self._entry_bytes(key, view.nbytes) + pad
            seg, start = self._active, self._tail
            self._tail += entry
            self._size[seg] = self._tail
            self._pending[seg] = self._pending.get(seg, 0) + 1    # not a reclaim victim until indexed
            fd = self._fds[seg]
        try:
            self._step("reserved")
            head = ENTRY_HEADER.pack(ENTRY_MAGIC, len(key), pad, view.nbytes, digest) + key + bytes(pad)
            wrote = os.pwritev(fd, [head, view], start)
            if wrote != entry:
                raise OSError(f"short write to segment {seg}: {wrote} of {entry} bytes")
            self._step("written")
            if self.sync:
                os.fdatasync(fd)
        except BaseException:
            self._settled(seg)
            raise
        return Location(seg, start + len(head), view.nbytes, digest)

    def _settled(self, seg: int) -> None:
        with self._tail_lock:
            self._pending[seg] -= 1

    def delete(self, key: bytes) -> bool:
        with self._index_lock:
            self._check_open()
            old = self.index.get(key)
            if old is None:
                return False
            self._write_index([(key, None)])
            self._forget(key, Location.unpack(old))
        return True

    def _forget(self, key: bytes, loc: Location) -> None:
        """``loc``'s bytes are dead (caller holds the index lock)."""
        left = self._live.get(loc.segment, 0) - self._entry_bytes(key, loc.length)
        self._live[loc.segment] = max(left, 0)

    def _step(self, name: str) -> None:
        if self.fault is not None:
            self.fault(name)

    # -- reads ----------------------------------------------------------------
    def locate(self, key: bytes) -> tuple[Location, bytes] | None:
        raw = self.index.get(key)
        return None if raw is None else split_record(raw)

    def get_into(self, key: bytes, buffer) -> int | None:
        """Read ``key``'s payload into ``buffer``: its length, or None (absent or corrupt)."""
        for _ in range(2):           # a reclaim may move the value between locate and read
            found = self.locate(key)
            if found is None:
                return None
            loc = found[0]
            got = self.read_at(loc, buffer)
            if got is not None:
                return got
        self._corrupt(key, loc)
        return None

    def get(self, key: bytes) -> bytes | None:
        found = self.locate(key)
        if found is None:
            return None
        buf = bytearray(found[0].length)
        return bytes(buf) if self.get_into(key, buf) is not None else None

    def quiet(self) -> threading.RLock:
        """Held, no put, delete or reclaim changes an index record (a reader's retry)."""
        return self._index_lock

    def read_at(self, loc: Location, buffer) -> int | None:
        """``loc``'s payload into ``buffer``: its length, or None (gone, short or bad)."""
        fd = self._fds.get(loc.segment)
        if fd is None:
            return None
        try:
            return read_into(fd, loc, buffer)
        except OSError:         # closed by a reclaim that just finished
            return None

    def read_cached(self, loc: Location, buffer) -> int | None:
        """``read_at`` from the page cache alone (``RWF_NOWAIT``): None when any of the bytes
        would have to come from the disk, so the event loop may call it."""
        fd = self._fds.get(loc.segment)
        if fd is None:
            return None
        try:
            return read_into(fd, loc, buffer, os.RWF_NOWAIT)
        except OSError:         # not cached (EAGAIN), a file system without RWF_NOWAIT, a closed segment
            return None

    def _corrupt(self, key: bytes, loc: Location) -> None:
        """A payload failed its check twice: drop its record, count it, log it."""
        with self._index_lock:
            raw = self.index.get(key)
            if raw is None or Location.unpack(raw) != loc:
                return                   # moved or replaced meanwhile
            self._write_index([(key, None)])
            self._forget(key, loc)
            self.checksum_failures += 1
        log.error("segment store %s: %r failed its checksum in segment %d at %d (%d bytes); dropped",
                  self.dir, key, loc.segment, loc.offset, loc.length)

    # -- space ----------------------------------------------------------------
    def live_fraction(self, seg: int) -> float:
        size = self._size.get(seg, 0) - FILE_HEADER.size
        return 1.0 if size <= 0 else self._live.get(seg, 0) / size

    def disk_bytes(self) -> int:
        return sum(self._size.values())

    def live_bytes(self) -> int:
        return sum(self._live.values())

    def segments(self) -> list[int]:
        return sorted(self._fds)

    def victims(self) -> list[int]:
        """Sealed segments whose live fraction is under the threshold, emptiest first."""
        with self._tail_lock:
            active = self._active
            busy = {s for s, n in self._pending.items() if n}
        cands = [s for s in self._fds
                 if s != active and s not in busy and self.live_fraction(s) < self.reclaim_below]
        return sorted(cands, key=self.live_fraction)

    def reclaim(self, limit: int | None = None, sleep: Callable[[float], None] = time.sleep) -> int:
        """Rewrite the segments ``victims`` names (at most ``limit``); bytes copied."""
        victims = self.victims()[:limit]
        if not victims:
            return 0
        wanted = set(victims)
        live: dict[int, list[tuple[bytes, Location]]] = {s: [] for s in victims}
        for key, raw in self.index.items():
            loc = Location.unpack(raw)
            if loc.segment in wanted:
                live[loc.segment].append((key, loc))
        copied, started = 0, time.monotonic()
        for seg in victims:
            for key, loc in sorted(live[seg], key=lambda kl: kl[1].offset):
                copied += self._move(key, loc)
                if self.rate_bytes_s:
                    ahead = copied / self.rate_bytes_s - (time.monotonic() - started)
                    if ahead > 0:
                        sleep(ahead)
            self._drop_segment(seg)
        return copied

    def _move(self, key: bytes, loc: Location) -> int:
        buf = bytearray(loc.length)
        if self.read_at(loc, buf) is None:
            self._corrupt(key, loc)
            return 0
        new = self._append(key, memoryview(buf), loc.checksum)
        try:
            with self._index_lock:
                raw = self.index.get(key)
                if raw is None or Location.unpack(raw) != loc:
                    return 0             # a put or delete raced the copy: the copy is dead
                self._write_index([(key, new.pack() + raw[LOCATION.size:])])
                self._live[new.segment] = self._live.get(new.segment, 0) + self._entry_bytes(key, new.length)
                self._forget(key, loc)
        finally:
            self._settled(new.segment)
        return loc.length

    def _drop_segment(self, seg: int) -> None:
        with self._index_lock:
            if self._live.get(seg, 0) > 0:
                # a record still points here (written by nobody: puts go to the active segment) -- keep it
                log.warning("segment store %s: segment %d still has live bytes after reclaim", self.dir, seg)
                return
            fd = self._fds.pop(seg, None)
            self._live.pop(seg, None)
            self._size.pop(seg, None)
        if fd is not None:
            os.close(fd)
        os.unlink(os.path.join(self.dir, segment_name(seg)))
        self.reclaimed_segments += 1

    # -- life -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("segment store is closed")

    def flush(self) -> None:
        for fd in list(self._fds.values()):
            os.fdatasync(fd)

    def close(self) -> None:
        with self._tail_lock, self._index_lock:
            if self._closed:
                return
            self._closed = True
            fds, self._fds = self._fds, {}
            self.index = self.write_index = None      # the index handle holds its database open
        for fd in fds.values():
            os.close(fd)

    def scan(self) -> Iterator[tuple[bytes, Location, bytes]]:
        """Every index record: (key, location, the caller's extra bytes)."""
        for key, raw in self.index.items():
            loc, extra = split_record(raw)
            yield key, loc, extra
