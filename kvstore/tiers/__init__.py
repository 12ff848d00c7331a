"""Storage tiers: where a value's bytes live below the engine's index.

A tier stores bytes and nothing else. The engine owns the index (key ->
tier, location, size, parent), the watermarks, the heat counters and every
decision to promote, demote or evict; a tier only answers "store this",
"give me that back" and "how full are you", synchronously and thread-safely,
so the engine can call it from a worker thread and never from the event loop.

Two shapes of tier exist, because the media differ:

- **Arena tiers** (DRAM, GPU) are one fixed block of memory carved into
  extents by :class:`kvstore.allocator.BuddyAllocator`. The engine asks the
  tier for an extent (``alloc(size) -> offset | None``), copies bytes in and
  out by offset (``write(offset, buf)``, ``read_into(offset, size, buf)``),
  and returns it (``free(offset, size)``). Nothing survives a restart.
- **Keyed tiers** (SSD) store whole values under their key and survive a
  restart: ``put(key, value, parent) -> stored_bytes``, ``get(key)``,
  ``get_into(key, buf)``, ``delete(key)``, ``contains(key)``, and
  ``scan_index()`` to rebuild the engine's index after a restart. Every value
  is checksummed; a value that fails its check raises :class:`CorruptValue`
  and is dropped, so it is never served.

Every tier reports ``capacity_bytes``, ``used_bytes`` and ``count`` and has a
``close()``. Failures the operator must see (unusable device, locked or
unwritable directory, full disk, a value larger than the whole tier) raise
:class:`TierError` with a message that names the cause; the node logs it and
keeps serving from its other tiers.
"""
from __future__ import annotations


class TierError(Exception):
    """A tier cannot do what was asked; the message says why."""


class TierFull(TierError):
    """Storing this value would take the tier past its capacity."""


class ValueTooLarge(TierFull):
    """The value is larger than the whole tier: no eviction can make room."""


class CorruptValue(TierError):
    """A stored value failed its checksum; it has been dropped."""
