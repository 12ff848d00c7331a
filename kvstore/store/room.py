"""Making room for one write: free what it needs, at least cost, a bounded slice per loop turn.

What a write needs (kvstore/store/slabs.py): a value of up to half a page needs
one slot of its size class, or one free page to open a slab of that class; a
bigger value needs a run of free pages, made by freeing a window of as many
pages (a *region*, as is a page cleared for small classes).

- **Small write, class c.** The coldest leaf of class c frees a slot at the
  cost of one value. When the oldest leaf anywhere is older and of another
  small class, the classes may be out of balance: the page holding it is
  priced (below) and, when its newest value is older than class c's coldest,
  that page is cleared and handed over (memcached's slab rebalancing, decided
  by the LRU order itself; re-priced at most every REBALANCE_EVERY evictions
  of a class that kept its own). A big value older than the class's coldest
  goes first (LRU across sizes). No class starves: a class with no page at
  all always gets one this way.
- **Big write, c pages.** Candidate *windows* of c pages (unaligned, so no
  more is cleared than the value needs): the one starting at the oldest
  leaf, the one at the coldest value of this size class, windows starting
  and ending at the largest free chunks (they extend free space already
  there), and a few at random. Each is priced and the cheapest is fenced
  (nothing new lands in it) and cleared; the write takes it whole
  (``SlabAllocator.take``).

The price of a region (a window, or a page for small classes) is the
recency of its newest value, in [0, 1] (0 for the oldest leaf, 1 for the
latest access: what LRU would have to give up to free it), plus
BYTES_WEIGHT times the bytes it evicts over the bytes needed, each value's
bytes weighted by its own recency (a window already partly free, or cut by
fewer extents hanging over its edges, keeps more bytes live; the oldest
values add nothing, so the window that takes them costs no more than one
beside them), plus COUNT_WEIGHT per value, weighted the same way, and per
byte evicted over the bytes needed, unweighted (tie-breaks among regions as
cold: fewer values, fewer bytes, so no old value is left alone in a gap
that newer writes keep filling around it); a region holding a soft-pinned value ranks
after every region without, one whose chain continues outside it after both.
A region holding a value being read, or an extent not yet committed, cannot
be cleared now and is skipped for a while. As cheap, the oldest leaf's
windows win, then the class's, then those at free chunks.

Clearing keeps the prefix property: a value goes only once no child of it is
left in DRAM, so a value with cached children is reached by walking down to
its deepest cached descendant and evicting back up (post-order), a chain
draining from its tail.

The per-turn bound (Redis's maxmemory-eviction-tenacity): every eviction made
while one loop turn runs, whatever write asked for it, adds to ``spent``;
once it reaches ``budget`` the write is refused with ``NeedsRoom``. A command
refused so waits (the connection defers it, as it defers a write waiting for
the SSD tier: kvstore/commands/dispatch.py) on ``wait``, which goes on
evicting one bounded slice per turn and parks the extent it got for the
command's retry. Cascades that eviction triggers (listeners) run inside the
slice and count in it.

Tenants (kvstore/store/quotas.py): a write says which tenant makes it, and the
choice runs in passes, each sparing some tenants' values (the policy skips
them, and a region holding one is priced as unclearable); the write fails
with OutOfMemory only when the last pass found nothing to take.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from kvstore.store.entries import DRAM, OFFSET_SHIFT, OFFSET_UNIT, STAGED
from kvstore.store.eviction import HELD_MARK, SOFT_MARK
from kvstore.store.quotas import SHARED
from kvstore.store.slabs import FREE

COUNT_WEIGHT = 1e-6     # cost per value and per byte evicted: a tie-break between regions as cold
BYTES_WEIGHT = 0.03      # cost per byte evicted, over the bytes needed: prefer windows partly free already
SOFT_PENALTY = 1.0      # a region holding a soft-pinned value ranks after every region without
CROSS_PENALTY = 2.0     # ... one whose chain continues outside it, after both
REGION_SAMPLES = 8      # random candidate regions priced per choice
FREE_ANCHORS = 3        # free chunks (the largest) a big write's windows start or end at
WORK_BATCH = 32         # units of clearing a big write's window between two of `_make`'s checks
OWNERS_PER_PASS = 8192  # values priced in one numpy pass (about 0.4 ms), the slice checked between passes
REBALANCE_EVERY = 32    # a class that kept its own values re-prices another page after this many
BLOCKED_CHOICES = 64    # a region found uncleareable sits out this many choices
SMALL = -1              # the job key of a page being cleared for small classes
STALE_CALLS = 1000      # a job no write went on with over this many calls is dropped (its fence lifted)
UNCLAIMED_CALLS = 16    # ... a big write's window, once free, after this many


class OutOfMemory(Exception):
    """No room for a value: the store is full and may not evict, or the value is too big."""


class NeedsDemotion(OutOfMemory):
    """DRAM is full of values that exist nowhere else; demoting them to SSD will make room.

    The caller waits for ``TierManager.make_room(size)`` and tries again, instead
    of dropping values that were never written to SSD.
    """

    def __init__(self, size: int):
        super().__init__(f"waiting for the SSD tier to take {size} bytes")
        self.size = size


class NeedsRoom(NeedsDemotion):
    """Eviction for this write reached the per-turn bound: wait for ``RoomMaker.wait(size,
    owner)`` (eviction goes on in later turns) and try again."""

    def __init__(self, size: int, owner: int = SHARED):
        OutOfMemory.__init__(self, f"making room for {size} bytes over the next loop turns")
        self.size = size
        self.owner = owner          # the tenant writing


@dataclass
class Job:
    """A region being cleared: its fence, the owners still to evict, the walk down a chain."""

    offset: int
    span: int                   # bytes
    todo: list[int]
    touched: int = 0            # the maker's call count when a write last went on with it
    stack: list[tuple[int, bytes]] = field(default_factory=list)
    clear: int = 0              # its first page not yet seen free (those before stay free: it is fenced)


class RoomMaker:
    """The engine's eviction for writes (see the module doc)."""

    def __init__(self, engine):
        self.engine = engine
        self.budget: float | None = None        # seconds of eviction per loop turn; None: unbounded
        self.clock = time.perf_counter
        self.spent = 0.0                        # seconds spent evicting in this turn
        self.max_slice = 0.0                    # the longest any turn spent evicting
        self._turn_pending = False
        self.jobs: dict[int, Job] = {}          # a big write's bytes (SMALL: a page for small classes) -> job
        self.parked: dict[int, list[tuple[int, int]]] = {}   # chunk bytes -> (offset, size) got for waiters
        self._keep_own = [0] * engine.allocator.classes
        self._blocked: dict[int, int] = {}      # region offset -> choices it sits out
        self._rng = np.random.default_rng(1)
        self.protect: int | None = None         # the parent of the block being written (held meanwhile)
        self._began = 0.0                       # when the current call began
        self.calls = 0                          # calls of make

    # ------------------------------------------------------------ entry points

    def take_parked(self, size: int) -> int | None:
        """An extent made for a waiting write of the same size class, if any."""
        alloc = self.engine.allocator
        got = self.parked.get(alloc.chunk_size(size))
        if not got:
            return None
        offset, parked_size = got.pop()
        alloc.requested += size - parked_size
        return offset

    def release_parked(self) -> None:
        """Free the extents no waiting write came back for (FLUSHALL)."""
        alloc = self.engine.allocator
        for got in self.parked.values():
            for offset, size in got:
                alloc.free(offset, size)
        self.parked.clear()

    def make(self, size: int, clean_only: bool = False, owner: int = SHARED) -> int:
        """Evict until ``size`` bytes written by tenant ``owner`` can be placed; their offset.
        Raises NeedsRoom at the turn's bound, NeedsDemotion (a lower tier will take values),
        OutOfMemory."""
        start = self._began = self.clock()
        self.calls += 1
        self._note_turn()
        engine = self.engine
        policy = engine.eviction
        try:
            for spared in engine.quotas.passes(DRAM, owner, size):
                policy.spared = spared
                offset = self._make(size, clean_only, start, owner)
                if offset is not None:
                    return offset
            engine.stats.oom_rejections += 1
            raise OutOfMemory("no room in the DRAM tier")
        finally:
            policy.spared = None
            spent = self.clock() - start
            self.spent += spent
            self.max_slice = max(self.max_slice, self.spent)
            self.engine.stats.evict_seconds += spent

    async def wait(self, size: int, owner: int = SHARED) -> None:
        """Evict one bounded slice per loop turn until ``size`` bytes (written by tenant ``owner``)
        are placed; the extent is
        parked for the write's retry. Returns at once when the write cannot succeed (its retry
        gets the error)."""
        alloc, engine = self.engine.allocator, self.engine
        while True:
            await asyncio.sleep(0)
            offset = alloc.alloc(size, engine.limit)
            if offset is None:
                try:
                    offset = self.make(size, owner=owner)
                except NeedsRoom:
                    continue
                except OutOfMemory:
                    return
            self.parked.setdefault(alloc.chunk_size(size), []).append((offset, size))
            return

    def new_turn(self) -> None:
        """A new loop turn: its slice of eviction starts empty."""
        self.spent = 0.0
        self._turn_pending = False

    def _note_turn(self) -> None:
        if self.budget is None or self._turn_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.spent = 0.0            # no loop: each call is a turn of its own
            return
        self._turn_pending = True
        loop.call_soon(self.new_turn)   # runs at the start of the next turn

    # ------------------------------------------------------------ the loop

    def _over_budget(self) -> bool:
        return self.budget is not None and self.spent + self.clock() - self._began >= self.budget

    def _make(self, size: int, clean_only: bool, start: float, owner: int) -> int | None:
        """Evict under the policy's current ``spared`` until the write fits: its offset, or
        None when nothing more can go."""
        engine = self.engine
        alloc, stats = engine.allocator, engine.stats
        cls = alloc.class_of(size)
        big = alloc.is_big(cls)
        tiered = clean_only or engine.can_demote is not None
        while True:
            if self.budget is not None and self.spent + self.clock() - start >= self.budget:
                stats.evict_deferrals += 1
                raise NeedsRoom(size, owner)
            if tiered:
                progressed = self._tier_step(size, clean_only)
            elif engine.shed_first is not None and engine.shed_first():
                stats.evicted_other += 1
                progressed = True
            elif big and self._short_of_limit(size):
                progressed = self._fallback()
            else:
                progressed = self._big_step(alloc.chunk_size(size), cls) if big else self._small_step(cls)
            offset = self._take_window(size) if big and self.jobs else None
            if offset is not None:
                return offset
            if self.jobs:
                self._sweep()
            offset = alloc.alloc(size, engine.limit, runs=False)
            if offset is not None:
                if big and alloc.chunk_size(size) in self.jobs:
                    self._end(alloc.chunk_size(size))       # free space elsewhere served it first
                return offset
            if not progressed:
                return None

    def _take_window(self, size: int) -> int | None:
        """The window cleared for a big write of ``size`` bytes, handed out, once it is free."""
        alloc, chunk = self.engine.allocator, self.engine.allocator.chunk_size(size)
        job = self.jobs.get(chunk)
        if job is None or not self._cleared(job):
            return None
        self._end(chunk)
        return alloc.take(job.offset, size, self.engine.limit)

    def _short_of_limit(self, size: int) -> bool:
        """Whether a big write is refused by a lowered maxmemory, not by where free space lies:
        then it needs bytes freed, the oldest first, and clearing a region (perhaps one
        already free) would not help."""
        engine, alloc = self.engine, self.engine.allocator
        return engine.limit < alloc.capacity and alloc.footprint + -(-size // alloc.page) * alloc.page > engine.limit

    def _sweep(self) -> None:
        """End a free page's job (its fence would keep a bigger free chunk that holds it from
        any write), a free window its big write has not come back for (a write waiting for
        its turn comes back within a few calls), and any job no write has gone on with for
        a while."""
        calls = self.calls
        for key, job in list(self.jobs.items()):
            idle = calls - job.touched
            if idle > STALE_CALLS or ((key == SMALL or idle > UNCLAIMED_CALLS) and self._cleared(job)):
                self._end(key)

    def _cleared(self, job: Job) -> bool:
        """Whether the job's region is all free pages; pages seen free are not looked at again,
        so this costs O(1) an eviction, not a scan of the region."""
        alloc = self.engine.allocator
        page, end = job.clear, (job.offset + job.span) >> alloc.page_order
        classes, owners = alloc.page_class, alloc.big_owner
        while page < end and classes[page] < 0 and owners[page] == FREE:
            page += 1
        job.clear = page
        return page == end

    def _tier_step(self, size: int, clean_only: bool) -> bool:
        """With a lower tier: clean copies go first, then wait for demotions, then evict
        (the engine's order of old, one value a step)."""
        engine = self.engine
        if engine._evict_one(clean_only=True):
            return True
        if engine.can_demote is not None and engine.can_demote():
            raise NeedsDemotion(size)
        return not clean_only and engine._evict_one()

    # ------------------------------------------------------------ small writes

    def _small_step(self, cls: int) -> bool:
        engine = self.engine
        policy, alloc = engine.eviction, engine.allocator
        job = self.jobs.get(SMALL)
        if job is not None:
            return self._work(SMALL, job, "small")
        own = policy.peek(DRAM, cls)
        other = policy.oldest(DRAM, exclude_cls=cls)
        if own is not None and (other is None or own[0] <= other[0]):
            return self._evict(own[1], "small")
        if other is None:
            return self._fallback()
        if alloc.is_big(alloc.class_of(engine.entries.size[other[1]])):
            return self._evict(other[1], "small")        # a big value older than the class's coldest
        if own is not None and self._keep_own[cls] > 0:
            self._keep_own[cls] -= 1
            return self._evict(own[1], "small")
        page_mask = ~(alloc.page - 1)
        page = engine.entries.dram_offset(other[1]) & page_mask
        now, oldest = policy.clock, other[0]
        cost = self._price(page, alloc.page, oldest, now)
        own_cost = None if own is None else self._recency(own[0], oldest, now)
        if cost is not None and (own_cost is None or cost < own_cost):
            return self._start(SMALL, page, alloc.page, "small")
        if own is not None:
            self._keep_own[cls] = REBALANCE_EVERY
            return self._evict(own[1], "small")
        region = self._choose(alloc.page, -1)
        return self._start(SMALL, region, alloc.page, "small") if region is not None else self._fallback()

    # ------------------------------------------------------------ big writes

    def _big_step(self, chunk: int, cls: int) -> bool:
        job = self.jobs.get(chunk)
        if job is not None:
            return self._work_batch(chunk, job)
        region = self._choose(chunk, cls)
        if region is None:
            return self._fallback()
        return self._start(chunk, region, chunk, "big")

    def _choose(self, span: int, cls: int) -> int | None:
        """The start of the cheapest window of ``span`` bytes (whole pages) to clear among the
        candidates; None if none can be."""
        engine = self.engine
        policy, alloc, entries = engine.eviction, engine.allocator, engine.entries
        page, last = alloc.page, alloc.capacity - span

        def at(offset: int) -> int:
            return min(offset & ~(page - 1), last)

        def around(entry: int, level: int) -> None:
            """The windows starting at the value and ending at its end (the one below it
            takes what lies below: older values left in a gap go with it)."""
            start = entries.dram_offset(entry)
            end = (start + entries.size[entry] + page - 1) & ~(page - 1)
            rank.setdefault(at(max(0, end - span)), level)
            rank.setdefault(at(start), level)

        rank: dict[int, int] = {}                   # as cheap, the lower rank wins (random ones last)
        oldest = policy.oldest(DRAM)
        if oldest is not None:
            around(oldest[1], 0)
        exact = policy.peek(DRAM, cls) if cls >= 0 else None
        if exact is not None:
            around(exact[1], 1)
        if span > page:
            for lo, hi in self._largest_free(FREE_ANCHORS):
                rank.setdefault(at(lo), 2)
                rank.setdefault(at(max(0, hi - span)), 2)
        candidates = set(rank)
        starts = last // page + 1
        picks = range(starts) if starts <= REGION_SAMPLES else \
            self._rng.integers(0, starts, REGION_SAMPLES).tolist()
        candidates.update(i * page for i in picks)
        for region in list(self._blocked):
            left = self._blocked[region] - 1
            if left <= 0:
                del self._blocked[region]
            else:
                self._blocked[region] = left
        regions = sorted((region for region in candidates if region >= 0 and region not in self._blocked
                          and not any(region < hi and lo < region + span for lo, hi in alloc.fences)),
                         key=lambda region: rank.get(region, 3))
        floor, now, best = oldest[0] if oldest is not None else 0, policy.clock, None
        for batch, groups in self._batches(regions, span):
            if best is not None and self._over_budget():
                break                               # pricing counts in the turn's slice too
            for cost, region in zip(self._prices(batch, span, floor, now, groups), batch):
                if cost is not None and (best is None or (cost, rank.get(region, 3), region) < best):
                    best = (cost, rank.get(region, 3), region)
        return None if best is None else best[2]

    def _batches(self, regions: list[int], span: int):
        """The regions in order, in batches of about OWNERS_PER_PASS values (one numpy pass
        each), with each region's owners."""
        batch, groups, owners = [], [], 0
        for region in regions:
            group = self.engine.allocator.region_owners(region, region + span)
            batch.append(region)
            groups.append(group)
            owners += len(group)
            if owners >= OWNERS_PER_PASS:
                yield batch, groups
                batch, groups, owners = [], [], 0
        if batch:
            yield batch, groups

    def _largest_free(self, count: int) -> list[tuple[int, int]]:
        """Up to ``count`` of the largest free buddy chunks of a page or more, as (lo, hi)."""
        alloc = self.engine.allocator
        free, out = alloc.buddy._free, []
        for order in range(alloc.max_order, alloc.page_order - 1, -1):
            for offset in free[order]:
                out.append((offset, offset + (1 << order)))
                if len(out) == count:
                    return out
        return out

    # ------------------------------------------------------------ pricing

    @staticmethod
    def _recency(stamp: int, oldest: int, now: int) -> float:
        return min(1.0, max(0.0, (stamp - oldest) / (now - oldest + 1)))

    def _price(self, region: int, span: int, oldest: int, now: int) -> float | None:
        """What clearing the ``span`` bytes at ``region`` costs (module doc); None when they
        cannot be cleared now."""
        return self._prices([region], span, oldest, now, [self.engine.allocator.region_owners(region, region + span)])[0]

    def _prices(self, regions: list[int], span: int, oldest: int, now: int,
                groups: list[np.ndarray]) -> list[float | None]:
        """``_price`` of each region (``groups``: their owners), in one pass over all their
        values: a choice prices a dozen or more windows, and numpy's cost is per call, not
        per value."""
        engine = self.engine
        policy, entries = engine.eviction, engine.entries
        counts = np.array([len(group) for group in groups], dtype=np.int64)
        if not counts.sum():
            return [0.0] * len(regions)
        owners = np.concatenate(groups).astype(np.int64)
        window = np.repeat(np.arange(len(regions)), counts)
        starts = np.array(regions, dtype=np.int64)[window]
        lo, hi = starts >> OFFSET_SHIFT, (starts + span) >> OFFSET_SHIFT
        at = np.maximum(owners, 0)
        marks = np.frombuffer(policy._marks, dtype=np.uint8)[at]
        blocked = (owners < 0) | ~self._in_dram_overlapping(at, lo, hi) | ((marks & HELD_MARK) != 0) \
            | ((np.frombuffer(entries.flags, dtype=np.int8)[at] & STAGED) != 0)
        if policy.spared is not None:               # a value of a tenant this write must spare
            blocked |= np.frombuffer(policy.spared, dtype=np.bool_)[np.frombuffer(entries.owner, dtype=np.uint8)[at]]
        # an extent no committed value owns, a stale owner (a held extent), a value being read
        unclearable = np.bincount(window, weights=blocked, minlength=len(regions)) > 0
        leaf_pos = np.frombuffer(policy._leaf_pos, dtype=np.int32)[at]
        children = np.bincount(window, weights=np.where(leaf_pos < 0, -leaf_pos, 0), minlength=len(regions))
        parents = np.frombuffer(policy._parent, dtype=np.int32)[at].astype(np.int64)
        inside = np.bincount(window, weights=(parents >= 0) & self._in_dram_overlapping(np.maximum(parents, 0), lo, hi),
                             minlength=len(regions))
        soft = np.bincount(window, weights=(marks & SOFT_MARK) != 0, minlength=len(regions)) > 0
        stamps = np.frombuffer(policy._stamp, dtype=np.uint32)[at].astype(np.int64)
        recency = np.clip((stamps - oldest) / (now - oldest + 1), 0.0, 1.0)
        full = counts > 0
        newest = np.zeros(len(regions))
        newest[full] = np.maximum.reduceat(recency, (np.cumsum(counts) - counts)[full])
        # values count by their own recency: the oldest leaf adds nothing (LRU evicts it anyway),
        # so a window holding it costs no more than one beside it as cold
        sizes = np.frombuffer(entries.size, dtype=np.uint32)[at]
        evicted = np.bincount(window, weights=sizes * recency, minlength=len(regions))
        tie = np.bincount(window, weights=recency + sizes / span, minlength=len(regions))
        cost = newest + BYTES_WEIGHT * evicted / span + COUNT_WEIGHT * tie \
            + SOFT_PENALTY * soft + CROSS_PENALTY * (children > inside)
        return [None if unclearable[i] else float(cost[i]) if full[i] else 0.0 for i in range(len(regions))]

    def _in_dram_overlapping(self, entries_at: np.ndarray, lo, hi) -> np.ndarray:
        """Per entry, whether its DRAM value overlaps the units [lo, hi) (an owner hint that
        says otherwise is stale: the extent is held for a reader); ``lo`` and ``hi`` per entry
        or one for all."""
        entries = self.engine.entries
        units = np.frombuffer(entries.offset_units, dtype=np.uint32)[entries_at].astype(np.int64)
        ends = units + ((np.frombuffer(entries.size, dtype=np.uint32)[entries_at] + OFFSET_UNIT - 1) >> OFFSET_SHIFT)
        return (np.frombuffer(entries.tier, dtype=np.int8)[entries_at] == DRAM) & (units < hi) & (ends > lo)

    # ------------------------------------------------------------ clearing

    def _start(self, key: int, region: int, span: int, cause: str) -> bool:
        owners = self.engine.allocator.region_owners(region, region + span)
        job = self.jobs[key] = Job(region, span, owners[::-1].tolist(), self.calls,
                                   clear=region >> self.engine.allocator.page_order)
        self.engine.allocator.fences.append((region, region + span))
        self.engine.stats.evict_regions += 1
        return self._work(key, job, cause)

    def _end(self, key: int, blocked: bool = False) -> None:
        job = self.jobs.pop(key)
        self.engine.allocator.fences.remove((job.offset, job.offset + job.span))
        if blocked:
            self._blocked[job.offset] = BLOCKED_CHOICES

    def _work(self, key: int, job: Job, cause: str) -> bool:
        """One unit of clearing: one step down a chain, or one eviction."""
        job.touched = self.calls
        engine = self.engine
        entries, policy = engine.entries, engine.eviction
        stack, end = job.stack, job.offset + job.span
        if self._cleared(job):
            if key == SMALL:
                self._end(key)
            return True                             # a big write's window waits for it (_take_window)
        while True:
            if not stack:
                while job.todo:
                    entry = job.todo.pop()
                    key_bytes = entries.keys[entry] if 0 <= entry < len(entries.keys) else None
                    if key_bytes is not None and entries.tier[entry] == DRAM \
                            and self._overlaps(entry, job.offset, end):
                        stack.append((entry, key_bytes))
                        break
                else:
                    self._end(key, blocked=True)     # what is left there is no value's to evict
                    return True
            entry, key_bytes = stack[-1]
            if entries.keys[entry] is not key_bytes or entries.tier[entry] != DRAM:
                stack.pop()
                continue
            child = self._child_in_dram(entry)
            if child is not None:
                stack.append((child, entries.keys[child]))
                return True
            if policy.is_held(entry) or policy.is_spared(entry):
                self._end(key, blocked=True)
                return True
            stack.pop()
            return self._evict(entry, cause if self._overlaps(entry, job.offset, end) else "beyond")

    def _work_batch(self, chunk: int, job: Job) -> bool:
        """Up to WORK_BATCH units of clearing a big write's window, until it is clear or the
        turn's slice is spent: `_make`'s own checks between two units (is the window free,
        does free space elsewhere serve the write) cost as much as an eviction, and a window
        of small values takes thousands of units."""
        for done in range(WORK_BATCH):
            if not self._work(chunk, job, "big"):
                return done > 0
            if self.jobs.get(chunk) is not job or self._cleared(job) or self._over_budget():
                break
        return True

    def _overlaps(self, entry: int, lo: int, hi: int) -> bool:
        offset = self.engine.entries.dram_offset(entry)
        return offset < hi and offset + self.engine.entries.size[entry] > lo

    def _child_in_dram(self, entry: int) -> int | None:
        policy = self.engine.eviction
        place = policy._place
        child = policy._first_child[entry]
        while child != -1:
            if place[child] == DRAM:
                return child
            child = policy._next_sibling[child]
        return None

    def _evict(self, entry: int, cause: str) -> bool:
        stats = self.engine.stats
        self.engine.evict(entry)
        if cause == "small":
            stats.evicted_for_small += 1
        elif cause == "big":
            stats.evicted_for_big += 1
        elif cause == "beyond":
            stats.evicted_beyond_region += 1
        else:
            stats.evicted_other += 1
        return True

    def _fallback(self) -> bool:
        """Nothing priced can be cleared: the policy's own next victim (a soft-pinned leaf,
        or a value above a held one, unless the only hold is the written block's parent:
        then the write gives up its protection rather than cut a chain above a leaf)."""
        entry = self.engine.eviction.victim(DRAM, allow_parent=self.protect is None)
        return entry is not None and self._evict(entry, "other")
