"""Keyspace commands: DEL, UNLINK, EXISTS, TYPE, TOUCH, RANDOMKEY, OBJECT, the expiry
family (EXPIRE, PEXPIRE, EXPIREAT, PEXPIREAT, TTL, PTTL, EXPIRETIME, PEXPIRETIME,
PERSIST), DBSIZE, FLUSHDB/FLUSHALL, SCAN and KEYS.

Patterns follow Redis's stringmatchlen (``*``, ``?``, ``[a-z]``, ``[^x]``,
backslash escapes); they are translated once to a regular expression and
cached, since SCAN calls repeat the same pattern.
"""
from __future__ import annotations

import random

from kvstore.commands.args import SYNTAX, options, parse_int
from kvstore.commands.glob import matches
from kvstore.commands.strings import is_raw
from kvstore.commands.table import CommandError, Family
from kvstore.net.protocol import writer
from kvstore.store.deadlines import now_ms
from kvstore.store.watch import touched

FAMILY = Family()


@FAMILY.command("DEL", -2, "write", "keyspace", "Deletes one or more keys.", keys=(1, -1, 1))
def del_(conn, args):
    return writer.integer(sum(conn.engine.delete(k) for k in args[1:]))


@FAMILY.command("UNLINK", -2, "write fast", "keyspace", "Asynchronously deletes one or more keys.", keys=(1, -1, 1))
def unlink(conn, args):
    return del_(conn, args)


@FAMILY.command("EXISTS", -2, "readonly fast", "keyspace", "Determines whether one or more keys exist.", keys=(1, -1, 1))
def exists(conn, args):
    return writer.integer(sum(conn.engine.lookup(k) is not None for k in args[1:]))


@FAMILY.command("TYPE", 2, "readonly fast", "keyspace", "Determines the type of value stored at a key.")
def type_(conn, args):
    return writer.simple("none" if conn.engine.lookup(args[1]) is None else "string")


@FAMILY.command("TOUCH", -2, "readonly fast", "keyspace", "Returns the number of existing keys out of those specified "
         "after updating the time they were last accessed.", keys=(1, -1, 1))
def touch(conn, args):
    engine, found = conn.engine, 0
    for key in args[1:]:
        entry = engine.lookup(key)
        if entry is not None:
            engine.eviction.touch(entry)
            found += 1
    return writer.integer(found)


RANDOM_TRIES = 64


@FAMILY.command("RANDOMKEY", 1, "readonly", "keyspace", "Returns a random key name from the database.", keys=(0, 0, 0))
def randomkey(conn, args):
    """A few random entries first (O(1) each); when they all miss (an entry table mostly free
    after a flush), the index from a random place on, so every key can still come up."""
    engine = conn.engine
    names = engine.entries.keys
    for _ in range(RANDOM_TRIES if names else 0):
        key = names[random.randrange(len(names))]
        if key is not None and engine.index.get(key) is not None and engine.lookup(key) is not None:
            return writer.bulk(key)
    keys = list(engine.index)
    start = random.randrange(len(keys)) if keys else 0
    for key in keys[start:] + keys[:start]:
        if engine.lookup(key) is not None:
            return writer.bulk(key)
    return conn.enc.null


_OBJECT_HELP = [
    "OBJECT <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
    "ENCODING <key>",
    "    Return the kind of internal representation used in order to store the value",
    "    associated with a <key>.",
    "FREQ <key>",
    "    Return the access frequency index of the <key>. The returned integer is",
    "    proportional to the logarithm of the recent access frequency of the key.",
    "IDLETIME <key>",
    "    Return the idle time of the <key>, that is the approximated number of",
    "    seconds elapsed since the last access to the key.",
    "REFCOUNT <key>",
    "    Return the number of references of the value associated with the specified",
    "    <key>.",
    "HELP",
    "    Prints this help.",
]
NO_LFU = ("An LFU maxmemory policy is not selected, access frequency not tracked. Please note that when "
          "switching between policies at runtime LRU and LFU data will take some time to adjust.")
NO_IDLE_TIME = "kvstore keeps the order of accesses, not their times: the idle time of a key is not tracked"


def _encoding(engine, entry: int) -> str:
    """Redis's encoding of a string: int, embstr (up to 44 bytes) or raw when it was given
    whole; raw when APPEND or SETRANGE built it."""
    if is_raw(engine, engine.key_of(entry)):
        return "raw"
    size = engine.size_of(entry)
    if size <= 20:
        try:
            parse_int(engine.value(entry))
            return "int"
        except CommandError:
            pass
    return "embstr" if size <= 44 else "raw"


@FAMILY.command("OBJECT", -2, "", "keyspace", "A container for object introspection commands.", keys=(2, 2, 1),
         subcommands={"encoding": (3, "Returns the internal encoding of a Redis object."),
                      "freq": (3, "Returns the logarithmic access frequency counter of a Redis object."),
                      "idletime": (3, "Returns the time since the last access to a Redis object."),
                      "refcount": (3, "Returns the reference count of a value of a key."),
                      "help": (2, "Returns helpful text about the different subcommands.")})
def object_(conn, args):
    sub = args[1].lower()
    if sub == b"help":
        return writer.array([writer.simple(line) for line in _OBJECT_HELP])
    entry = conn.engine.lookup(args[2])
    if entry is None:
        return conn.enc.null
    if sub == b"encoding":
        return writer.bulk(_encoding(conn.engine, entry))
    if sub == b"refcount":
        return writer.ONE
    raise CommandError(NO_LFU if sub == b"freq" else NO_IDLE_TIME)


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
    current = engine.expiry.deadlines.get(key)
    if (b"NX" in flags and current is not None) or (b"XX" in flags and current is None) \
            or (b"GT" in flags and (current is None or deadline <= current)) \
            or (b"LT" in flags and current is not None and deadline >= current):
        return writer.ZERO
    if deadline <= now_ms():
        engine.delete(key)
    else:
        engine.expiry.set(key, deadline)
    return writer.ONE


@FAMILY.command("EXPIRE", -3, "write fast", "keyspace", "Sets the expiration time of a key in seconds.")
def expire(conn, args):
    return _expire(conn, args, 1000)


@FAMILY.command("PEXPIRE", -3, "write fast", "keyspace", "Sets the expiration time of a key in milliseconds.")
def pexpire(conn, args):
    return _expire(conn, args, 1)


@FAMILY.command("EXPIREAT", -3, "write fast", "keyspace", "Sets the expiration time of a key to a Unix timestamp.")
def expireat(conn, args):
    return _expire(conn, args, 1000, absolute=True)


@FAMILY.command("PEXPIREAT", -3, "write fast", "keyspace", "Sets the expiration time of a key to a Unix milliseconds "
         "timestamp.")
def pexpireat(conn, args):
    return _expire(conn, args, 1, absolute=True)


def _ttl(conn, key: bytes, unit_ms: int, absolute: bool = False) -> bytes:
    if conn.engine.lookup(key) is None:
        return writer.integer(-2)
    deadline = conn.engine.expiry.deadlines.get(key)
    if deadline is None:
        return writer.integer(-1)
    left = deadline if absolute else max(0, deadline - now_ms())
    return writer.integer((left + unit_ms // 2) // unit_ms)


@FAMILY.command("EXPIRETIME", 2, "readonly fast", "keyspace", "Returns the expiration time of a key as a Unix timestamp.")
def expiretime(conn, args):
    return _ttl(conn, args[1], 1000, absolute=True)


@FAMILY.command("PEXPIRETIME", 2, "readonly fast", "keyspace", "Returns the expiration time of a key as a Unix "
         "milliseconds timestamp.")
def pexpiretime(conn, args):
    return _ttl(conn, args[1], 1, absolute=True)


@FAMILY.command("TTL", 2, "readonly fast", "keyspace", "Returns the expiration time in seconds of a key.")
def ttl(conn, args):
    return _ttl(conn, args[1], 1000)


@FAMILY.command("PTTL", 2, "readonly fast", "keyspace", "Returns the expiration time in milliseconds of a key.")
def pttl(conn, args):
    return _ttl(conn, args[1], 1)


@FAMILY.command("PERSIST", 2, "write fast", "keyspace", "Removes the expiration time of a key.")
def persist(conn, args):
    if conn.engine.lookup(args[1]) is None or not conn.engine.expiry.persist(args[1]):
        return writer.ZERO
    touched(conn.engine, args[1])
    return writer.ONE


@FAMILY.command("DBSIZE", 1, "readonly fast loading", "server", "Returns the number of keys in the database.", keys=(0, 0, 0))
def dbsize(conn, args):
    return writer.integer(len(conn.engine.index))


def _flush(conn, args):
    if len(args) > 2 or (len(args) == 2 and args[1].upper() not in (b"ASYNC", b"SYNC")):
        raise CommandError(SYNTAX)
    conn.engine.flush()
    return writer.OK


@FAMILY.command("FLUSHDB", -1, "write", "server", "Removes all keys from the current database.", keys=(0, 0, 0))
def flushdb(conn, args):
    return _flush(conn, args)


@FAMILY.command("FLUSHALL", -1, "write", "server", "Removes all keys from all databases.", keys=(0, 0, 0))
def flushall(conn, args):
    return _flush(conn, args)


@FAMILY.command("SCAN", -2, "readonly", "keyspace", "Iterates over the key names in the database.", keys=(0, 0, 0))
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


@FAMILY.command("KEYS", 2, "readonly", "keyspace", "Returns all key names that match a pattern.", keys=(0, 0, 0))
def keys(conn, args):
    engine = conn.engine
    found = [k for k in list(engine.index) if matches(args[1], k) and engine.lookup(k) is not None]
    return writer.bulk_array(found)
