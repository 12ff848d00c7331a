"""DRAM hit ratio of eviction policies on a trace-like read pattern, by replay.

Why a replay of the policy as a library rather than a run of the daemon: the
hit ratio depends only on which block is in DRAM at each access, so replaying
the access sequence through the very class the engine evicts with
(:class:`kvstore.store.eviction.SampledLRU`, with parent links and the entries'
tiers as its places) measures the policy we ship, at 300,000 accesses in
seconds, and lets exact LRU and the offline optimum see the same sequence.

The access sequence comes from a Mooncake trace: each request reads its
``hash_ids`` in order (block i's parent is block i-1), so shared prefixes are
reread and the tails of single conversations are not. A block read for the
first time is written into DRAM (a prefill computed it); a block reread from
SSD is a DRAM miss and comes back up after ``promote_hits`` hits within
``promote_window_ms`` (trace time), as `TierManager` promotes. DRAM holds
``capacity`` blocks (all blocks are the same size); SSD holds everything.

- kvstore: the store's policy. Over capacity, ``victim(IN_DRAM)`` picks the
  value to demote (the oldest leaf of DRAM), as ``Engine.coldest(DRAM)`` does.
- LRU: exact least-recently-used over DRAM, demand fetch.
- Belady: the offline optimum for unit-size blocks (MIN): on a miss the block
  whose next use is farthest away leaves, which may be the incoming one
  (it then stays on SSD). No policy can have more DRAM hits on the sequence.
"""
from __future__ import annotations

import heapq
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kvstore.store.eviction import NO_PARENT, SampledLRU

IN_DRAM, ON_SSD = 0, 1
NEVER = 1 << 62


@dataclass(frozen=True, slots=True)
class Access:
    block: int          # dense block number, 0..blocks-1
    parent: int         # the previous block of the same request, or NO_PARENT
    time_ms: int


def load_accesses(path: str | Path, requests: int | None = None) -> list[Access]:
    """The block reads of the first ``requests`` requests of a Mooncake trace, in order."""
    numbers: dict[int, int] = {}
    accesses = []
    with open(path) as trace:
        for n, line in enumerate(trace):
            if requests is not None and n >= requests:
                break
            record = json.loads(line)
            parent = NO_PARENT
            for hash_id in record["hash_ids"]:
                block = numbers.setdefault(hash_id, len(numbers))
                accesses.append(Access(block, parent, int(record["timestamp"])))
                parent = block
    return accesses


def working_set(accesses: list[Access]) -> int:
    """Distinct blocks in the sequence."""
    return len({a.block for a in accesses})


def kvstore_hits(accesses: list[Access], capacity: int, promote_hits: int = 1,
                 promote_window_ms: int = 10_000) -> int:
    """DRAM hits of the store's policy (SampledLRU over the DRAM tier) with ``capacity`` blocks."""
    policy = SampledLRU(capacity=working_set(accesses) + 1, places=2)
    tier: list[int] = []
    heat: dict[int, tuple[int, int]] = {}
    in_dram = hits = 0
    for access in accesses:
        block = access.block
        if block == len(tier):                       # first read: written into DRAM
            tier.append(IN_DRAM)
            policy.insert(block, access.parent, IN_DRAM)
            in_dram += 1
        elif tier[block] == IN_DRAM:
            hits += 1
            policy.touch(block)
            continue
        else:
            policy.touch(block)
            if not _is_hot(heat, block, access.time_ms, promote_hits, promote_window_ms):
                continue
            tier[block] = IN_DRAM
            policy.move(block, IN_DRAM)
            in_dram += 1
        while in_dram > capacity:
            victim = policy.victim(IN_DRAM)
            tier[victim] = ON_SSD
            policy.move(victim, ON_SSD)
            in_dram -= 1
    return hits


def _is_hot(heat: dict[int, tuple[int, int]], block: int, now_ms: int, needed: int, window_ms: int) -> bool:
    """TierManager's rule: ``needed`` hits within ``window_ms`` promote."""
    count, start = heat.get(block, (0, now_ms))
    if now_ms - start > window_ms:
        count, start = 0, now_ms
    count += 1
    if count >= needed:
        heat.pop(block, None)
        return True
    heat[block] = (count, start)
    return False


def lru_hits(accesses: list[Access], capacity: int) -> int:
    """DRAM hits of exact LRU with ``capacity`` blocks."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for access in accesses:
        if access.block in cache:
            hits += 1
            cache.move_to_end(access.block)
            continue
        cache[access.block] = None
        if len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def belady_hits(accesses: list[Access], capacity: int) -> int:
    """DRAM hits of the offline optimum (MIN, bypass allowed) with ``capacity`` blocks."""
    next_use = [NEVER] * len(accesses)
    seen: dict[int, int] = {}
    for i in range(len(accesses) - 1, -1, -1):
        block = accesses[i].block
        next_use[i] = seen.get(block, NEVER)
        seen[block] = i
    cached: dict[int, int] = {}                      # block -> its next use
    farthest: list[tuple[int, int]] = []             # (-next use, block), stale entries skipped
    hits = 0
    for i, access in enumerate(accesses):
        block, upcoming = access.block, next_use[i]
        if block in cached:
            hits += 1
        elif len(cached) >= capacity:
            while -farthest[0][0] != cached.get(farthest[0][1]):
                heapq.heappop(farthest)
            if -farthest[0][0] <= upcoming:          # the incoming block is needed last: bypass it
                continue
            del cached[heapq.heappop(farthest)[1]]
        cached[block] = upcoming
        heapq.heappush(farthest, (-upcoming, block))
    return hits
