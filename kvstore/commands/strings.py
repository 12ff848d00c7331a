"""String commands: SET and its older forms (SETEX, PSETEX, SETNX, GETSET, MSETNX), GET, GETEX,
GETDEL, MGET, MSET, STRLEN, GETRANGE, APPEND, SETRANGE.

APPEND and SETRANGE edit the value where it lies when its chunk has room
(`Engine.splice`). Values stay in the arena: a big SET value arrives as an `Extent` the reader
already filled (committed as is), a small one is copied in; GET sends from
the arena through the connection. Replies match Redis 7 byte for byte.
"""
from __future__ import annotations

from kvstore.commands.args import SYNTAX, options, parse_int, store
from kvstore.commands.table import CommandError, Family, all_keys, first_key
from kvstore.net.protocol import writer
from kvstore.store.deadlines import now_ms
from kvstore.store.watch import touched

FAMILY = Family()

MAX_EXPIRE_MS = 2**63 // 1000
_SET_OPTIONS = {b"NX": 0, b"XX": 0, b"GET": 0, b"KEEPTTL": 0, b"EX": 1, b"PX": 1, b"EXAT": 1, b"PXAT": 1}


def _set_options(args: list) -> tuple[str | None, bool, int | None, bool]:
    """Parse SET's options: (condition, get, deadline_ms, keep_ttl)."""
    # As Redis: an option may repeat, but not meet its opposite (NX/XX, EX/PX...).
    cond, get, unit, amount, keep_ttl = None, False, None, None, False
    for opt, values in options(args, 3, _SET_OPTIONS):
        if opt in (b"NX", b"XX") and cond in (None, opt.decode()):
            cond = opt.decode()
        elif opt == b"GET":
            get = True
        elif opt == b"KEEPTTL" and unit is None:
            keep_ttl = True
        elif values and unit in (None, opt) and not keep_ttl:
            unit, amount = opt, values[0]
        else:
            raise CommandError(SYNTAX)
    deadline = None if unit is None else _deadline(unit, parse_int(amount), "set")
    return cond, get, deadline, keep_ttl


def _deadline(unit: bytes, amount: int, cmd: str) -> int:
    if amount <= 0 or (unit in (b"EX", b"EXAT") and amount > MAX_EXPIRE_MS):
        raise CommandError(f"invalid expire time in '{cmd}' command")
    ms = amount * 1000 if unit in (b"EX", b"EXAT") else amount
    if unit in (b"EXAT", b"PXAT"):
        return ms
    now = now_ms()
    if ms > 2**63 - 1 - now:
        raise CommandError(f"invalid expire time in '{cmd}' command")
    return now + ms


def _set_reads(conn, args: list) -> list[bytes]:
    return [args[1]] if any(a.upper() == b"GET" for a in args[3:]) else []


@FAMILY.command("SET", -3, "write denyoom", "string", "Sets the string value of a key, ignoring its type.",
         values=lambda i: i == 2, reads=_set_reads)
def set_(conn, args):
    key, value = args[1], args[2]
    if len(args) == 3:
        store(conn, key, value)
        return writer.OK
    cond, get, deadline, keep_ttl = _set_options(args)
    engine = conn.engine
    entry = engine.lookup(key)
    old = None
    if get:
        old = conn.enc.null if entry is None else writer.bulk(engine.value(entry))
    if (cond == "NX" and entry is not None) or (cond == "XX" and entry is None):
        return old or conn.enc.null
    store(conn, key, value, keep_ttl=keep_ttl)
    if deadline is not None:
        engine.expiry.set(key, deadline)
    return old or writer.OK


def set_plain(conn, args: list) -> bytes:
    """``SET key value``: the form kvstore/commands/dispatch.py's plain path runs without SET's
    option parsing (a small value is bytes, a big one an extent the reader filled)."""
    value = args[2]
    if type(value) is bytes:
        conn.engine.put(args[1], value, None, False, conn.user.tenant)     # owner positional: a cheaper call
    else:
        conn.engine.commit(args[1], value)
    return writer.OK


@FAMILY.command("GET", 2, "readonly fast", "string", "Returns the string value of a key.", reads=first_key)
def get(conn, args):
    entry = conn.engine.get_entry(args[1])
    if entry is None:
        return conn.enc.null
    conn.write_value(entry)


@FAMILY.command("GETDEL", 2, "write fast", "string", "Returns the string value of a key after deleting the key.",
         reads=first_key)
def getdel(conn, args):
    entry = conn.engine.get_entry(args[1])
    if entry is None:
        return conn.enc.null
    reply = writer.bulk(conn.engine.value(entry))
    conn.engine.delete(args[1])
    return reply


@FAMILY.command("MGET", -2, "readonly fast", "string", "Atomically returns the string values of one or more keys.",
         keys=(1, -1, 1), reads=all_keys)
def mget(conn, args):
    conn.write(b"*%d\r\n" % (len(args) - 1))
    for key in args[1:]:
        entry = conn.engine.get_entry(key)
        if entry is None:
            conn.write(conn.enc.null)
        else:
            conn.write_value(entry)


@FAMILY.command("MSET", -3, "write denyoom", "string", "Atomically creates or modifies the string values of one or more keys.",
         keys=(1, -1, 2), values=lambda i: i % 2 == 0)
def mset(conn, args):
    if len(args) % 2 == 0:
        raise CommandError("wrong number of arguments for 'mset' command")
    for i in range(1, len(args), 2):
        store(conn, args[i], args[i + 1])
    return writer.OK


@FAMILY.command("STRLEN", 2, "readonly fast", "string", "Returns the length of a string value.")
def strlen(conn, args):
    entry = conn.engine.lookup(args[1])
    return writer.integer(0 if entry is None else conn.engine.size_of(entry))


@FAMILY.command("GETRANGE", 4, "readonly", "string", "Returns a substring of the string stored at a key.",
         reads=first_key)
def getrange(conn, args):
    start, end = parse_int(args[2]), parse_int(args[3])
    entry = conn.engine.lookup(args[1])
    if entry is None:
        return writer.bulk(b"")
    size = conn.engine.size_of(entry)
    if start < 0 and end < 0 and start > end:
        return writer.bulk(b"")
    start = max(0, size + start if start < 0 else start)
    end = max(0, size + end if end < 0 else end)
    end = min(end, size - 1)
    if start > end or size == 0:
        return writer.bulk(b"")
    return writer.bulk(conn.engine.view(entry)[start:end + 1].tobytes())


def _set_with_ttl(conn, args: list, unit: bytes) -> bytes:
    deadline = _deadline(unit, parse_int(args[2]), args[0].decode().lower())
    store(conn, args[1], args[3])
    conn.engine.expiry.set(args[1], deadline)
    return writer.OK


@FAMILY.command("SETEX", 4, "write denyoom", "string", "Sets the string value and expiration time of a key.",
         values=lambda i: i == 3)
def setex(conn, args):
    return _set_with_ttl(conn, args, b"EX")


@FAMILY.command("PSETEX", 4, "write denyoom", "string",
         "Sets both string value and expiration time in milliseconds of a key.", values=lambda i: i == 3)
def psetex(conn, args):
    return _set_with_ttl(conn, args, b"PX")


@FAMILY.command("SETNX", 3, "write denyoom fast", "string", "Set the string value of a key only when the key doesn't exist.",
         values=lambda i: i == 2)
def setnx(conn, args):
    if conn.engine.lookup(args[1]) is not None:
        return writer.ZERO
    store(conn, args[1], args[2])
    return writer.ONE


@FAMILY.command("GETSET", 3, "write denyoom fast", "string", "Returns the previous string value of a key after setting it "
         "to a new value.", values=lambda i: i == 2, reads=first_key)
def getset(conn, args):
    entry = conn.engine.lookup(args[1])
    old = conn.enc.null if entry is None else writer.bulk(conn.engine.value(entry))
    store(conn, args[1], args[2])
    return old


@FAMILY.command("MSETNX", -3, "write denyoom", "string", "Atomically modifies the string values of one or more keys only "
         "when all keys don't exist.", keys=(1, -1, 2), values=lambda i: i % 2 == 0)
def msetnx(conn, args):
    if len(args) % 2 == 0:
        raise CommandError("wrong number of arguments for 'msetnx' command")
    if any(conn.engine.lookup(args[i]) is not None for i in range(1, len(args), 2)):
        return writer.ZERO
    for i in range(1, len(args), 2):
        store(conn, args[i], args[i + 1])
    return writer.ONE


_GETEX_OPTIONS = {b"EX": 1, b"PX": 1, b"EXAT": 1, b"PXAT": 1, b"PERSIST": 0}


@FAMILY.command("GETEX", -2, "write fast", "string", "Returns the string value of a key after setting its expiration time.",
         reads=first_key)
def getex(conn, args):
    chosen = [(opt, values) for opt, values in options(args, 2, _GETEX_OPTIONS)]
    if len(chosen) > 1 and len({opt for opt, _ in chosen}) > 1:
        raise CommandError(SYNTAX)
    engine = conn.engine
    entry = engine.get_entry(args[1])
    if entry is None:
        return conn.enc.null        # as Redis: the expire time is read only for a key that exists
    deadline = None
    if chosen and chosen[-1][0] != b"PERSIST":
        deadline = _deadline(chosen[-1][0], parse_int(chosen[-1][1][0]), "getex")
    reply = writer.bulk(engine.value(entry))
    if deadline is not None and deadline <= now_ms():
        engine.delete(args[1])
    elif deadline is not None:
        engine.expiry.set(args[1], deadline)
    elif chosen and engine.expiry.persist(args[1]):
        touched(engine, args[1])
    return reply


MAX_STRING = 512 * 1024 * 1024     # Redis's proto-max-bulk-len default


class RawStrings:
    """Keys whose value APPEND or SETRANGE built: Redis keeps those as ``raw`` strings (OBJECT
    ENCODING) until the key is written whole again. Installed on an engine by the first such
    command, so a node that never sees one pays nothing per write."""

    def __init__(self, engine):
        self.keys: set[bytes] = set()
        engine.commit_listeners.append(lambda key, entry: self.keys.discard(key))
        engine.drop_listeners.append(lambda entry, key: self.keys.discard(key))
        engine.overwrite_listeners.append(self.keys.discard)

    @staticmethod
    def of(engine) -> "RawStrings":
        raw = getattr(engine, "raw_strings", None)
        if raw is None:
            raw = engine.raw_strings = RawStrings(engine)
        return raw


def is_raw(engine, key: bytes) -> bool:
    raw = getattr(engine, "raw_strings", None)
    return raw is not None and key in raw.keys


@FAMILY.command("APPEND", 3, "write denyoom fast", "string", "Appends a string to the value of a key. Creates the key if it "
         "doesn't exist.", reads=first_key)
def append(conn, args):
    engine = conn.engine
    entry = engine.lookup(args[1])
    if entry is None:
        store(conn, args[1], args[2])
        return writer.integer(len(args[2]))
    size = engine.size_of(entry)
    if size + len(args[2]) > MAX_STRING:
        raise CommandError("string exceeds maximum allowed size (proto-max-bulk-len)")
    size = engine.splice(args[1], size, args[2])
    RawStrings.of(engine).keys.add(args[1])
    return writer.integer(size)


@FAMILY.command("SETRANGE", 4, "write denyoom", "string", "Overwrites a part of a string value with another by an offset. "
         "Creates the key if it doesn't exist.", reads=first_key)
def setrange(conn, args):
    offset = parse_int(args[2])
    if offset < 0:
        raise CommandError("offset is out of range")
    engine, value = conn.engine, args[3]
    entry = engine.lookup(args[1])
    if not value:
        return writer.integer(0 if entry is None else engine.size_of(entry))
    if offset + len(value) > MAX_STRING:
        raise CommandError("string exceeds maximum allowed size (proto-max-bulk-len)")
    if entry is None:
        store(conn, args[1], bytes(offset) + value)
        size = offset + len(value)
    else:
        size = engine.splice(args[1], offset, value)
    RawStrings.of(engine).keys.add(args[1])
    return writer.integer(size)
