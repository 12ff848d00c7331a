"""Movement between tiers: demotion under watermarks, promotion by heat,
reads from SSD and GPU off the event loop, and the warm restart.

The engine's index says where each value lives (GPU, DRAM or SSD); this
module moves values and keeps that column true. Every copy runs on a worker
thread (RocksDB through `SSDWorker`, device copies through a small pool) and
the index changes only on the loop thread, when the copy is done and only if
the key still names the same entry, so a reader always gets a whole value from
one tier or the other.

- Demotion: above a tier's high watermark the coldest values (leaf-first, see
  kvstore/store/eviction.py) move down until the tier is under its low watermark: GPU to
  DRAM, DRAM to SSD; SSD drops its coldest values above its own. A DRAM value
  with a clean SSD copy (write-through, or promoted from SSD) leaves at once.
- Reads of SSD or GPU values: the connection asks for the keys a command will
  read (`pending_fetch`), `fetch` copies them into DRAM extents, and `install`
  either makes the copy the value's home (the value is hot: N hits within the
  window) or stages it for this one command (`unstage` frees it afterwards).
  A command that sends its values over a socket gets RocksDB's own bytes
  instead, staged outside the arena (no copy; bounded on the node); only the
  lease commands (`ARENA_READERS`), whose clients read shared memory, need
  the extents.
- Ordering on SSD: puts and deletes share the writer thread's queue, so a
  delete issued after a put always lands after it.
- Nothing moves under a copy: while a value is copied off DRAM or the GPU on a
  worker thread it is held (the policy never picks it again, its DRAM extent
  is not freed or rewritten), and a GPU extent being read (by a worker thread,
  or by a local client under a KV.LEASEGPU lease) is freed only when the copy
  is done. A move remembers a token per entry; a drop forgets it, so a
  copy that finishes after its value was deleted (and its entry reused) changes
  nothing.

The engine tells the manager what happens through its listeners (commits,
drops, read hits, evictions) and asks it one thing, through ``can_demote``.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvstore.store.engine import Engine, OutOfMemory
from kvstore.store.entries import DRAM, GPU, ON_SSD, SSD, STAGED
from kvstore.tiers import CorruptValue, TierError, ValueTooLarge
from proto.fastpath import HEADER_SIZE, KV_LEASE, KV_LEASEGPU, KV_LEASELAYERS

log = logging.getLogger("kvstore")

MAX_INFLIGHT_BYTES = 256 * 1024 * 1024    # demotion writes queued at once
LOAD_CHUNK = 5000
SSD_READERS = 4                           # RocksDB reads in flight (they release the GIL)
WIRE_STAGING_BYTES = 64 * 1024 * 1024     # SSD values staged outside the arena for socket replies, node-wide
LOOP_READ_BYTES = 4 * 1024 * 1024         # most bytes one command reads from the page cache on the loop
ARENA_READERS = frozenset(name.lower() for name in (KV_LEASE, KV_LEASEGPU, KV_LEASELAYERS))  # Command.name


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    checksum_failures: int = 0
    errors: int = 0


@dataclass
class TieringConfig:
    high_watermark: float = 0.90
    low_watermark: float = 0.85
    promote_hits: int = 2
    promote_window_s: float = 10.0
    write_through: bool = False


class TierManager:
    """Owns the SSD and GPU tiers of one engine and moves values between tiers."""

    def __init__(self, engine: Engine, cfg: TieringConfig, ssd_worker=None, gpu=None):
        self.engine = engine
        self.cfg = cfg
        self.worker = ssd_worker
        self.ssd = ssd_worker.tier if ssd_worker is not None else None
        self.gpu = gpu
        self.stats = {DRAM: TierStats(), SSD: TierStats(), GPU: TierStats()}
        self.loading = False
        self.recovered = 0
        self._heat: dict[int, tuple[int, float]] = {}   # entry -> (hits, window start)
        self._gpu_offset: dict[int, int] = {}             # entry of a GPU value -> its extent
        self._gpu_reads: dict[int, int] = {}              # GPU offset -> copies reading it
        self._gpu_doomed: dict[int, int] = {}             # GPU offset -> size, freed when read
        self._gpu_headers: dict[int, bytes] = {}          # entry of a GPU value -> its first bytes
        self._moving: dict[int, int] = {}                 # entry -> token of its copy to another tier
        self._tokens = itertools.count(1)
        self._inflight = 0
        self._heap_reading = 0              # bytes being read from SSD to be staged outside the arena
        self._newest = -1                   # the entry committed last (maybe a chain head whose tail is coming)
        self._ssd_trouble_until = 0.0
        self._stalled = False              # demotion found nothing to move: writes may evict
        self._unacked: list[asyncio.Future] = []
        self._copies = ThreadPoolExecutor(2, thread_name_prefix="tier-copy") if gpu is not None else None
        engine.can_demote = self.can_demote
        if self.ssd is not None:
            engine.quotas.capacity[SSD] = self.ssd.capacity_bytes     # what SSD quotas must fit in
        engine.commit_listeners.append(self.on_commit)
        engine.drop_listeners.append(self._on_drop)
        engine.evict_listeners.append(self._on_evict)
        if gpu is not None:
            engine.hit_listeners.append(self._on_hit)

    def gpu_offset(self, entry: int) -> int | None:
        """Where a GPU-tier value lives in the GPU arena (None: not on the GPU)."""
        return self._gpu_offset.get(entry)

    def gpu_header(self, entry: int) -> bytes:
        """The first HEADER_SIZE bytes of a GPU-tier value (a tensor's header), kept in host
        memory so a lease can hand them out without a device read."""
        return self._gpu_headers.get(entry, b"")

    # ------------------------------------------------------------ reads

    def pending_fetch(self, keys: list[bytes]) -> list[tuple[bytes, int]]:
        """(key, entry) of the keys whose values are not in DRAM."""
        engine, out = self.engine, []
        for key in keys:
            entry = engine.lookup(key)
            if entry is not None and engine.tier_code(entry) != DRAM and not engine.flags_of(entry) & STAGED:
                out.append((key, entry))
        return out

    async def fetch(self, items: list[tuple[bytes, int]], into_arena: bool = True) -> list[tuple]:
        """Bring values up for a command; results for `install`.

        Values go into fresh DRAM extents, except SSD values of a command that
        sends them over a socket (``into_arena`` False): those stay the bytes
        RocksDB's read returned, staged on the heap and sent from there, which
        spares a copy as costly as the read (docs/tiers.md). A value that this
        read makes hot still goes to the arena, its new home; so do values past
        WIRE_STAGING_BYTES staged or being read for staging on the whole node,
        bounding what the heap holds.
        """
        engine = self.engine
        heap_left = 0 if into_arena else WIRE_STAGING_BYTES - engine.moves.heap_bytes - self._heap_reading
        jobs, reading = [], 0
        for key, entry in items:
            size, on_gpu = engine.size_of(entry), engine.tier_code(entry) == GPU
            if not on_gpu and size <= heap_left - reading and not self._next_hit_is_hot(entry):
                reading += size
                jobs.append((key, entry, None, None, False))
                continue
            try:
                dest = engine.reserve(size, clean_only=True)
                view = dest.view
            except OutOfMemory:
                # Room only by dropping values that exist nowhere else: read into
                # the heap instead, for this command only.
                dest = bytearray(size)
                view = memoryview(dest)
            jobs.append((key, entry, dest, view, on_gpu))
        copies = [self._copy_from_gpu(entry, view) for _, entry, _, view, on_gpu in jobs if on_gpu]
        on_ssd = [i for i, job in enumerate(jobs) if not job[4]]
        reads = self._read_ssd(jobs, [i for i in on_ssd if jobs[i][3] is None])
        reads += self._read_ssd(jobs, [i for i in on_ssd if jobs[i][3] is not None])
        self._heap_reading += reading
        try:
            gathered = await asyncio.gather(*copies, *(future for future, _ in reads), return_exceptions=True)
        finally:
            self._heap_reading -= reading      # install stages them next: then moves.heap_bytes counts them
        results = dict(zip([i for i, job in enumerate(jobs) if job[4]], gathered[:len(copies)]))
        for (_, part), outcome in zip(reads, gathered[len(copies):]):
            results.update(zip(part, _spread(outcome, len(part))))
        return [(key, entry, dest, results[i]) for i, (key, entry, dest, _, _) in enumerate(jobs)]

    def fetch_now(self, items: list[tuple[bytes, int]], into_arena: bool = True) -> list[tuple] | None:
        """`fetch` without leaving the loop: SSD values for a socket reply whose bytes the page
        cache holds (`SSDTier.read_cached`: a memcpy and the xxh3, no thread round trip, which
        costs a GET more than the read), each into a DRAM extent (pre-faulted, sent from there
        as `fetch` sends a staged value) or, when DRAM has no clean room, a new buffer. None
        when any of them needs the disk, a reader thread or a promotion, or they are more
        than LOOP_READ_BYTES: then `fetch`."""
        engine = self.engine
        if into_arena or self.ssd is None or sum(engine.size_of(entry) for _, entry in items) > LOOP_READ_BYTES:
            return None
        fetched = []
        for key, entry in items:
            got = None
            if engine.tier_code(entry) == SSD and not self._next_hit_is_hot(entry):
                got = self._read_now(key, engine.size_of(entry))
            if got is None:
                for _, _, dest, _ in fetched:
                    if not isinstance(dest, bytearray):
                        engine.release(dest)
                return None
            fetched.append((key, entry, *got))
        return fetched

    def _read_now(self, key: bytes, size: int) -> tuple | None:
        """(destination, result) of a read from the page cache, as `fetch` gives them; None."""
        engine = self.engine
        try:
            dest = engine.reserve(size, clean_only=True)
        except OutOfMemory:             # no clean room: a buffer of its own, staged on the heap, within its bound
            if size > WIRE_STAGING_BYTES - engine.moves.heap_bytes - self._heap_reading:
                return None
            value = self.ssd.read_cached(key)
            return None if value is None else (value, value)
        got = self.ssd.read_cached(key, dest.view)
        if got is None:
            engine.release(dest)
            return None
        return dest, got

    def _read_ssd(self, jobs: list[tuple], chosen: list[int]) -> list[tuple[asyncio.Future, list[int]]]:
        """Start reading the SSD jobs at positions ``chosen`` (all into buffers, or all with
        none: `get_many`), one call per reader thread, its headers in one multi_get;
        (future, its positions) per call."""
        calls = []
        for part in _split(chosen, self.worker.readers) if chosen else []:
            keys, views = [jobs[i][0] for i in part], [jobs[i][3] for i in part]
            future = (self.worker.submit(self.ssd.get_many, keys) if views[0] is None
                      else self.worker.submit(self.ssd.get_many_into, keys, views))
            calls.append((future, part))
        return calls

    def _copy_from_gpu(self, entry: int, view: memoryview) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        offset = self.hold_gpu_extent(entry)
        if offset is None:                  # moved or dropped since the command asked
            done = loop.create_future()
            done.set_result(None)
            return done
        future = loop.run_in_executor(self._copies, self.gpu.read_into, offset, len(view), view)
        future.add_done_callback(lambda _: self.let_go_gpu_extent(offset))
        return future

    def hold_gpu_extent(self, entry: int) -> int | None:
        """The GPU extent of ``entry`` (None: not on the GPU), kept for a copy out of it until
        `let_go_gpu_extent`: neither freed nor given to another value meanwhile, whatever
        happens to the key. Copies to DRAM hold it on a worker thread, local clients under
        a KV.LEASEGPU lease over CUDA IPC."""
        offset = self._gpu_offset.get(entry)
        if offset is not None:
            self._gpu_reads[offset] = self._gpu_reads.get(offset, 0) + 1
        return offset

    def let_go_gpu_extent(self, offset: int) -> None:
        """A copy out of the extent at ``offset`` is done; the last one frees it if its value left."""
        left = self._gpu_reads[offset] - 1
        if left:
            self._gpu_reads[offset] = left
            return
        del self._gpu_reads[offset]
        if offset in self._gpu_doomed:
            self.gpu.free(offset, self._gpu_doomed.pop(offset))

    def _free_gpu(self, entry: int) -> None:
        """Let a value's GPU extent go, once no copy reads it any more."""
        offset = self._gpu_offset.pop(entry, None)
        if offset is None:
            return
        self._gpu_headers.pop(entry, None)
        size = self.engine.size_of(entry)
        if offset in self._gpu_reads:
            self._gpu_doomed[offset] = size
        else:
            self.gpu.free(offset, size)

    def install(self, fetched: list[tuple]) -> list[int]:
        """Put fetched copies in place; returns the entries staged for one command."""
        engine, staged = self.engine, []
        for key, entry, dest, result in fetched:
            current = engine.index.get(key) == entry and engine.tier_code(entry) != DRAM
            in_arena = dest is not None and not isinstance(dest, bytearray)
            if isinstance(result, BaseException) or result is None or not current:
                if in_arena:
                    engine.release(dest)
                if current:
                    self._lost(key, entry, result)
                continue
            tier = engine.tier_code(entry)
            self.stats[tier].hits += 1
            if not in_arena:
                if dest is None and not self._next_hit_is_hot(entry):
                    self._is_hot(entry)         # counted (a hit that makes it hot finds it an extent)
                engine.moves.stage_on_heap(entry, result if dest is None else dest)
                staged.append(entry)
            elif self._is_hot(entry):
                self._free_gpu(entry)
                engine.moves.home_in_dram(entry, dest)
                self.stats[tier].promotions += 1
            else:
                engine.moves.stage(entry, dest)
                staged.append(entry)
        return staged

    def unstage(self, staged: list[int]) -> None:
        for entry in staged:
            self.engine.moves.unstage(entry)

    def _lost(self, key: bytes, entry: int, result) -> None:
        """A value could not be read back: drop it so it is never served wrong."""
        tier = self.engine.tier_code(entry)
        if isinstance(result, CorruptValue):
            self.stats[tier].checksum_failures += 1
            log.warning("dropped %r: %s", key[:64], result)
        elif isinstance(result, BaseException):
            self.stats[tier].errors += 1
            log.warning("could not read %r from %s: %s", key[:64], "SSD" if tier == SSD else "GPU", result)
        self.stats[tier].misses += 1
        self.engine.drop(entry)

    def _is_hot(self, entry: int) -> bool:
        """Count a hit of ``entry``; whether it makes the value hot (then its count starts over)."""
        hits, start = self._hits_with_next(entry)
        if hits >= self.cfg.promote_hits:
            self._heat.pop(entry, None)
            return True
        self._heat[entry] = (hits, start)
        return False

    def _next_hit_is_hot(self, entry: int) -> bool:
        """Whether one more hit would make ``entry`` hot (nothing is counted)."""
        return self._hits_with_next(entry)[0] >= self.cfg.promote_hits

    def _hits_with_next(self, entry: int) -> tuple[int, float]:
        """Hits of ``entry`` in its window, one more included, and the window's start."""
        now = time.monotonic()
        hits, start = self._heat.get(entry, (0, now))
        if now - start > self.cfg.promote_window_s:
            hits, start = 0, now
        return hits + 1, start

    # ------------------------------------------------------------ engine events

    def _start_move(self, entry: int) -> int:
        token = next(self._tokens)
        self._moving[entry] = token
        return token

    def _end_move(self, entry: int, token: int) -> bool:
        """Whether ``entry`` still holds the value the move with ``token`` started on."""
        if self._moving.get(entry) != token:
            return False
        del self._moving[entry]
        return True

    def _on_drop(self, entry: int, key: bytes) -> None:
        """Engine drop listener: free the value's GPU extent, delete its SSD record."""
        engine = self.engine
        self._moving.pop(entry, None)
        self._heat.pop(entry, None)
        if engine.tier_code(entry) == GPU:
            self._free_gpu(entry)
        if engine.tier_code(entry) == SSD or engine.flags_of(entry) & ON_SSD:
            self.forget_on_ssd(key)

    def _on_evict(self, demoted: bool) -> None:
        """Engine eviction listener: DRAM let a value go (to SSD, or lost)."""
        if demoted:
            self.stats[DRAM].demotions += 1
        else:
            self.stats[DRAM].evictions += 1

    def _on_hit(self, entry: int) -> None:
        """Engine read listener (with a GPU tier): hot DRAM values move up."""
        if self.engine.tier_code(entry) == DRAM:
            self.note_dram_hit(entry)

    # ------------------------------------------------------------ writes

    def on_commit(self, key: bytes, entry: int) -> None:
        """Engine commit listener: write-through, and demotion when writes come fast."""
        self._heat.pop(entry, None)
        self._newest = entry
        if self.cfg.write_through and self._ssd_usable():
            self._write_to_ssd(key, entry, demote=False)
        if self.engine.allocator.used > self.cfg.high_watermark * self.engine.limit:
            self._demote_dram()          # do not wait for the cron when writes come fast

    def _write_to_ssd(self, key: bytes, entry: int, demote: bool) -> None:
        engine = self.engine
        hold = engine.holds.hold(entry)      # the bytes stay put while the writer reads them
        token = self._start_move(entry)
        size = engine.size_of(entry)
        self._inflight += size
        future = self.worker.put(key, engine.view(entry), self._parent_key(entry),
                                 engine.quotas.label(engine.owner_of(entry)))
        future.add_done_callback(lambda f: self._written(f, key, entry, hold, token, size, demote))

    def _parent_key(self, entry: int) -> bytes | None:
        parent = self.engine.eviction.parent_of(entry)
        return None if parent < 0 else self.engine.key_of(parent)

    def _written(self, future: asyncio.Future, key: bytes, entry: int, hold: int | None, token: int,
                 size: int, demote: bool) -> None:
        engine = self.engine
        same = self._end_move(entry, token) and engine.tier_code(entry) == DRAM
        self._inflight -= size
        engine.holds.release(hold)
        error = future.exception()
        if error is not None:
            self._ssd_failed(key, error)
            return
        if same:
            engine.moves.mark_on_ssd(entry, future.result().index_tag)
            self._stalled = False
            if demote:
                engine.moves.demoted_to_ssd(entry)
                self.stats[DRAM].demotions += 1
            return
        # The key changed while we wrote: our record is stale unless a newer one follows it.
        newer = engine.index.get(key)
        if newer is None or not (engine.flags_of(newer) & ON_SSD or newer in self._moving):
            self.forget_on_ssd(key)

    def _ssd_failed(self, key: bytes, error: BaseException) -> None:
        self.stats[SSD].errors += 1
        if isinstance(error, ValueTooLarge):
            log.warning("value %r is larger than the SSD tier; it stays in DRAM", key[:64])
            return
        if time.monotonic() >= self._ssd_trouble_until:
            log.error("SSD tier write failed (%s); pausing writes to it for 10 s", error)
        self._ssd_trouble_until = time.monotonic() + 10.0

    def _ssd_usable(self) -> bool:
        return self.worker is not None and time.monotonic() >= self._ssd_trouble_until

    def forget_on_ssd(self, key: bytes) -> None:
        """Delete the SSD record of ``key`` (after any put of it already queued).

        The connection holds the reply of the command that caused it until
        the delete has landed (`take_unacked`), so an acknowledged DEL or
        overwrite never comes back after a crash.
        """
        if self.worker is not None:
            future = self.worker.delete(key)
            future.add_done_callback(_log_failure)
            self._unacked.append(future)

    def has_unacked(self) -> bool:
        return bool(self._unacked)

    def take_unacked(self) -> list[asyncio.Future]:
        unacked, self._unacked = self._unacked, []
        return unacked

    # ------------------------------------------------------------ write pressure

    def can_demote(self) -> bool:
        """Whether waiting for demotions can free DRAM (so dropping a value is not needed)."""
        return self._ssd_usable() and not self._stalled

    async def make_room(self, size: int) -> None:
        """Demote at least ``size`` bytes and wait for the writes; the caller retries.

        When nothing is left to demote, eviction may drop values again
        (``can_demote`` turns False until a demotion lands).
        """
        if not self._demote(size) and not self._inflight:
            self._stalled = True
            return
        while self._inflight:
            await asyncio.sleep(0.001)

    # ------------------------------------------------------------ watermarks

    def cron(self) -> None:
        """Run by the server every 100 ms: keep every tier under its watermarks."""
        if self.loading:
            return
        self._demote_dram()
        self._trim_ssd()
        if self.gpu is not None:
            self._demote_gpu()
        self._forget_old_heat()

    def _over(self, used: int, capacity: int) -> int:
        """Bytes to move out of a tier: 0 under the high watermark, else down to the low one."""
        if used <= self.cfg.high_watermark * capacity:
            return 0
        return int(used - self.cfg.low_watermark * capacity)

    def _demote_dram(self) -> None:
        engine = self.engine
        self._demote(self._over(engine.allocator.used, engine.limit) - self._inflight)

    def _demote(self, nbytes: int) -> int:
        """Move the coldest DRAM values (about ``nbytes``) to SSD; returns bytes started."""
        engine, started = self.engine, 0
        while started < nbytes and self._ssd_usable() and self._inflight < MAX_INFLIGHT_BYTES:
            entry = engine.coldest(DRAM)
            if entry is None:
                break
            if entry == self._newest and self._inflight:
                # The value committed last is a leaf only until the rest of its chain
                # arrives (a pipelined chain is committed block by block): a move under
                # way will make room, so it waits rather than send a chain's head down.
                break
            started += engine.size_of(entry)
            if engine.flags_of(entry) & ON_SSD:
                engine.moves.demoted_to_ssd(entry)
                self.stats[DRAM].demotions += 1
            else:
                self._write_to_ssd(engine.key_of(entry), entry, demote=True)
        return started

    def _trim_ssd(self) -> None:
        if self.ssd is None:
            return
        engine = self.engine
        excess = self._over(self.ssd.used_bytes, self.ssd.capacity_bytes)
        while excess > 0:
            entry = engine.coldest(SSD)
            if entry is None:
                return
            excess -= engine.size_of(entry)
            engine.drop(entry)
            self.stats[SSD].evictions += 1

    def _demote_gpu(self) -> None:
        """Move the coldest GPU values down to DRAM, each held while it is copied."""
        engine = self.engine
        excess = self._over(self.gpu.used_bytes, self.gpu.capacity_bytes)
        items = []
        while excess > 0:
            entry = engine.coldest(GPU)
            if entry is None:
                break
            excess -= engine.size_of(entry)
            engine.eviction.hold(entry)
            items.append((engine.key_of(entry), entry, self._start_move(entry)))
        if items:
            asyncio.ensure_future(self._move_down_from_gpu(items))

    async def _move_down_from_gpu(self, items: list[tuple[bytes, int, int]]) -> None:
        engine = self.engine
        fetched = await self.fetch([(key, entry) for key, entry, _ in items])
        for (_, entry, token), (_, _, dest, result) in zip(items, fetched):
            same = self._end_move(entry, token)
            if same:
                engine.eviction.release_hold(entry)
            if isinstance(dest, bytearray):
                continue                        # DRAM is full: the value stays on the GPU
            if same and result is not None and not isinstance(result, BaseException) \
                    and engine.tier_code(entry) == GPU:
                self._free_gpu(entry)
                engine.moves.home_in_dram(entry, dest)
                self.stats[GPU].demotions += 1
            else:
                engine.release(dest)

    def note_dram_hit(self, entry: int) -> None:
        """A DRAM hit: a hot value moves up to the GPU tier."""
        if entry in self._moving or not self._is_hot(entry):
            return
        engine = self.engine
        size = engine.size_of(entry)
        offset = self.gpu.alloc(size)
        if offset is None:
            return
        hold, token = engine.holds.hold(entry), self._start_move(entry)
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._copies, self.gpu.write, offset, engine.view(entry))
        future.add_done_callback(lambda f: self._on_gpu(f, entry, hold, token, offset, size))

    def _on_gpu(self, future, entry: int, hold: int | None, token: int, offset: int, size: int) -> None:
        engine = self.engine
        same = self._end_move(entry, token) and engine.tier_code(entry) == DRAM
        engine.holds.release(hold)
        if future.exception() is None and same:
            self._gpu_offset[entry] = offset
            self._gpu_headers[entry] = bytes(engine.view(entry)[:HEADER_SIZE])
            engine.moves.moved_to_gpu(entry)
            self.stats[DRAM].promotions += 1
        else:
            self.gpu.free(offset, size)

    def _forget_old_heat(self) -> None:
        if len(self._heat) < 4096:
            return
        horizon = time.monotonic() - self.cfg.promote_window_s
        self._heat = {s: h for s, h in self._heat.items() if h[1] >= horizon}

    # ------------------------------------------------------------ restart

    async def load_index(self) -> None:
        """Index every value already on SSD (a warm restart), without stalling the loop."""
        if self.ssd is None:
            return
        self.loading = True
        start = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            records = await loop.run_in_executor(None, lambda: list(self.ssd.scan_index()))
            for i in range(0, len(records), LOAD_CHUNK):
                for rec in records[i:i + LOAD_CHUNK]:
                    self.engine.add_from_ssd(rec.key, rec.value_size, rec.parent, rec.tag,
                                             self.engine.quotas.named(rec.tenant))
                await asyncio.sleep(0)
            self.recovered = len(records)
        except TierError as exc:
            log.error("could not read the SSD tier's index: %s", exc)
        finally:
            self.loading = False
        took = time.monotonic() - start
        log.info("Recovered %d values from the SSD tier in %.2f s (%.0f values/s)", self.recovered, took,
                 self.recovered / took if took > 0 else 0.0)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.ssd.close()
        if self._copies is not None:
            self._copies.shutdown(wait=True)
        if self.gpu is not None:
            self.gpu.close()


def open_tiers(engine: Engine, config) -> TierManager | None:
    """The SSD and GPU tiers the configuration asks for, around ``engine``.

    An unusable SSD directory is logged and the node runs without the tier;
    an explicit --gpu-size without a usable GPU is an error (TierError).
    """
    from kvstore.tiers.gpu import GPUTier, gpu_available
    from kvstore.tiers.ssd import SSDTier
    from kvstore.tiers.ssd_worker import SSDWorker
    worker = gpu = None
    if config.ssd_dir:
        try:
            worker = SSDWorker(SSDTier.open(config.ssd_dir, config.ssd_size, compression=config.ssd_compression),
                               readers=SSD_READERS)
            log.info("SSD tier: %s (%d bytes)", config.ssd_dir, config.ssd_size)
        except TierError as exc:
            log.error("SSD tier disabled: %s", exc)
    if config.gpu_size:
        gpu = GPUTier.open(config.gpu_size, config.gpu_device)
        log.info("GPU tier: device %d, %d bytes", config.gpu_device, config.gpu_size)
    else:
        usable, reason = gpu_available()
        log.info("GPU tier: off (%s)", "no --gpu-size" if usable else reason)
    if worker is None and gpu is None:
        return None
    cfg = TieringConfig(config.high_watermark, config.low_watermark, config.promote_hits,
                        config.promote_window_ms / 1000, config.ssd_write_policy == "write-through")
    return TierManager(engine, cfg, worker, gpu)


def _split(items: list, ways: int) -> list[list]:
    """``items`` in at most ``ways`` runs of nearly equal length, in order."""
    size = -(-len(items) // ways)
    return [items[i:i + size] for i in range(0, len(items), size)]


def _spread(result, count: int) -> list:
    """Per-key results of a batched SSD read (a failure of the whole batch is every key's)."""
    return [result] * count if isinstance(result, BaseException) else result


def _log_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("SSD tier delete failed: %s", future.exception())
