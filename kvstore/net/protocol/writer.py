"""RESP reply encoders, byte-compatible with Redis's replies.

Replies are built as ``bytes`` and appended to the connection's write buffer;
large values never pass through here (the connection sends them straight from
the arena). RESP3 differs from RESP2 only where Redis's replies differ: nulls,
maps, sets and booleans; `Encoder` picks the form for a connection's protocol.
"""
from __future__ import annotations

CRLF = b"\r\n"
OK = b"+OK\r\n"
PONG = b"+PONG\r\n"
QUEUED = b"+QUEUED\r\n"
ZERO = b":0\r\n"
ONE = b":1\r\n"
EMPTY_ARRAY = b"*0\r\n"
NULL_BULK = b"$-1\r\n"
NULL_ARRAY = b"*-1\r\n"
NULL3 = b"_\r\n"


def simple(text: str | bytes) -> bytes:
    if isinstance(text, str):
        text = text.encode()
    return b"+" + text + CRLF


def error(text: str, code: str = "ERR") -> bytes:
    """An error reply ``-CODE text``; newlines are flattened as Redis does."""
    line = f"{code} {text}".replace("\r", " ").replace("\n", " ")
    return b"-" + line.encode("utf-8", "replace") + CRLF


def integer(n: int) -> bytes:
    return b":%d\r\n" % n


def bulk(data: bytes | bytearray | str) -> bytes:
    if isinstance(data, str):
        data = data.encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


def bulk_header(size: int) -> bytes:
    return b"$%d\r\n" % size


def array(encoded_items: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(encoded_items) + b"".join(encoded_items)


def bulk_array(items: list) -> bytes:
    """An array of bulk strings (None items become null bulks)."""
    return array([NULL_BULK if x is None else bulk(x) for x in items])


class Encoder:
    """Reply forms that depend on the connection's protocol version (2 or 3)."""

    def __init__(self, protocol: int = 2):
        self.protocol = protocol

    @property
    def null(self) -> bytes:
        return NULL3 if self.protocol == 3 else NULL_BULK

    @property
    def null_array(self) -> bytes:
        return NULL3 if self.protocol == 3 else NULL_ARRAY

    def map(self, pairs: list[tuple[bytes, bytes]]) -> bytes:
        """Encoded key/value pairs: a RESP3 map, or a flat RESP2 array."""
        body = b"".join(k + v for k, v in pairs)
        if self.protocol == 3:
            return b"%%%d\r\n" % len(pairs) + body
        return b"*%d\r\n" % (2 * len(pairs)) + body

    def set(self, encoded_items: list[bytes]) -> bytes:
        if self.protocol == 3:
            return b"~%d\r\n" % len(encoded_items) + b"".join(encoded_items)
        return array(encoded_items)

    def verbatim(self, text: str) -> bytes:
        """INFO-style text: a verbatim string in RESP3, a bulk in RESP2."""
        data = text.encode()
        if self.protocol == 3:
            return b"=%d\r\ntxt:%s\r\n" % (len(data) + 4, data)
        return bulk(data)
