"""The index published in shared memory: a local client finds a DRAM value without asking.

A first get of a key costs a KV.LEASE round trip to a Python node before the
copy, and on two busy cores that round trip costs more than copying a
megabyte. So the node publishes where its DRAM values are in a table that
local clients map read-only (a memfd passed with KV.ARENA, as the arena and
the lease validity words are), and a client finds a value, copies it out of
its own mapping of the arena and proves the copy whole by itself, with no
round trip at all. Only the node's loop thread writes the table.

Layout (the constants are in proto/fastpath.py, which the client reads too):
sets of `INDEX_WAYS` buckets; a key lives in one bucket of the set its 64-bit
hash picks. A bucket is a sequence word, the key hash (0 when empty), the
value's arena offset, its size and key length, and the key's bytes, so a
client compares keys exactly (a hash collision is a miss, never a wrong
value). A value is published only if it fits the table: a full set, a key
longer than `INDEX_KEY_MAX`, a key with an expiry time and a value outside
the arena are simply absent, and the client asks the node (KV.LEASE) as
before. Nothing is evicted from the table to make room: a bucket frees when
its value leaves DRAM.

Every change of a bucket is a seqlock write: the sequence word goes odd, the
fields change, the word goes even again. A reader loads the sequence word
(even, else it gives up), then the fields and the key (comparing it), then
copies the value's bytes, then loads the sequence word again: the copy is
the key's current value, whole, when the two loads are equal.

Why that holds on x86. TSO keeps a core's stores in order as every other
core sees them, and never lets a load pass an older load. The node retracts
a bucket (a seqlock write that empties it) before it lets the value's bytes
go, whatever lets them go: delete, overwrite (a new extent, or the same one
rewritten in place), expiry set or reached, eviction, flush, demotion to
SSD, a move to the GPU tier (the engine's drop, overwrite and expire
listeners and the tier moves' leave listeners call `retract` first). Any
later store to those bytes comes after the retraction: on the loop thread by
program order; on a worker thread or in a client that got the extent from a
later KV.RESERVE, after a hand-off (a queue, a socket) that the retraction's
stores had already reached, and x86's stores are seen by all cores in one
order consistent with such causality. So if any byte the reader copied was
written after the retraction, its second load of the sequence word, which
comes after that byte's load, sees the retraction's sequence value, and the
reader discards the copy. Fields read between the loads are vouched for the
same way, so an offset torn by a concurrent write is never trusted (the
client bounds-checks it before copying anyway). Words are 8-byte aligned,
so each load and store of one is whole. Tags never repeat: the sequence only
grows, so a bucket reused for another value never matches an older read.

What the table cannot know: that the node is still alive. A node killed
with SIGKILL retracts nothing, and a client keeps its mapping of the dead
node's memory. The client therefore trusts a copy only while the connection
that mapped the table is open (closed by the kernel when the node dies);
see client/shared_index.py. And the node does not see the reads it did not
serve: the client reports them with KV.TOUCH (hits, recency and heat, as a
get would count them) with its next request, or every few hundred reads.

Values on SSD alone are published too, with `INDEX_ON_SSD` and a tag in
place of the offset: the low 63 bits of the xxh3 of the value's RocksDB
payload, as written (the tier manager hands it over when a write lands, a
restart reads it from the record's header; a compressed payload has none and
is not published). A local client reads that payload from the node's RocksDB
files itself and trusts it only when it hashes to the tag
(client/ssd_reads.py), so an older record of the key can never pass. The same
retraction rules hold: the bucket empties before the value is deleted,
overwritten, expired, evicted or moved, and when it comes back to DRAM it is
published at its new place. Tags are kept from the start, for at most as
many values as the table has buckets (a restart indexes the SSD tier before
any client maps the arena), and published when the table is made.

Cost to the node: nothing until the first local client maps the arena or a
plain value lands on SSD (then a dict entry per tagged SSD value and a dict
lookup per drop and overwrite); from the first mapping on, a
hash and a bucket write per commit and per move home, a dict lookup per read
hit (a value committed before the first mapping is published on its next
hit), and one bucket write per value let go.
"""
from __future__ import annotations

import asyncio
import mmap
import os
from dataclasses import dataclass

from kvstore.store.entries import DRAM, SSD
from proto import fastpath as fp

_SEQ, _HASH, _OFFSET, _SIZE = fp.INDEX_SEQ, fp.INDEX_HASH, fp.INDEX_OFFSET, fp.INDEX_SIZE
_WORDS, _BYTES, _KEY_AT = fp.INDEX_BUCKET_WORDS, fp.INDEX_BUCKET_BYTES, fp.INDEX_KEY_AT

MIN_BUCKETS = 4096
MAX_BUCKETS = 1 << 18                # 32 MiB of table at most
ARENA_BYTES_PER_BUCKET = 16 * 1024   # a bucket per 16 KiB of arena: room for small values too
PUBLISH_CHUNK = 1024                 # SSD values published a loop turn when the table is made


def buckets_for(arena_size: int) -> int:
    """The table's bucket count for an arena: a power of two, so sets are picked by a mask."""
    wanted = max(MIN_BUCKETS, min(MAX_BUCKETS, arena_size // ARENA_BYTES_PER_BUCKET))
    return 1 << (wanted - 1).bit_length()


@dataclass
class IndexStats:
    index_published: int = 0
    index_retracted: int = 0
    index_set_full: int = 0            # publishes refused: the key's set had no free bucket


class SharedIndex:
    """The node's side of the shared index: publish DRAM values, retract them before they go."""

    def __init__(self, engine):
        self.engine = engine
        self.stats = IndexStats()
        self.fd = -1
        self.buckets = 0
        self._bucket_of: dict[int, int] = {}     # engine entry -> its bucket
        self._ssd_tags: dict[int, int] = {}      # engine entry -> the tag of its SSD copy (bounded)
        self._tags_max = buckets_for(engine.arena.size)
        self._tracking = False
        engine.moves.on_ssd_listeners.append(self._on_ssd)       # tags are kept before activation too:
                                                                 # a restart loads the SSD tier first

    @property
    def active(self) -> bool:
        return self.fd >= 0

    def activate(self) -> None:
        """Make the table and start publishing (the first local client is mapping the arena)."""
        if self.active:
            return
        engine = self.engine
        self.buckets = buckets_for(engine.arena.size)
        size = self.buckets * fp.INDEX_BUCKET_BYTES
        self.fd = os.memfd_create("kvstore-index", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        populate = getattr(mmap, "MAP_POPULATE", 0)     # fault the table in now, not one commit at a time
        self._map = mmap.mmap(self.fd, size, mmap.MAP_SHARED | populate, mmap.PROT_READ | mmap.PROT_WRITE)
        self._bytes = memoryview(self._map)          # memoryviews: a store is one C store, no boxing
        self._words = self._bytes.cast("Q")
        self._taken = bytearray(self.buckets)    # this thread's own view of which buckets hold a value
        self._set_mask = self.buckets // fp.INDEX_WAYS - 1
        self._track_changes()
        engine.commit_listeners.append(self._on_commit)
        engine.hit_listeners.append(self._on_hit)
        engine.moves.leave_listeners.append(self.retract)
        engine.moves.settled_listeners.append(self._on_settled)
        self._publish_on_ssd(list(self._ssd_tags))

    def _track_changes(self) -> None:
        """Follow drops and overwrites (to retract buckets and forget tags): from activation, or
        from the first tag kept, so a node with neither pays nothing on its writes."""
        if not self._tracking:
            self._tracking = True
            self.engine.drop_listeners.append(self._on_drop)
            self.engine.overwrite_listeners.append(self._on_rewrite)
            self.engine.expiry.listeners.append(self._on_rewrite)

    def info(self) -> dict[str, int]:
        """Counters for KV.LEASES."""
        return {"index_buckets": self.buckets, "index_entries": len(self._bucket_of), **vars(self.stats)}

    # ------------------------------------------------------------ listeners

    def _on_commit(self, key: bytes, entry: int) -> None:
        self._publish(entry, key)

    def _on_hit(self, entry: int) -> None:
        if entry not in self._bucket_of:
            self._publish(entry, self.engine.key_of(entry))

    def _on_drop(self, entry: int, key: bytes) -> None:
        self.retract(entry)
        self._ssd_tags.pop(entry, None)

    def _on_rewrite(self, key: bytes) -> None:
        """The value of ``key`` is about to be rewritten in place (its SSD copy is then stale),
        or got an expiry time."""
        entry = self.engine.index.get(key)
        if entry is not None:
            self.retract(entry)
            self._ssd_tags.pop(entry, None)

    def _on_ssd(self, entry: int, tag: int) -> None:
        """A copy of ``entry``'s value is on SSD under ``tag``: kept (while there is room for
        as many tags as the table has buckets) to publish once the value lives there alone."""
        if tag and (entry in self._ssd_tags or len(self._ssd_tags) < self._tags_max):
            self._track_changes()
            self._ssd_tags[entry] = tag
        else:
            self._ssd_tags.pop(entry, None)

    def _on_settled(self, entry: int) -> None:
        """The value moved home (to SSD alone, or back to DRAM): publish where it is now."""
        self.retract(entry)
        self._publish(entry, self.engine.key_of(entry))

    def _publish_on_ssd(self, entries: list[int]) -> None:
        """Publish values already on SSD alone when the table is made (a restart indexes the
        SSD tier before any client maps the arena), ``PUBLISH_CHUNK`` a loop turn."""
        engine = self.engine
        for entry in entries[:PUBLISH_CHUNK]:
            if entry in self._ssd_tags and entry not in self._bucket_of and engine.entries.tier[entry] == SSD:
                self._publish(entry, engine.key_of(entry))
        if len(entries) > PUBLISH_CHUNK:
            asyncio.get_running_loop().call_soon(self._publish_on_ssd, entries[PUBLISH_CHUNK:])

    # ------------------------------------------------------------ buckets

    def _publish(self, entry: int, key: bytes) -> None:
        """Publish the value of ``entry`` if the table can take it (else clients ask the node):
        where it is in the arena, or for a value on SSD alone the tag of its payload."""
        engine, entries = self.engine, self.engine.entries
        if len(key) > fp.INDEX_KEY_MAX or key in engine.expiry.deadlines:
            return
        tier = entries.tier[entry]
        if tier == DRAM and not (entries.heap_copies and entry in entries.heap_copies):
            offset = entries.dram_offset(entry)
        elif tier == SSD and entry in self._ssd_tags:
            offset = fp.INDEX_ON_SSD | self._ssd_tags[entry]
        else:
            return
        digest = fp.index_hash(key)
        first = (digest & self._set_mask) * fp.INDEX_WAYS
        bucket = self._taken.find(0, first, first + fp.INDEX_WAYS)
        if bucket < 0:
            self.stats.index_set_full += 1
            return
        self._taken[bucket] = 1
        self._bucket_of[entry] = bucket
        self._write(bucket, digest, offset, entries.size[entry], key)
        self.stats.index_published += 1

    def retract(self, entry: int) -> None:
        """Empty the bucket of ``entry``'s value: called before its bytes may change or be freed."""
        bucket = self._bucket_of.pop(entry, None)
        if bucket is None:
            return
        self._write(bucket, 0, 0, 0, b"")
        self._taken[bucket] = 0
        self.stats.index_retracted += 1

    def _write(self, bucket: int, digest: int, offset: int, size: int, key: bytes) -> None:
        """One seqlock write of a bucket (the module comment says why readers can trust it)."""
        words, at = self._words, bucket * _WORDS
        seq = words[at + _SEQ] + 1
        words[at + _SEQ] = seq                               # odd: being written
        words[at + _HASH] = digest
        words[at + _OFFSET] = offset
        words[at + _SIZE] = size | len(key) << 32
        if key:
            start = bucket * _BYTES + _KEY_AT
            self._bytes[start:start + len(key)] = key
        words[at + _SEQ] = seq + 1                           # even: stable again
