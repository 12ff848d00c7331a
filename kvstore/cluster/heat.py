"""How hot a block is, how many copies its load needs, and where they go.

Heat is bytes, not only reads. Reads are counted per key in one-second
windows (a dict, reset each window), each as its value's size over the mean
size of the node's values in DRAM (`reference_bytes`, measured every window),
and at least one: a block twice the mean size is hot at half the reads, so a
block few readers fetch but that is large still gets copies, and a small value
is hot at ``hot-reads`` reads as before. A key is hot the moment its count in
the current window passes the trigger. Holders count the reads their copies
serve and report them when the owner renews their leases (`add_reported`),
so the owner judges a copy's heat by all its reads.

How many copies (`copies_for`). A block below the threshold is served by its
owner alone, so no node should carry more than the threshold of one block: a
hot block gets ``hot-replicas`` copies, and more at the end of any window
whose load, less a quarter, its owner and copies could not carry under the
threshold each (up to `MAX_COPIES`, or every other node): K follows a block's
read rate and bytes. Copies shrink only when twice the load would still need
fewer, so a load that wavers around what K copies carry (reads in a window
vary by their square root) does not make and drop a copy every window
(`Heat.fit`).

Targets (`rendezvous`). The K nodes with the highest xxh3 score of ``node id
+ key``, the owner excluded. Every node computes the same targets without a
word, a join or leave moves only the copies whose winner changed, and K
growing or shrinking adds or drops the last of them only.

Kept apart from replication.py, which acts on these numbers (copies, leases,
invalidation): this is the arithmetic, with no I/O.
"""
from __future__ import annotations

import math

import xxhash

from kvstore.store.entries import DRAM

WINDOW = 1.0                # seconds of one heat window, and of the lease renewal
MAX_COPIES = 16             # copies of one block, however hot (hot-replicas is at most this)
GROW_MARGIN = 1.25          # copies grow when the load passes what they carry by this much
SHRINK_MARGIN = 2.0         # ... and shrink only when this much load would still need fewer


def copies_for(load: float, trigger: float, least: int) -> int:
    """Copies of a hot block that carried ``load`` reads in a window where ``trigger`` makes a block
    hot: at least ``least``, and enough that owner and copies carry under ``trigger`` each."""
    return min(MAX_COPIES, max(least, math.ceil(load / trigger) - 1))


def reference_bytes(engine) -> float:
    """The mean size of the values in DRAM (infinite while there are none): a read of a value this
    large or smaller counts as one."""
    values = engine.entries.count_in[DRAM]
    return engine.allocator.requested / values if values else math.inf


def rendezvous(key: bytes, node_ids, count: int) -> tuple[str, ...]:
    """The ``count`` nodes with the highest score for ``key`` (highest random weight hashing)."""
    scored = sorted(node_ids, key=lambda node_id: xxhash.xxh3_64_intdigest(node_id.encode() + key), reverse=True)
    return tuple(scored[:count])


class Heat:
    """Reads per owned key, by size, in this window (``counts``) and the one closed last (``last``)."""

    def __init__(self, engine):
        self.engine = engine
        self.counts: dict[bytes, float] = {}
        self.last: dict[bytes, float] = {}
        self.trigger = 0                # reads by size in a window that make a key hot (0: never)
        self.least = 0                  # hot-replicas: the fewest copies of a hot key
        self._reference = math.inf

    def configure(self, hot_reads: float, hot_replicas: int) -> None:
        """The settings, and the size a read counts as one for (the values' mean changes as they do)."""
        self.trigger = math.floor(hot_reads * WINDOW) + 1 if hot_reads > 0 else 0
        self.least = hot_replicas
        self._reference = reference_bytes(self.engine)

    def weight(self, entry: int | None) -> float:
        """What one read of ``entry`` counts as: its size over the reference, at least 1."""
        return 1.0 if entry is None else max(1.0, self.engine.size_of(entry) / self._reference)

    def count(self, key: bytes, entry: int) -> bool:
        """Count one read of ``key``; True when this read makes it hot."""
        weight = self.weight(entry)
        n = self.counts.get(key, 0) + weight
        self.counts[key] = n
        return n >= self.trigger > n - weight

    def close_window(self) -> None:
        self.last, self.counts = self.counts, {}

    def add_reported(self, key: bytes, reads: int) -> None:
        """Reads a holder's copy of ``key`` served in the window just closed."""
        self.last[key] = self.last.get(key, 0) + reads * self.weight(self.engine.lookup(key))

    def cooled(self, key: bytes) -> bool:
        """Read less than half the trigger in the window just closed (hot-reads 0: always)."""
        return not self.trigger or self.last.get(key, 0) < self.trigger / 2

    def fit(self, key: bytes, have: int) -> int:
        """How many copies ``key``'s load in the window just closed needs, with ``have`` now: fewer
        only past the shrink margin, more only past the grow margin."""
        load = self.last.get(key, 0)
        fewer = copies_for(load * SHRINK_MARGIN, self.trigger, self.least)
        if fewer < have:
            return fewer
        return max(have, copies_for(load / GROW_MARGIN, self.trigger, self.least))

    def recent(self) -> dict[bytes, float]:
        """Reads per owned key, by size, over this window and the one before (what a slot move sends first)."""
        reads = dict(self.last)
        for key, count in self.counts.items():
            reads[key] = reads.get(key, 0) + count
        return reads
