"""RENAME, RENAMENX and COPY: a value under another name.

The value is copied once into a new extent under the destination (the
source held meanwhile, so making room cannot evict it), with the source's
TTL; RENAME then drops the source. A KV block's chain link (KV.PUT ...
PARENT) is dropped, not carried: the link says "this key is the next block
of that prefix", and a block under another name is no longer that prefix's
hash, so keeping the link would let eviction and KV.MATCH treat an unrelated
key as part of the chain. A destination that had cached children keeps them,
as any overwrite does.
"""
from __future__ import annotations

from kvstore.commands.args import SYNTAX, parse_int
from kvstore.commands.table import CommandError, Family, first_key
from kvstore.net.protocol import writer

FAMILY = Family()

NO_SUCH_KEY = "no such key"


def _copy_value(conn, src: bytes, dst: bytes) -> None:
    """Put the live value of ``src`` (and its TTL) under ``dst``."""
    engine = conn.engine
    entry = engine.lookup(src)
    deadline = engine.expiry.deadlines.get(src)
    hold = engine.holds.hold(entry)
    try:
        engine.put(dst, engine.view(entry), owner=engine.owner_of(entry))     # the value keeps its tenant
    finally:
        engine.holds.release(hold)
    if deadline is not None:
        engine.expiry.set(dst, deadline)


def _rename(conn, args: list, replace: bool) -> bool:
    """Move ``args[1]`` to ``args[2]``; False when the destination exists and may not be replaced."""
    engine, src, dst = conn.engine, args[1], args[2]
    if engine.lookup(src) is None:
        raise CommandError(NO_SUCH_KEY)
    if src == dst:
        return replace
    if not replace and engine.lookup(dst) is not None:
        return False
    _copy_value(conn, src, dst)
    engine.delete(src)
    return True


@FAMILY.command("RENAME", 3, "write", "keyspace", "Renames a key and overwrites the destination.", keys=(1, 2, 1),
         reads=first_key)
def rename(conn, args):
    _rename(conn, args, replace=True)
    return writer.OK


@FAMILY.command("RENAMENX", 3, "write fast", "keyspace", "Renames a key only when the target key name doesn't exist.",
         keys=(1, 2, 1), reads=first_key)
def renamenx(conn, args):
    return writer.integer(int(_rename(conn, args, replace=False)))


@FAMILY.command("COPY", -3, "write denyoom", "keyspace", "Copies the value of a key to a new key.", keys=(1, 2, 1),
         reads=first_key)
def copy(conn, args):
    replace, i = False, 3
    while i < len(args):
        opt = args[i].upper()
        if opt == b"REPLACE":
            replace = True
        elif opt == b"DB" and i + 1 < len(args):
            i += 1
            if parse_int(args[i]) != 0:     # one keyspace, as in Redis Cluster
                raise CommandError("Copying to another database is not allowed in cluster mode")
        else:
            raise CommandError(SYNTAX)
        i += 1
    engine, src, dst = conn.engine, args[1], args[2]
    if src == dst:
        raise CommandError("source and destination objects are the same")
    if engine.lookup(src) is None or (not replace and engine.lookup(dst) is not None):
        return writer.ZERO
    _copy_value(conn, src, dst)
    return writer.ONE
