"""Exceptions raised by the client SDK, all in one place.

Every error the SDK raises derives from `KVError`, so an application can catch
the whole family at once. Where a Python built-in has the same meaning
(`ConnectionError`, `TimeoutError`) the SDK's class also derives from it, so
code written against plain sockets keeps working. A missing key is not an
error anywhere in the SDK: reads return None.

Server error replies (`-ERR ...`, `-OOM ...`) are parsed into `ResponseError`
values and raised only after every reply of a round trip has been read, so a
failed command never leaves unread replies on a pooled connection.
"""
from __future__ import annotations

import builtins


class KVError(Exception):
    """Base class of every exception the SDK raises."""


class ResponseError(KVError):
    """The server answered with an error reply; `message` is its text without the leading '-'."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    @property
    def code(self) -> str:
        """The error's first word, as Redis uses it (ERR, OOM, WRONGTYPE, NOAUTH, ...)."""
        return self.message.split(" ", 1)[0]


class AuthenticationError(ResponseError):
    """The server refused our password, or wants one and none was given."""


class ConnectionError(KVError, builtins.ConnectionError):
    """The connection could not be made, or broke during a request."""


class ProtocolError(ConnectionError):
    """The server sent bytes that are not valid RESP; the connection is dropped."""


class TimeoutError(KVError, builtins.TimeoutError):
    """The server did not answer (or a pooled connection did not free up) within the timeout."""


class BufferTooSmall(KVError):
    """A value did not fit the caller's buffer in get_into / batch_get_into.

    The value was read off the socket and dropped, so the connection stays
    usable; nothing past the buffer was written.
    """

    def __init__(self, key: str | bytes, size: int, capacity: int):
        super().__init__(f"value of {key!r} is {size} bytes, the buffer holds {capacity}")
        self.key = key
        self.size = size
        self.capacity = capacity


class FastPathUnavailable(ConnectionError):
    """fast_path="required", but the node's arena cannot be mapped (a remote node, another user)."""


class LeaseExpired(KVError):
    """A fast-path read kept losing its lease mid-copy (a tiny lease TTL, or a stalled client).

    Nothing torn was returned; the destination buffer's contents are unspecified.
    """


AUTH_ERROR_CODES = ("NOAUTH", "WRONGPASS", "NOPERM")
# Older servers reply -ERR with these texts for the same failures.
AUTH_ERROR_TEXTS = ("invalid password", "without any password configured")


def error_from_reply(message: str) -> ResponseError:
    """The exception for an error reply: authentication failures get their own class."""
    if message.split(" ", 1)[0] in AUTH_ERROR_CODES or any(m in message for m in AUTH_ERROR_TEXTS):
        return AuthenticationError(message)
    return ResponseError(message)
