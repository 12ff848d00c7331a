"""This process's read-only view of the node's shared index: where each DRAM value is.

The node publishes its DRAM values in a table that comes with the arena
(kvstore/local/shared_index.py has the layout, the seqlock and the x86 argument),
so a get of a key this client holds no lease on is, when the key is there, a
lookup, one memcpy out of the arena and two checks, with no round trip:

1. `find`: hash the key, load the sequence word of the bucket whose hash
   matches (odd: being written, a miss), then the offset, the size and the
   key's bytes, compared exactly;
2. the caller copies the value's bytes (after checking the offset and size
   lie inside the arena: a torn read of them is possible, only a checked
   copy is trusted);
3. `unchanged`: load the sequence word again; equal means no write touched
   the bucket since step 1, and the node empties a bucket before it lets the
   value's bytes go, so the copy is the key's value, whole;
4. the node is still alive (`arena.Arena.node_alive`): a node killed with
   SIGKILL empties no bucket, so its table is trusted only while the
   connection that mapped it is open.

Anything else (no bucket, a bucket being written, a changed sequence, a key
too long to be published) is a miss, and the get asks the node (KV.LEASE),
which is always right. The ordering argument holds for x86's TSO memory
model only: on other processors loads may pass older loads, and Python
cannot place the fences a seqlock reader would need there, so `USABLE` is
False and every first get asks the node.
"""
from __future__ import annotations

import mmap
import platform

from proto import fastpath as fp

USABLE = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")

_WORDS = fp.INDEX_BUCKET_WORDS
_KEY_MAX = fp.INDEX_KEY_MAX
_SIZE_MASK = (1 << 32) - 1


class SharedIndexView:
    """The node's shared index, mapped read-only."""

    def __init__(self, fd: int, buckets: int):
        if buckets < fp.INDEX_WAYS or buckets & (buckets - 1):
            raise ValueError(f"a shared index of {buckets} buckets (a power of two, at least {fp.INDEX_WAYS})")
        self._map = mmap.mmap(fd, buckets * fp.INDEX_BUCKET_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
        self._bytes = memoryview(self._map)
        self._words = self._bytes.cast("Q")
        self._set_mask = buckets // fp.INDEX_WAYS - 1

    def find(self, key: bytes) -> tuple[int, int, int, int] | None:
        """Where ``key``'s value is, as (sequence word, its value, offset, size), or None.

        Hand the first two to `unchanged` after copying: only then is the copy trusted.
        """
        if len(key) > _KEY_MAX:
            return None
        digest = fp.index_hash(key)
        words = self._words
        first = (digest & self._set_mask) * fp.INDEX_WAYS * _WORDS
        for at in range(first, first + fp.INDEX_WAYS * _WORDS, _WORDS):
            if words[at + fp.INDEX_HASH] != digest:
                continue
            seq = words[at + fp.INDEX_SEQ]
            if seq & 1:
                return None
            offset, size_and_length = words[at + fp.INDEX_OFFSET], words[at + fp.INDEX_SIZE]
            start = at * 8 + fp.INDEX_KEY_AT
            if size_and_length >> 32 == len(key) and self._bytes[start:start + len(key)] == key:
                return at, seq, offset, size_and_length & _SIZE_MASK
        return None

    def unchanged(self, at: int, seq: int) -> bool:
        """Whether the bucket found at ``at`` still holds what `find` read (load after the copy)."""
        return self._words[at] == seq
