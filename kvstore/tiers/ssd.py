"""The SSD tier: values in segment files indexed by RocksDB (rocksdict), verified on read.

Layout. Each value's payload is appended to a value file (a segment, see
:mod:`kvstore.tiers.segments`), and RocksDB's ``meta`` column family keeps its
index record under the key: where the payload is (segment, offset, length,
xxh3), then its header (the format is in :mod:`kvstore.tiers.record`). The
record is written after the payload, so none points at bytes not written.
Records are tiny and sit in their own SST files, so a warm restart
(``scan_index``) reads ~70 bytes per value and never touches payloads. A
plain value read into a buffer is one ``preadv`` into it.

Opening is instant. ``used_bytes`` and ``count`` need every header summed,
so a background thread does that over the headers as they were at open
(RocksDB keeps that view for the iterator); puts and deletes meanwhile are
counted against the headers they replace, so the totals are exact once
``accounted`` is set (~1.4 s per 100,000 values on 2 vCPUs). Until then they
are too low, and the capacity check is lenient by the same amount.

Durability. Index records go through RocksDB's WAL by default, after their
payloads' ``pwritev``, so a value whose put returned survives ``kill -9`` of
the process (``sync=True`` also survives a power cut, at the price of an
fdatasync of the segment and an fsync of the WAL per batch). With
``wal=False`` the newest records are lost on a crash; their payloads are
dead bytes that reclaim removes.

Verification. ``get`` checks the payload against the header's xxh3 checksum
before decompressing. A read that fails is retried once under the write
lock and the segment store's index lock (an unlocked read can straddle a
concurrent overwrite or a reclaim);
if it fails again the record is deleted and :class:`CorruptValue` is raised,
so a bad value is reported once and never served.

Capacity. ``capacity_bytes`` is a hard limit on header + payload bytes; the
tier manager keeps the tier under its watermarks by evicting ahead of time, and a
put that would pass the limit raises :class:`TierFull` and writes nothing.

Threads. ``SSDWorker`` (ssd_worker.py) runs the tier on threads: reads on a
small pool, puts on one writer thread that drains the queue into WriteBatches
(group commit: one WAL append for many puts). rocksdict keeps the GIL through
its calls into RocksDB, so while a call runs the node's event loop
waits: batches are kept small (``SSDWorker.max_batch_bytes``) and a write
RocksDB would stall is waited out with the GIL released (`_write`).
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from rocksdict import (BlockBasedOptions, ChecksumType, DBCompressionType, Options,
                       Rdict, ReadOptions, WriteBatch, WriteOptions)

from kvstore.tiers import CorruptValue, TierError, TierFull, ValueTooLarge
from kvstore.tiers.record import RecordHeader, decode, decode_into, encode
from kvstore.tiers.segments import LOCATION, Location, SegmentStore
from proto import fastpath as fp

WRITE_STALL = "Result incomplete"        # RocksDB's status for a write it would have delayed
STALL_FIRST_S, STALL_MAX_S, STALL_LIMIT_S = 0.001, 0.05, 60.0
META_CF = "meta"
VALUE_CF = fp.SSD_VALUE_CF
COMPRESSION_MODES = ("auto", "off")
SEGMENTS_DIR = "segments"         # the payloads' value files, under the tier's directory
RECENT_RECORDS = 65536            # index records remembered for reads on the loop (~100 bytes each)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class IndexRecord:
    """One stored value as the engine's index needs it after a restart."""

    key: bytes
    stored_size: int       # header + payload bytes on disk
    value_size: int        # bytes a reader gets back
    parent: bytes | None
    tag: int               # what the shared index publishes it under (0: not publishable)
    tenant: bytes | None = None     # the name of the tenant that wrote it (None: the shared pool)

    @classmethod
    def of(cls, key: bytes, header: RecordHeader) -> IndexRecord:
        return cls(key, header.disk_bytes, header.value_size, header.parent, header.index_tag, header.tenant)


class SSDTier:
    """Keyed, checksummed, optionally compressed values in one RocksDB."""

    def __init__(self, db: Rdict, path: str, capacity_bytes: int, *, compress: bool,
                 shuffle: bool, write_options: WriteOptions):
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.compress = compress
        self.shuffle = shuffle
        self.checksum_failures = 0
        self.write_stalls = 0            # writes RocksDB would have delayed, waited out in _write
        self._db = db
        self._meta = db.get_column_family(META_CF)
        self._values = db.get_column_family(VALUE_CF)
        self._meta_cf = db.get_column_family_handle(META_CF)
        self._value_cf = db.get_column_family_handle(VALUE_CF)
        self._write_options = write_options
        self._payload_reads = ReadOptions()
        self._payload_reads.set_verify_checksums(False)   # our xxh3 checks the same bytes
        self._lock = threading.Lock()
        self._recent: dict[bytes, bytes] = {}   # key -> its index record, for reads on the loop
        self._written: set[bytes] | None = set()    # keys written while the opening scan runs
        try:
            self._store = SegmentStore(os.path.join(path, SEGMENTS_DIR), self._meta,
                                       sync=write_options.sync, write_index=self._write_records)
        except OSError as exc:
            db.close()
            raise _describe_failure(path, "open", exc) from exc
        self._used = self._count = self._value_bytes = 0
        self.accounted = threading.Event()
        self._closing = False
        self._accountant = threading.Thread(target=self._account_opening_headers, args=(self._meta.items(),),
                                            name="ssd-accounting", daemon=True)
        self._accountant.start()

    @classmethod
    def open(cls, path: str, capacity_bytes: int, *, compression: str = "auto",
             shuffle: bool = True, sync: bool = False, wal: bool = True) -> SSDTier:
        """Open (or create) the tier in directory ``path``; TierError says why not."""
        if compression not in COMPRESSION_MODES:
            raise ValueError(f"compression must be one of {COMPRESSION_MODES}, not {compression!r}")
        if capacity_bytes <= 0:
            raise ValueError(f"capacity must be positive, not {capacity_bytes}")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise TierError(f"SSD tier directory {path} cannot be created: {exc.strerror}") from exc
        try:
            db = Rdict(path, _db_options(), column_families={
                META_CF: _meta_options(), VALUE_CF: _value_options()})
        except Exception as exc:  # rocksdict raises bare Exception with RocksDB's status text
            raise _describe_failure(path, "open", exc) from exc
        write_options = WriteOptions()
        write_options.sync = sync
        write_options.disable_wal = not wal
        write_options.no_slowdown = True        # a stall is waited out in _write, the GIL free
        return cls(db, path, capacity_bytes, compress=compression == "auto",
                   shuffle=shuffle, write_options=write_options)

    # -- accounting ----------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def count(self) -> int:
        return self._count

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self._used

    @property
    def compression_ratio(self) -> float:
        """Value bytes per byte stored (1.0 when nothing compresses)."""
        return self._value_bytes / self._used if self._used else 1.0

    def _account(self, stored_size: int, value_size: int, sign: int) -> None:
        self._used += sign * stored_size
        self._value_bytes += sign * value_size
        self._count += sign

    # -- writes --------------------------------------------------------------

    def put(self, key: bytes, value, parent: bytes | None = None, tenant: bytes | None = None) -> int:
        """Store ``value`` (any contiguous buffer) under ``key``, written by ``tenant`` (a
        name; None: the shared pool); bytes used on disk."""
        return self.put_batch([(key, value, parent, tenant)])[0].disk_bytes

    def put_batch(self, items: Iterable[tuple[bytes, Any, bytes | None, bytes | None]]) -> list[RecordHeader]:
        """Store several values, each ``(key, value, parent, tenant)``, atomically (one
        WriteBatch); the header written for each (its bytes on disk, and the tag the shared
        index publishes it under)."""
        records = [(key, *self._encode(value, parent, tenant)) for key, value, parent, tenant in items]
        latest = {key: (header, payload) for key, header, payload in records}
        with self._lock:
            self._check_open()
            previous = {key: self._stored_header(key) for key in latest}
            growth = sum(h.disk_bytes for h, _ in latest.values())
            growth -= sum(h.disk_bytes for h in previous.values() if h)
            if self._used + growth > self.capacity_bytes:
                raise TierFull(f"SSD tier at {self.path} needs {growth} more bytes, "
                               f"{self.free_bytes} of {self.capacity_bytes} are free")
            try:
                self._store.put_many([(key, payload, header.pack())
                                      for key, (header, payload) in latest.items()])
            except OSError as exc:          # the payload's write: a full disk, a file size limit
                raise _describe_failure(self.path, "write", exc) from exc
            for key, (header, _) in latest.items():
                if previous[key]:
                    self._account(previous[key].disk_bytes,
                                  previous[key].value_size, -1)
                self._account(header.disk_bytes, header.value_size, +1)
        return [header for _, header, _ in records]

    def _write_records(self, records: list[tuple[bytes, bytes | None]]) -> None:
        """Write index records (None: delete) in one batch: the segment store's index writer,
        the one place records change, so it keeps `_recent` true (a record leaves it before
        the write and comes back, the new one, after)."""
        def fill(batch: WriteBatch) -> None:
            for key, raw in records:
                if raw is None:
                    batch.delete(key, self._meta_cf)
                else:
                    batch.put(key, raw, self._meta_cf)
        recent, written = self._recent, self._written
        for key, _ in records:
            if written is not None:
                written.add(key)        # before the pop: the opening scan re-checks it after remembering
            recent.pop(key, None)
        self._write(fill, "write")
        for key, raw in records:
            if raw is not None:
                self._remember(key, raw)

    def _remember(self, key: bytes, raw: bytes) -> None:
        recent = self._recent
        if len(recent) >= RECENT_RECORDS:
            recent.pop(next(iter(recent)), None)        # the oldest remembered
        recent[key] = raw

    def read_cached(self, key: bytes, buffer=None):
        """The value of ``key`` when its index record is remembered and its bytes are in the
        page cache, read on the calling thread (one ``preadv`` that never waits for the disk,
        and the xxh3) into ``buffer`` (its length returned) or a new bytearray (returned): a
        read the event loop can make instead of a round trip through a reader thread. None
        otherwise (then `get_many` or `get_many_into`).

        Records are remembered at open, when written and when read (`_read_many`), and forgotten
        before any change, under the segment store's index lock; a record gone stale since
        (its segment reclaimed) fails its read or its checksum and is a None here.
        """
        raw = self._recent.get(key)
        if raw is None:
            return None
        try:
            loc, header = _parse_record(raw)
        except CorruptValue:
            return None
        if header.flags:
            return None                 # compressed or shuffled: decoded on a reader thread
        if buffer is not None:
            return self._store.read_cached(loc, buffer)
        buffer = bytearray(loc.length)
        return buffer if self._store.read_cached(loc, buffer) is not None else None

    def _encode(self, value, parent: bytes | None, tenant: bytes | None) -> tuple[RecordHeader, bytes]:
        header, payload = encode(value, parent, compress=self.compress, shuffle=self.shuffle, tenant=tenant)
        if header.disk_bytes > self.capacity_bytes:
            raise ValueTooLarge(f"value of {header.value_size} bytes ({header.stored_size} stored) "
                                f"is larger than the SSD tier's capacity of {self.capacity_bytes}")
        return header, payload

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; whether it was there."""
        with self._lock:
            self._check_open()
            return self._remove(key)

    def _remove(self, key: bytes) -> bool:
        """Delete both entries of ``key`` (caller holds the lock)."""
        raw = self._meta.get(key)
        if raw is None:
            return False
        self._delete_entries(key)
        header = _parse_header(raw)
        if header:
            self._account(header.disk_bytes, header.value_size, -1)
        return True

    def _delete_entries(self, key: bytes) -> None:
        raw = self._meta.get(key)
        if raw is not None and len(raw) >= LOCATION.size:
            self._store.delete(key)             # its payload's bytes are dead
        elif raw is not None:
            self._write_records([(key, None)])

    def _stored_header(self, key: bytes) -> RecordHeader | None:
        """Header of ``key`` as accounted: None when absent or unreadable."""
        return _parse_header(self._meta.get(key))

    def _write(self, fill: Callable[[WriteBatch], None], action: str) -> None:
        """Write a batch that ``fill`` makes, waiting out RocksDB's write stalls with the GIL
        released (a batch is made anew for each try: rocksdict consumes it even when RocksDB
        refuses the write).

        rocksdict keeps the GIL through its calls into RocksDB, and a
        write that RocksDB delays or stops (memtables full, too many level-0
        files: the flush and compaction threads are behind) waited inside that
        call, so the node's event loop stood still with it: a node writing 1 MiB
        values through to SSD answered PING in 78 ms at p99 and 368 ms at worst,
        against 4.7 ms with no SSD tier. So writes ask RocksDB not to wait
        (``no_slowdown``), and a stalled write sleeps here, where the GIL is free,
        and is tried again (from 1 ms, doubling to 50 ms a try, for at most
        `STALL_LIMIT_S`: then it fails like any other write error).
        """
        delay, waited = STALL_FIRST_S, 0.0
        while True:
            batch = WriteBatch(raw_mode=True)
            fill(batch)
            try:
                self._db.write(batch, self._write_options)
                return
            except Exception as exc:  # RocksDB status text: a stall, disk full, read-only, ...
                if WRITE_STALL not in str(exc) or waited >= STALL_LIMIT_S:
                    raise _describe_failure(self.path, action, exc) from exc
            self.write_stalls += 1
            time.sleep(delay)
            waited += delay
            delay = min(2 * delay, STALL_MAX_S)

    # -- reads ---------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        """The value, verified; None when absent. Raises CorruptValue (and drops it)."""
        return self._fetch(key, decode)

    def reclaim(self, limit: int | None = 1) -> int:
        """Rewrite the segments mostly dead (at most ``limit``); bytes copied."""
        self._check_open()
        try:
            return self._store.reclaim(limit)
        except OSError as exc:
            raise _describe_failure(self.path, "reclaim", exc) from exc

    @property
    def segment_disk_bytes(self) -> int:
        return self._store.disk_bytes()

    def get_into(self, key: bytes, buffer) -> int | None:
        """Copy the verified value into ``buffer``; its length, or None when absent."""
        return self._fetch(key, partial(decode_into, out=buffer), buffer)

    def get_many(self, keys: list[bytes]) -> list[bytes | None | BaseException]:
        """Several verified values, on one thread in one call, for a reply sent over a socket.

        Nothing is copied for them: an uncompressed value is the very bytes object
        RocksDB's read returned, sent as it is (one 1 MiB copy less than a read
        into the arena, which costs as much as the read itself). Results as in
        `get_many_into`, with the value in place of its length.
        """
        return self._read_many(keys, [(decode, None)] * len(keys))

    def get_many_into(self, keys: list[bytes], buffers: list) -> list[int | None | BaseException]:
        """Copy several verified values into their buffers, on one thread in one call.

        One result per key, in order: the value's length, None when absent, or the
        error that key's own read raised.
        """
        return self._read_many(keys, [(partial(decode_into, out=buffer), buffer) for buffer in buffers])

    def _read_many(self, keys: list[bytes], finishers: list[tuple[Callable[[RecordHeader, bytes], T], Any]]) \
            -> list[T | None | BaseException]:
        """Read several values, each handed with its header to its own finisher.

        The headers come from one batched ``multi_get`` (a whole prefix costs RocksDB
        one pass over the header files); payloads are read one ``get`` each, since
        rocksdict's ``multi_get`` of large values costs twice the CPU of single gets
        (it verifies RocksDB's block checksums, which ours repeats, and copies once
        more: 1 MiB ~220 vs ~105 us, docs/tiers.md). A key whose read fails is read
        again alone, so it gets the retry and drop of ``get``.
        """
        self._check_open()
        try:
            headers = self._meta.get(keys)
        except Exception:   # RocksDB status text: let each key report its own
            headers = [b""] * len(keys)
        out = [None if raw is None else self._settle(self._read_with_header, key, raw, *finish)
               for key, raw, finish in zip(keys, headers, finishers)]
        for key, raw, got in zip(keys, headers, out):
            if raw and got is not None and not isinstance(got, BaseException) and key not in self._recent:
                with self._store.quiet():       # no record changes meanwhile: remember it only if current
                    if self._meta.get(key) == raw:
                        self._remember(key, raw)
        return out

    def _read_with_header(self, key: bytes, raw: bytes, finish: Callable[[RecordHeader, bytes], T],
                          out=None) -> T | None:
        """Read the payload of ``key`` whose record was ``raw``; if they do not verify
        together (an overwrite or a reclaim in between, damage), read again alone."""
        try:
            return self._finish_record(raw, finish, out)
        except CorruptValue:   # _fetch says whether it is
            pass
        return self._fetch(key, finish, out)

    @staticmethod
    def _settle(fn: Callable[..., T], *args: Any) -> T | BaseException:
        try:
            return fn(*args)
        except Exception as exc:
            return exc

    def _fetch(self, key: bytes, finish: Callable[[RecordHeader, bytes], T], out=None) -> T | None:
        self._check_open()
        try:
            return self._load(key, finish, out)
        except CorruptValue:
            pass
        with self._lock, self._store.quiet():   # retry where no put, delete or reclaim of this key can interleave
            self._check_open()
            try:
                return self._load(key, finish, out)
            except CorruptValue as exc:
                self.checksum_failures += 1
                self._remove(key)
                raise CorruptValue(f"SSD value {key!r} failed verification and was dropped: {exc}") from None

    def _load(self, key: bytes, finish: Callable[[RecordHeader, bytes], T], out=None) -> T | None:
        try:
            raw = self._meta.get(key)
        except Exception as exc:  # RocksDB status text, e.g. damaged data on disk
            if "corruption" in str(exc).lower():
                raise CorruptValue(str(exc)) from exc
            raise _describe_failure(self.path, "read", exc) from exc
        if raw is None:
            return None
        return self._finish_record(raw, finish, out)

    def _finish_record(self, raw: bytes, finish: Callable[[RecordHeader, bytes], T], out=None) -> T:
        """The value a record points at, handed to ``finish``: a plain value read for a buffer
        (``out``) lands there with one ``preadv``; any other is read into a new buffer first."""
        loc, header = _parse_record(raw)
        if out is not None and not header.flags:
            if memoryview(out).nbytes < loc.length:
                raise ValueError(f"buffer of {memoryview(out).nbytes} bytes cannot hold a value "
                                 f"of {header.value_size} bytes")
            if self._store.read_at(loc, out) is None:
                raise CorruptValue(f"checksum mismatch over {loc.length} stored bytes")
            return header.value_size
        payload = bytearray(loc.length)
        if self._store.read_at(loc, payload) is None:
            raise CorruptValue(f"checksum mismatch over {loc.length} stored bytes")
        return finish(header, payload)

    def scan_index(self) -> Iterator[IndexRecord]:
        """Every stored value's index record, reading headers only."""
        self._check_open()
        for key, raw in self._meta.items():
            header = _parse_header(raw)
            if header is not None:
                yield IndexRecord.of(key, header)

    def _account_opening_headers(self, view: Iterable[tuple[bytes, bytes]]) -> None:
        """Add the headers present at open to the totals; drop those that do not parse.

        Runs once, on its own thread, over the view RocksDB kept when the
        iterator was made: puts and deletes since open were counted against
        the headers they replaced, so nothing is missed or counted twice. It
        also remembers the first RECENT_RECORDS records for reads on the loop
        (`read_cached`), so a value whose bytes are still in the page cache
        after a restart is read there from its first GET.
        """
        stored = value_bytes = count = 0
        damaged = []
        recent, written = self._recent, self._written
        for key, raw in view:
            if self._closing:
                return
            header = _parse_header(raw)
            if header is None:
                damaged.append(key)
                continue
            if len(recent) < RECENT_RECORDS:
                recent[key] = raw       # the view may be older than a write since open: that write
                if key in written:      # marked the key before it touched `_recent`, so checking
                    recent.pop(key, None)   # after remembering never keeps a stale record
            stored += header.disk_bytes
            value_bytes += header.value_size
            count += 1
        with self._lock:
            if self._db is None:
                return
            self._used += stored
            self._value_bytes += value_bytes
            self._count += count
            for key in damaged:
                raw = self._meta.get(key)
                if raw is not None and _parse_header(raw) is None:   # not rewritten since open
                    self._delete_entries(key)
                    self.checksum_failures += 1
        self._written = None
        self.accounted.set()

    # -- lifetime ------------------------------------------------------------

    def _check_open(self) -> None:
        if self._db is None:
            raise TierError(f"SSD tier at {self.path} is closed")

    def close(self) -> None:
        """Flush memtables (a restart then replays no WAL) and release the directory.

        Stop the SSDWorker first: reads in flight on other threads do not
        take the lock. The directory is released even when the flush fails
        (a full disk); the error is raised afterwards, and the WAL still
        holds the writes.
        """
        self._closing = True
        self._accountant.join()        # its view of the headers holds the DB open too
        with self._lock:
            if self._db is None:
                return
            db, self._db = self._db, None
            self._meta = self._values = self._meta_cf = self._value_cf = None  # each holds the DB open
            self._store.close()
            errors = []
            for step in (db.flush, db.close):
                try:
                    step()
                except Exception as exc:  # RocksDB status text
                    errors.append(exc)
            if errors:
                raise _describe_failure(self.path, "close", errors[0]) from errors[0]


def _parse_record(raw: bytes) -> tuple[Location, RecordHeader]:
    """An index record: where the payload is (segments.LOCATION), then its header.
    CorruptValue when it does not parse or the two disagree."""
    if len(raw) < LOCATION.size:
        raise CorruptValue("index record cut short")
    loc = Location.unpack(raw)
    header = RecordHeader.unpack(raw[LOCATION.size:])
    if loc.length != header.stored_size or loc.checksum != header.checksum:
        raise CorruptValue("index record and header disagree")
    return loc, header


def _parse_header(raw: bytes | None) -> RecordHeader | None:
    if raw is None:
        return None
    try:
        return _parse_record(raw)[1]
    except CorruptValue:
        return None


def _describe_failure(path: str, action: str, exc: Exception) -> TierError:
    """Turn RocksDB's status text into an error that names the cause."""
    text = str(exc)
    lowered = text.lower()
    if "/LOCK" in text:                      # RocksDB's lock file, held by another opener
        cause = "the directory is locked by another process using it as an SSD tier"
    elif "no space left" in lowered:
        cause = "the disk is full"
    elif "file too large" in lowered:
        cause = "a file reached the file size limit"
    elif "read-only file system" in lowered or "permission denied" in lowered:
        cause = "the directory is not writable"
    elif "not a directory" in lowered or "no such file" in lowered:
        cause = "the path is not a usable directory"
    else:
        cause = "RocksDB reported an error"
    return TierError(f"SSD tier at {path}: {action} failed, {cause} ({text})")


def _db_options() -> Options:
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    options.create_missing_column_families(True)
    options.set_atomic_flush(True)          # meta and value flush together
    options.set_max_background_jobs(2)
    options.set_keep_log_file_num(4)
    return options


def _meta_options() -> Options:
    options = Options(raw_mode=True)
    table = BlockBasedOptions()
    table.set_bloom_filter(10, False)       # most puts ask about keys that are absent
    options.set_block_based_table_factory(table)
    return options


def _value_options() -> Options:
    options = Options(raw_mode=True)
    options.set_compression_type(DBCompressionType.none())   # payloads are lz4'd per value already
    options.set_write_buffer_size(64 << 20)
    table = BlockBasedOptions()
    table.set_checksum_type(ChecksumType.xxh3())             # the cheapest checksum for RocksDB to write
    options.set_block_based_table_factory(table)
    return options
