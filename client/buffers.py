"""Turning the caller's objects into flat byte views, without copying them.

Values to send and buffers to receive into arrive as bytes, bytearray,
memoryview, numpy arrays (any dtype and shape) or anything else exporting the
buffer protocol. The SDK moves them as one-dimensional unsigned-byte
memoryviews over the caller's memory: `sendmsg` reads straight from them and
`recv_into` writes straight into them. A non-contiguous array cannot be viewed
that way; it is refused with a TypeError rather than silently copied.
"""
from __future__ import annotations

from typing import Any

Key = str | bytes


def key_bytes(key: Key) -> bytes:
    """A key as the bytes the node and the shared index know it by (str is UTF-8 encoded)."""
    return key.encode() if isinstance(key, str) else bytes(key)


def readable_view(value: Any) -> memoryview:
    """A flat byte view of a value to send (str is UTF-8 encoded)."""
    if isinstance(value, str):
        value = value.encode()
    return _flat(value, "value")


def writable_view(buffer: Any) -> memoryview:
    """A flat, writable byte view of a buffer to receive into."""
    view = _flat(buffer, "buffer")
    if view.readonly:
        raise TypeError(f"buffer must be writable, got a read-only {type(buffer).__name__}")
    return view


def _flat(obj: Any, what: str) -> memoryview:
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(f"{what} must support the buffer protocol, not {type(obj).__name__}") from None
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise TypeError(f"{what} must be C-contiguous (use numpy.ascontiguousarray)")
    return view.cast("B")
