"""Counters: INCR, DECR, INCRBY, DECRBY, INCRBYFLOAT.

A counter is a string value holding a number, as in Redis: the old value is
read, the new one written back in place (it is a few bytes) with its TTL
kept. INCRBYFLOAT computes in 80-bit long double and prints with Redis's
``%.17Lf`` then trims trailing zeros, so ``0.1 + 0.2`` reads ``0.3`` here too.
"""
from __future__ import annotations

import re

import numpy as np

from kvstore.commands.args import WRONG_TYPE_INT, parse_int
from kvstore.commands.table import CommandError, Family, first_key
from kvstore.net.protocol import writer

FAMILY = Family()

NOT_FLOAT = "value is not a valid float"
_FLOAT = re.compile(rb"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?inf(inity)?", re.IGNORECASE)
MAX_FLOAT_CHARS = 5 * 1024      # Redis's MAX_LONG_DOUBLE_CHARS: a number is shorter
MAX_INT_CHARS = 20              # "-9223372036854775808"


def _current(conn, key: bytes, longest: int, message: str) -> bytes | None:
    """The value of ``key`` (None when absent); one longer than any number refused before it is copied."""
    entry = conn.engine.lookup(key)
    if entry is None:
        return None
    if conn.engine.size_of(entry) > longest:
        raise CommandError(message)
    return conn.engine.value(entry)


def _store(conn, key: bytes, value: bytes) -> None:
    conn.engine.put(key, value, keep_ttl=True, owner=conn.user.tenant)


def _incr(conn, key: bytes, by: int) -> bytes:
    old = _current(conn, key, MAX_INT_CHARS, WRONG_TYPE_INT)
    value = 0 if old is None else parse_int(old)
    total = value + by
    if not -2**63 <= total < 2**63:
        raise CommandError("increment or decrement would overflow")
    _store(conn, key, b"%d" % total)
    return writer.integer(total)


@FAMILY.command("INCR", 2, "write denyoom fast", "string", "Increments the integer value of a key by one. Uses 0 as "
         "initial value if the key doesn't exist.", reads=first_key)
def incr(conn, args):
    return _incr(conn, args[1], 1)


@FAMILY.command("DECR", 2, "write denyoom fast", "string", "Decrements the integer value of a key by one. Uses 0 as "
         "initial value if the key doesn't exist.", reads=first_key)
def decr(conn, args):
    return _incr(conn, args[1], -1)


@FAMILY.command("INCRBY", 3, "write denyoom fast", "string", "Increments the integer value of a key by a number. Uses 0 "
         "as initial value if the key doesn't exist.", reads=first_key)
def incrby(conn, args):
    return _incr(conn, args[1], parse_int(args[2]))


@FAMILY.command("DECRBY", 3, "write denyoom fast", "string", "Decrements a number from the integer value of a key. Uses 0 "
         "as initial value if the key doesn't exist.", reads=first_key)
def decrby(conn, args):
    by = parse_int(args[2])
    if by == -2**63:
        raise CommandError("decrement would overflow")
    return _incr(conn, args[1], -by)


def _long_double(arg: bytes, message: str) -> np.longdouble:
    """A number as Redis's string2ld reads it: the whole argument, no spaces, no NaN, in range."""
    if len(arg) >= MAX_FLOAT_CHARS or not _FLOAT.fullmatch(arg):
        raise CommandError(message)
    value = np.longdouble(arg.decode())
    out_of_range = (np.isinf(value) and b"inf" not in arg.lower()) or \
        (value == 0 and re.search(rb"[1-9]", re.split(rb"[eE]", arg)[0]))
    if out_of_range:            # strtold's ERANGE: Redis refuses the number
        raise CommandError(message)
    return value


def format_long_double(value: np.longdouble) -> bytes:
    """Redis's ld2string(LD_STR_HUMAN): ``%.17Lf`` without trailing zeros."""
    text = np.format_float_positional(value, precision=17, unique=False, fractional=True, trim="-")
    return b"0" if text == "-0" else text.encode()


@FAMILY.command("INCRBYFLOAT", 3, "write denyoom fast", "string", "Increment the floating point value of a key by a "
         "number. Uses 0 as initial value if the key doesn't exist.", reads=first_key)
def incrbyfloat(conn, args):
    old = _current(conn, args[1], MAX_FLOAT_CHARS - 1, NOT_FLOAT)
    value = np.longdouble(0) if old is None else _long_double(old, NOT_FLOAT)
    by = _long_double(args[2], NOT_FLOAT)
    total = value + by
    if not np.isfinite(total):
        raise CommandError("increment would produce NaN or Infinity")
    text = format_long_double(total)
    _store(conn, args[1], text)
    return writer.bulk(text)
