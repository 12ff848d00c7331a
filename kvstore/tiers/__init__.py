"""Storage tiers below the DRAM arena: where a value's bytes live when not in DRAM.

A tier stores bytes and nothing else. The engine owns the index (key ->
entry, whose tier, offset, size and parent live in kvstore/store/entries.py); the tier
manager (kvstore/tiers/manager.py) owns the watermarks, the heat counters and every
decision to promote or demote; the eviction policy picks what goes. A tier
only answers "store this", "give me that back" and "how full are you",
synchronously and thread-safely, so the tier manager runs it on worker
threads and never on the event loop.

Two shapes of tier exist, because the media differ:

- **The GPU tier** (gpu.py) is one fixed device allocation carved into
  extents by :class:`kvstore.store.allocator.BuddyAllocator`, as the DRAM arena
  (kvstore/store/arena.py) is. The tier manager asks it for an extent
  (``alloc(size) -> offset | None``), copies bytes in and out by offset
  (``write(offset, buf)``, ``read_into(offset, size, buf)``), and gives it
  back (``free(offset, size)``). Nothing survives a restart.
- **The SSD tier** (ssd.py, run on threads by ssd_worker.py) stores whole
  values under their key and survives a restart: ``put(key, value, parent)
  -> stored_bytes``, ``get(key)``, ``get_into(key, buf)``, ``delete(key)``,
  and ``scan_index()`` to rebuild the engine's index after a restart. Every
  value is checksummed; a value that fails its check raises
  :class:`CorruptValue` and is dropped, so it is never served.

Every tier reports ``capacity_bytes`` and ``used_bytes`` (the SSD tier also
``count``) and has a ``close()``. Failures the operator must see (unusable
device, locked or unwritable directory, full disk, a value larger than the
whole tier) raise :class:`TierError` with a message that names the cause; the
node logs it and keeps serving from its other tiers.
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
