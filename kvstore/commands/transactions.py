"""MULTI / EXEC / DISCARD: Redis transactions, as redis-py pipelines use them.

The loop is single-threaded, so running the queued commands back to back is
already atomic; the work is in the bookkeeping Redis clients rely on: +QUEUED
for each command, EXECABORT when a queued command had an error at queue time,
and the nesting errors.
"""
from __future__ import annotations

from kvstore.commands.table import CommandError, command, lookup
from kvstore.protocol import writer

QUEUE_ANYWAY = (b"exec", b"discard", b"multi", b"quit", b"reset")


@command("MULTI", 1, "noscript loading stale fast", "transactions", "Starts a transaction.", keys=(0, 0, 0))
def multi(conn, args):
    if conn.multi is not None:
        raise CommandError("MULTI calls can not be nested")
    conn.multi, conn.multi_dirty = [], False
    return writer.OK


def _queued_reads(conn, args: list) -> list[bytes]:
    """Every key the queued commands will read, so EXEC runs with them all in DRAM."""
    keys = []
    for queued_args, _ in conn.multi or []:
        cmd = lookup(queued_args[0])
        if cmd is not None and cmd.reads is not None:
            keys += cmd.reads(conn, queued_args)
    return keys


@command("EXEC", 1, "noscript loading stale skip-slowlog", "transactions", "Executes all commands in a transaction.",
         keys=(0, 0, 0), reads=_queued_reads)
def exec_(conn, args):
    if conn.multi is None:
        raise CommandError("EXEC without MULTI")
    queued, dirty = conn.multi, conn.multi_dirty
    conn.multi = None
    if dirty:
        conn.release_queued(queued)
        raise CommandError("Transaction discarded because of previous errors.", "EXECABORT")
    conn.write(b"*%d\r\n" % len(queued))
    for queued_args, has_holders in queued:
        conn.execute(queued_args, None, has_holders)


@command("DISCARD", 1, "noscript loading stale fast", "transactions", "Discards a transaction.", keys=(0, 0, 0))
def discard(conn, args):
    if conn.multi is None:
        raise CommandError("DISCARD without MULTI")
    conn.release_queued(conn.multi)
    conn.multi = None
    return writer.OK
