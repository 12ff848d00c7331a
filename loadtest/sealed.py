"""Values that prove themselves, so a load or fault run can tell a lost value from a wrong one.

A cache may lose a value (eviction, a dead node); it may never serve a wrong
one. Every value a load test writes is sealed: it starts with the xxh64 of
its key and the xxh64 of its payload, so a reader checks what it got without
remembering what it wrote, and a value served under another key, cut short,
or with any byte changed fails. Payloads are slices of one random pool made
once (fresh random bytes per value would cost more CPU than the store does),
starting at an offset picked by a seed, so neighbouring values differ.
"""
from __future__ import annotations

import os

import xxhash

SEAL_BYTES = 16


def seal(key: bytes, payload: bytes | memoryview) -> bytes:
    """A value that proves itself: its key's hash and its payload's hash lead it."""
    return xxhash.xxh64_digest(key) + xxhash.xxh64_digest(payload) + payload


def verify(key: bytes, value: bytes | bytearray | memoryview | None) -> bool:
    """Whether ``value`` is a sealed value of ``key``; a missing value (None) is no wrong value."""
    if value is None:
        return True
    view = memoryview(value)
    return (len(view) >= SEAL_BYTES and view[:8] == xxhash.xxh64_digest(key)
            and view[8:16] == xxhash.xxh64_digest(view[16:]))


class PayloadPool:
    """Random bytes made once, handed out as slices: ``payload(size, seed)``."""

    def __init__(self, largest: int):
        self._bytes = memoryview(os.urandom(2 * largest))
        self._largest = largest

    def payload(self, size: int, seed: int) -> memoryview:
        if not 0 <= size <= self._largest:
            raise ValueError(f"payload of {size} bytes: the pool serves at most {self._largest}")
        start = (seed * 4099) % (self._largest + 1)
        return self._bytes[start:start + size]

    def sealed(self, key: bytes, size: int, seed: int) -> bytes:
        """A sealed value of exactly ``size`` bytes (at least the seal's 16) for ``key``."""
        return seal(key, self.payload(max(0, size - SEAL_BYTES), seed))
