"""MULTI / EXEC / DISCARD / WATCH / UNWATCH: Redis transactions, as redis-py pipelines use them.

The loop is single-threaded, so running the queued commands back to back is
atomic unless one of them must wait for a tier (a fetch from SSD, room in
DRAM): then the rest of the transaction waits behind it, replies in order,
while other clients may run. The work here is the bookkeeping Redis clients
rely on: +QUEUED for each command (kvstore/commands/dispatch.py queues them),
EXECABORT when a queued command had an error at queue time (or was one Redis
refuses inside MULTI: kvstore/commands/dispatch.py), the nesting errors, and WATCH's
null reply when a watched key was touched (kvstore/store/watch.py).
"""
from __future__ import annotations

from kvstore.commands import dispatch
from kvstore.commands.table import CommandError, Family
from kvstore.net.protocol import writer
from kvstore.store.watch import unwatch, watches_of

FAMILY = Family()


@FAMILY.command("MULTI", 1, "noscript loading stale fast", "transactions", "Starts a transaction.", keys=(0, 0, 0))
def multi(conn, args):
    if conn.transaction.queued is not None:
        raise CommandError("MULTI calls can not be nested")
    conn.transaction.queued, conn.transaction.aborted = [], False
    return writer.OK


@FAMILY.command("EXEC", 1, "noscript loading stale skip_slowlog", "transactions", "Executes all commands in a transaction.",
         keys=(0, 0, 0))
def exec_(conn, args):
    if conn.transaction.queued is None:
        raise CommandError("EXEC without MULTI")
    queued, dirty = conn.transaction.queued, conn.transaction.aborted
    conn.transaction.queued = None
    touched = bool(conn.transaction.watched) and watches_of(conn.engine).aborts(conn)
    unwatch(conn)
    if dirty or touched:
        dispatch.release_queued(conn.engine, queued)
    if dirty:
        raise CommandError("Transaction discarded because of previous errors.", "EXECABORT")
    if touched:
        return conn.enc.null_array
    dispatch.run_transaction(conn, queued)


@FAMILY.command("DISCARD", 1, "noscript loading stale fast", "transactions", "Discards a transaction.", keys=(0, 0, 0))
def discard(conn, args):
    if conn.transaction.queued is None:
        raise CommandError("DISCARD without MULTI")
    dispatch.release_queued(conn.engine, conn.transaction.queued)
    conn.transaction.queued = None
    unwatch(conn)
    return writer.OK


@FAMILY.command("WATCH", -2, "noscript loading stale fast", "transactions", "Monitors changes to keys to determine the "
         "execution of a transaction.", keys=(1, -1, 1))
def watch(conn, args):
    if conn.transaction.queued is not None:
        raise CommandError("WATCH inside MULTI is not allowed")
    watches = watches_of(conn.engine)
    for key in args[1:]:
        watches.watch(conn, key)
    return writer.OK


@FAMILY.command("UNWATCH", 1, "noscript loading stale fast", "transactions", "Forgets about watched keys of a transaction.",
         keys=(0, 0, 0))
def unwatch_(conn, args):
    unwatch(conn)
    return writer.OK
