"""Keyspace commands: DEL, UNLINK, EXISTS, TYPE, the expiry family, DBSIZE,
FLUSHDB/FLUSHALL, SCAN and KEYS.

Patterns follow Redis's stringmatchlen (``*``, ``?``, ``[a-z]``, ``[^x]``,
backslash escapes); they are translated once to a regular expression and
cached, since SCAN calls repeat the same pattern.
"""
from __future__ import annotations

from kvstore.commands.args import SYNTAX, options, parse_int
from kvstore.commands.table import CommandError, command
from kvstore.engine import now_ms
from kvstore.glob import matches
from kvstore.protocol import writer


@command("DEL", -2, "write", "keyspace", "Deletes one or more keys.", keys=(1, -1, 1))
def del_(conn, args):
    return writer.integer(sum(conn.engine.delete(k) for k in args[1:]))


@command("UNLINK", -2, "write fast", "keyspace", "Asynchronously deletes one or more keys.", keys=(1, -1, 1))
def unlink(conn, args):
    return del_(conn, args)


@command("EXISTS", -2, "readonly fast", "keyspace", "Determines whether one or more keys exist.", keys=(1, -1, 1))
def exists(conn, args):
    return writer.integer(sum(conn.engine.lookup(k) is not None for k in args[1:]))


@command("TYPE", 2, "readonly fast", "keyspace", "Determines the type of value stored at a key.")
def type_(conn, args):
    return writer.simple("none" if conn.engine.lookup(args[1]) is None else "string")


def _expire(conn, args, unit_ms: int, absolute: bool = False):
    key, amount = args[1], parse_int(args[2])
    flags = set()
    for opt in args[3:]:
        if opt.upper() not in (b"NX", b"XX", b"GT", b"LT"):
            raise CommandError(f"Unsupported option {opt.decode(errors='replace')}")
        flags.add(opt.upper())
    if b"NX" in flags and len(flags) > 1:
        raise CommandError("NX and XX, GT or LT options at the same time are not compatible")
    if {b"GT", b"LT"} <= flags:
        raise CommandError("GT and LT options at the same time are not compatible")
    name = args[0].decode().lower()
    base = 0 if absolute else now_ms()
    if abs(amount) > 2**63 // unit_ms or amount * unit_ms > 2**63 - 1 - base:
        raise CommandError(f"invalid expire time in '{name}' command")
    deadline = amount * unit_ms + base
    engine = conn.engine
    if engine.lookup(key) is None:
        return writer.ZERO
    current = engine.expires.get(key)
    if (b"NX" in flags and current is not None) or (b"XX" in flags and current is None) \
            or (b"GT" in flags and (current is None or deadline <= current)) \
            or (b"LT" in flags and current is not None and deadline >= current):
        return writer.ZERO
    if deadline <= now_ms():
        engine.delete(key)
    else:
        engine.set_expire(key, deadline)
    return writer.ONE


@command("EXPIRE", -3, "write fast", "keyspace", "Sets the expiration time of a key in seconds.")
def expire(conn, args):
    return _expire(conn, args, 1000)


@command("PEXPIRE", -3, "write fast", "keyspace", "Sets the expiration time of a key in milliseconds.")
def pexpire(conn, args):
    return _expire(conn, args, 1)


def _ttl(conn, key: bytes, unit_ms: int) -> bytes:
    if conn.engine.lookup(key) is None:
        return writer.integer(-2)
    deadline = conn.engine.expires.get(key)
    if deadline is None:
        return writer.integer(-1)
    left = max(0, deadline - now_ms())
    return writer.integer((left + unit_ms // 2) // unit_ms)


@command("TTL", 2, "readonly fast", "keyspace", "Returns the expiration time in seconds of a key.")
def ttl(conn, args):
    return _ttl(conn, args[1], 1000)


@command("PTTL", 2, "readonly fast", "keyspace", "Returns the expiration time in milliseconds of a key.")
def pttl(conn, args):
    return _ttl(conn, args[1], 1)


@command("PERSIST", 2, "write fast", "keyspace", "Removes the expiration time of a key.")
def persist(conn, args):
    if conn.engine.lookup(args[1]) is None:
        return writer.ZERO
    return writer.integer(int(conn.engine.persist(args[1])))


@command("DBSIZE", 1, "readonly fast loading", "server", "Returns the number of keys in the database.", keys=(0, 0, 0))
def dbsize(conn, args):
    return writer.integer(len(conn.engine.index))


def _flush(conn, args):
    if len(args) > 2 or (len(args) == 2 and args[1].upper() not in (b"ASYNC", b"SYNC")):
        raise CommandError(SYNTAX)
    conn.engine.flush()
    return writer.OK


@command("FLUSHDB", -1, "write", "server", "Removes all keys from the current database.", keys=(0, 0, 0))
def flushdb(conn, args):
    return _flush(conn, args)


@command("FLUSHALL", -1, "write", "server", "Removes all keys from all databases.", keys=(0, 0, 0))
def flushall(conn, args):
    return _flush(conn, args)


@command("SCAN", -2, "readonly", "keyspace", "Iterates over the key names in the database.", keys=(0, 0, 0))
def scan(conn, args):
    try:
        cursor = int(args[1]) if args[1].isdigit() else -1
    except ValueError:
        cursor = -1
    if cursor < 0 or cursor >= 2**64:
        raise CommandError("invalid cursor")
    pattern, count, want_type = None, 10, None
    for name, (value,) in options(args, 2, {b"MATCH": 1, b"COUNT": 1, b"TYPE": 1}):
        if name == b"MATCH":
            pattern = value
        elif name == b"TYPE":
            want_type = value.lower()
        elif (count := parse_int(value)) < 1:
            raise CommandError(SYNTAX)
    cursor, keys = conn.engine.scan(cursor, count)
    if want_type not in (None, b"string"):
        keys = []
    keys = [k for k in keys if matches(pattern, k)]
    return writer.array([writer.bulk(str(cursor)), writer.bulk_array(keys)])


@command("KEYS", 2, "readonly", "keyspace", "Returns all key names that match a pattern.", keys=(0, 0, 0))
def keys(conn, args):
    engine = conn.engine
    found = [k for k in list(engine.index) if matches(args[1], k) and engine.lookup(k) is not None]
    return writer.bulk_array(found)
