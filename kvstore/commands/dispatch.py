"""Dispatch: the one path every command takes from the parser to its handler.

This is Redis's processCommand. A parsed request is looked up in the command
table once, then checked in the order Redis checks it: known command, arity,
subcommand, authentication, the loading state and, in a cluster, whether
this node serves the command's keys (else Redis Cluster's MOVED/ASK; a
READONLY read of hot-block copies held here runs here). Inside MULTI it is
queued instead of run. Before the handler runs, the values it reads are brought up
from SSD or GPU into DRAM (`TierManager.fetch` on worker threads): the client
is deferred meanwhile, and the command runs again once they are staged, so a
handler only ever sees DRAM. A write that finds DRAM full of values that
exist nowhere else waits for demotion to make room and runs again. The
reply to a write of a replicated key waits until its copies on other nodes
are gone (kvstore/cluster/replication.py). Every failure becomes one error reply here; a bug in a handler costs that command
an error, never the node.

What stays in `kvstore/net/connection.py`: the socket, the request and reply buffers,
the backlog of parsed requests and the pause while a deferred command waits.
Dispatch decides, the connection moves bytes.

A request is ``(args, failure, has_extents)`` as the reader returns it:
``failure`` is an error found while parsing (a value too big for the arena)
that must be reported in order, and ``has_extents`` says that some argument
is an arena extent received straight from the socket (given back unless the
handler committed it).
"""
from __future__ import annotations

import asyncio
import logging
from itertools import islice
from time import perf_counter_ns

from kvstore.admin import acl
from kvstore.cluster.routing import redirect, redirect_slot
from kvstore.cluster.slots import keys_by_slot
from kvstore.commands.strings import get, set_plain
from kvstore.commands.table import Command, CommandError
from kvstore.net.protocol import writer
from kvstore.store.arena import Extent
from kvstore.store.engine import NeedsDemotion, NeedsRoom, OutOfMemory
from kvstore.tiers.manager import ARENA_READERS

log = logging.getLogger("kvstore")

PREFETCH_COMMANDS = 16     # pipelined commands whose SSD values are fetched together
OOM_MESSAGE = "command not allowed when used memory > 'maxmemory'."
OOM_ERROR = writer.error(OOM_MESSAGE, "OOM")
NOAUTH_ERROR = writer.error("Authentication required.", "NOAUTH")
INTERNAL_ERROR = writer.error("internal error while running the command")
# Commands that run at once inside MULTI instead of being queued (Redis's list); their own
# errors there (MULTI nested, WATCH inside MULTI) do not abort the transaction, as in Redis.
RUN_INSIDE_MULTI = frozenset((b"exec", b"discard", b"multi", b"quit", b"watch"))
NO_MULTI_ERROR = "Command not allowed inside a transaction"


class Redirected(Exception):
    """Another node serves the command's keys: ``reply`` is the redirection to send."""

    def __init__(self, reply: bytes):
        super().__init__(reply)
        self.reply = reply


def value_destination(conn, args: list, size: int):
    """Where a big bulk of the request being read lands: an arena extent when it is a value
    to store. The connection asks when the reader stops at the bulk's header.

    Values land in their final place (no copy at commit); anything else, and a
    value that would have to wait for room, is received on the heap. Raises
    OutOfMemory for a value no room can be made for (reported when the command runs).
    """
    cmd = conn.commands.lookup(args[0]) if args else None
    if cmd is not None and cmd.value_args is not None and cmd.value_args(len(args)) \
            and conn.authenticated:
        try:
            extent = conn.engine.reserve(size, owner=conn.user.tenant)
            return extent.view, extent
        except NeedsDemotion:
            pass            # the command waits for room when it runs
    buf = bytearray(size)
    return memoryview(buf), buf


def dispatch(conn, args: list, failure: Exception | None = None, has_extents: bool = False) -> None:
    """Run one request for ``conn``: its reply (or a deferral) is queued on the connection."""
    if conn.reply_mode.muted and not conn.reply_mode.muting:
        return _dispatch_muted(conn, args, failure, has_extents)
    settled = True          # False while the request is queued in MULTI or deferred
    cmd = None
    try:
        cmd = _checked(conn, args)
        if cmd is None:
            return
        if failure is not None:
            raise failure
        pause = conn.server.pause
        if pause is not None and pause.holds(cmd):
            settled = False     # CLIENT PAUSE: run again once it is over (kvstore/net/client_pause.py)
            conn.defer(pause.over, lambda _: dispatch(conn, args, None, has_extents))
            return
        if conn.engine.limit < conn.engine.allocator.capacity and _uses_memory(conn, cmd) \
                and conn.engine.refuses_writes():
            if conn.transaction.queued is not None and cmd.name == "exec":
                raise _abort_transaction(conn, CommandError(OOM_MESSAGE, "OOM"))
            raise OutOfMemory(OOM_MESSAGE)
        if conn.transaction.queued is not None and cmd.name.encode() not in RUN_INSIDE_MULTI:
            if "no_multi" in cmd.flags:
                raise CommandError(NO_MULTI_ERROR)     # and EXEC answers EXECABORT
            conn.transaction.queued.append((args, has_extents))
            conn.write(writer.QUEUED)
            settled = False
            return
        if _fetch_first(conn, cmd, args, has_extents):
            settled = False
            return
        _run(conn, cmd, args)
    except Exception as exc:
        settled = _failed(conn, cmd, args, exc, has_extents)
    finally:
        if settled:
            if conn.redirects.asking and conn.transaction.queued is None and args[0].lower() != b"asking":
                conn.redirects.asking = False     # ASKING covers the next command only, as in Redis
            if has_extents:
                release_extents(conn.engine, args)
            conn.server.stats.commands += 1


def _uses_memory(conn, cmd: Command) -> bool:
    """A command Redis refuses when out of memory: one flagged denyoom; inside MULTI, any
    but EXEC, DISCARD and QUIT (queuing takes memory); EXEC of a transaction that queued one."""
    if "denyoom" in cmd.flags:
        return True
    queued = conn.transaction.queued
    if queued is None:
        return False
    if cmd.name != "exec":
        return cmd.name not in ("discard", "quit")
    return any("denyoom" in (conn.commands.lookup(args[0]) or cmd).flags for args, _ in queued)


def _dispatch_muted(conn, args: list, failure: Exception | None, has_extents: bool) -> None:
    """`dispatch` under CLIENT REPLY OFF or SKIP: the command runs, its reply is dropped
    (unless it was CLIENT REPLY ON); a SKIP is used up once the command has run."""
    mode = conn.reply_mode
    skip, mark, queued, ran = mode.skip, len(conn.wbuf), len(conn.out), conn.server.stats.commands
    mode.muting = True
    try:
        dispatch(conn, args, failure, has_extents)
    finally:
        mode.muting = False
    if (mode.off or (skip and mode.skip)) and len(conn.out) == queued:
        del conn.wbuf[mark:]
    if skip and conn.server.stats.commands != ran:
        mode.set(off=mode.off, skip=False)


def _failed(conn, cmd: Command | None, args: list, exc: Exception, has_extents: bool) -> bool:
    """Queue the error reply of a request that raised ``exc``; False when it was
    deferred instead, to run again (a write waiting for DRAM to make room)."""
    if isinstance(exc, NeedsRoom):          # eviction goes on over the next loop turns
        conn.defer(conn.engine.room.wait(exc.size, exc.owner),
                   lambda _: dispatch(conn, args, None, has_extents))
        return False
    if isinstance(exc, NeedsDemotion):
        conn.defer(conn.tiers.make_room(exc.size),
                   lambda _: dispatch(conn, args, None, has_extents))
        return False
    if isinstance(exc, Redirected):
        _fail(conn, exc.reply)
    elif isinstance(exc, CommandError):
        if cmd is None and args[0].lower() == b"exec":
            exc = _abort_transaction(conn, exc)
        _fail(conn, writer.error(str(exc), exc.code), cmd is None or cmd.name.encode() not in RUN_INSIDE_MULTI)
    elif isinstance(exc, OutOfMemory):
        _fail(conn, OOM_ERROR)
    else:
        log.exception("command %r failed", args[0][:64], exc_info=exc)
        _fail(conn, INTERNAL_ERROR)
    return True


def run_plain(conn) -> None:
    """Run the plain GETs and SETs at the head of ``conn``'s backlog without the generic checks.

    A pipelined batch of small GETs and SETs spends more time in the checks
    of `dispatch` than in the commands, and so does a single SET of a big
    value. When none of those checks can matter for this connection right
    now (`_plain_allowed`), a request that is exactly ``GET key`` or ``SET
    key value`` (no options, no parse failure; a big value received into the
    arena is committed where it lies, or given back; on a cluster node, a key of a
    slot served here and not moving, `ClusterState.serves_at_rest`) goes straight to
    `_execute`, where every command runs, with the same error replies; the batch runs
    there as one loop, with no call per command. Nothing
    a plain GET or SET does can change what `_plain_allowed` looked at, and no
    other client runs until this batch ends, so it is asked once per batch;
    any other request ends the batch and takes the generic path.
    """
    backlog = conn.backlog
    if backlog and backlog[0][0][0] in _PLAIN and _plain_allowed(conn):
        _execute(conn, None, None, None, None, backlog)


def _plain_allowed(conn) -> bool:
    """Whether this connection's requests need none of the checks `dispatch` makes before
    a GET or SET runs: authenticated as a user allowed everything, no MULTI, no ASKING,
    no CLIENT REPLY OFF or SKIP, no CLIENT PAUSE, no SSD index still loading, no maxmemory
    lowered below the arena (Redis's out-of-memory refusal is dispatch's to make). A cluster
    node's routing is asked per key (`_execute`)."""
    server, tiers, engine = conn.server, conn.tiers, conn.engine
    return conn.authenticated and conn.user.unrestricted and conn.transaction.queued is None and not conn.redirects.asking \
        and not conn.reply_mode.muted and server.pause is None \
        and (tiers is None or not tiers.loading) and engine.limit >= engine.allocator.capacity


def _checked(conn, args: list) -> Command | None:
    """The request's command after Redis's checks; None when an error reply was queued
    that does not abort a transaction (NOAUTH)."""
    cmd = conn.commands.lookup(args[0])
    if cmd is None:
        raise CommandError(_unknown_command(args))
    if not cmd.arity_ok(len(args)):
        raise CommandError(f"wrong number of arguments for '{cmd.name}' command")
    if cmd.subcommands and len(args) > 1:
        cmd.check_subcommand(args)
    if not conn.authenticated and "no-auth" not in cmd.flags:
        conn.write(NOAUTH_ERROR)
        return None
    if not conn.user.unrestricted:
        acl.check_command(conn.user, cmd, args)
    tiers = conn.tiers
    if tiers is not None and tiers.loading and "loading" not in cmd.flags:
        raise CommandError("kvstore is loading the dataset in memory", "LOADING")
    if conn.server.cluster is not None:
        reply = _route(conn, cmd, args)
        if reply is not None:
            raise Redirected(reply)
    return cmd


def _route(conn, cmd: Command, args: list) -> bytes | None:
    """None when this node serves the command's keys, else Redis Cluster's redirection
    (MOVED, ASK, CROSSSLOT, TRYAGAIN, CLUSTERDOWN: kvstore/cluster/routing.py)."""
    keys = cmd.keys_of(args)
    if not keys:
        return None
    cluster, engine = conn.server.cluster, conn.engine

    def has_key(key: bytes) -> bool:
        return engine.lookup(key) is not None

    if not cmd.spans_slots:
        reply = redirect(cluster, keys, conn.redirects.asking, has_key)
        return None if reply is None or _copies_serve(conn, cmd, keys, reply) else reply
    for slot, same_slot in keys_by_slot(keys).items():
        reply = redirect_slot(cluster, slot, same_slot, conn.redirects.asking, has_key)
        if reply is not None and not _copies_serve(conn, cmd, same_slot, reply):
            return reply
    return None


def _copies_serve(conn, cmd: Command, keys: list, reply: bytes) -> bool:
    """A READONLY client's read of hot-block copies held here runs here instead of being MOVED
    (kvstore/cluster/replication.py)."""
    copies = conn.server.cluster.copies
    return conn.redirects.readonly and copies is not None and reply.startswith(b"-MOVED") and "readonly" in cmd.flags \
        and copies.held.serves(keys)


def _run(conn, cmd: Command, args: list) -> None:
    """A checked request runs (`_execute`), under its name in INFO commandstats."""
    name = cmd.name
    if cmd.subcommands and len(args) > 1:
        name = f"{name}|{args[1].lower().decode(errors='replace')}"     # client|list, as Redis names it
    _execute(conn, cmd, name, cmd.handler, args)


def _execute(conn, cmd: Command | None, name: str | None, handler, args: list | None, backlog=None) -> None:
    """Where every command runs, checked (`_run`) or plain (`run_plain`): the handler, its
    INFO commandstats row, the slowlog, the reply, and a write's wait for SSD and for the
    removal of a replicated key's copies.

    A checked command comes with its ``cmd``, ``name``, ``handler`` and ``args``, and what
    it raises goes back to `dispatch`. `run_plain` hands over its ``backlog`` instead: the
    plain requests at its head run here one after another, each with the same steps, its
    failure answered in order (`_failed`) and the batch going on; what cannot change within
    a batch (the commandstats table, the slowlog threshold, the tiers) is read once.

    One clock read a command: a command's time (commandstats, slowlog) runs from the end
    of the one before it in the batch (or the batch's start) to the end of its handler, so
    a plain command's time also holds the batch's few steps between two handlers.
    """
    server, tiers, rows = conn.server, conn.tiers, conn.server.stats.cmdstats
    cluster = server.cluster
    copies = None if cluster is None else cluster.copies
    if backlog is not None:
        by_name, done, has_extents = conn.commands.by_name, 0, False
        threshold = server.slowlog.threshold_ns
    start = perf_counter_ns()
    try:
        while True:
            if backlog is not None:
                if not backlog or conn.waiting is not None or conn.close_after_reply:
                    return
                request = backlog.popleft()
                args, failure, has_extents = request
                plain = _PLAIN.get(args[0])
                if plain is None or len(args) != plain[0] or failure is not None \
                        or (cluster is not None and not cluster.serves_at_rest(args[1])):
                    backlog.appendleft(request)     # not plain: the generic path takes it
                    return
                _, handler, name = plain
                cmd = None                  # looked up only where a step needs it
            try:
                if cmd is None and tiers is not None and _fetch_first(conn, by_name[args[0]], args, has_extents):
                    return      # counted when it runs, once its value is in DRAM
                conn.last_command = name
                stat = rows[name]
                stat[0] += 1
                try:
                    reply = handler(conn, args)
                except CommandError:
                    stat[1] += perf_counter_ns() - start
                    stat[3] += 1
                    raise
                end = perf_counter_ns()
                elapsed = end - start
                start = end
                stat[1] += elapsed
                if backlog is None:
                    threshold = server.slowlog.threshold_ns     # as it is after the command (CONFIG SET)
                if elapsed >= threshold:
                    _log_slow(conn, cmd or by_name[args[0]], args, elapsed)
                if reply is not None:
                    conn.wbuf += reply
                if tiers is not None and tiers.has_unacked():
                    _wait_for_ssd(conn, tiers)
                if copies is not None and copies.unacked:
                    # A write of a replicated key: the reply waits until its copies are gone.
                    conn.defer(copies.take_unacked(), _ordering_only)
            except Exception as exc:
                if backlog is None:
                    raise
                settled = _failed(conn, cmd or by_name[args[0]], args, exc, has_extents)
                start = perf_counter_ns()       # the error's reply is not the next command's time
                if not settled:
                    continue
            if backlog is None:
                return
            if has_extents:
                release_extents(conn.engine, args)
            done += 1
    finally:
        if backlog is not None:
            server.stats.commands += done


def _log_slow(conn, cmd: Command, args: list, elapsed: int) -> None:
    if "skip_slowlog" not in cmd.flags:
        conn.server.slowlog.record(conn, args, elapsed)      # kvstore/admin/slowlog.py


def _wait_for_ssd(conn, tiers) -> None:
    """A write that must reach SSD before it is acknowledged: hold later replies."""
    conn.defer(asyncio.gather(*tiers.take_unacked(), return_exceptions=True), _ordering_only)


def _fetch_first(conn, cmd: Command, args: list, has_extents: bool) -> bool:
    """Defer the command while the values it reads come up from SSD/GPU; True when deferred.

    The keys the next pipelined commands read are fetched in the same batch,
    so their SSD reads overlap instead of running one command at a time.
    """
    tiers = conn.tiers
    if tiers is None or cmd.reads is None:
        return False
    pending = tiers.pending_fetch(cmd.reads(conn, args))
    if not pending:
        return False
    into_arena = cmd.name in ARENA_READERS
    fetched = tiers.fetch_now(pending, into_arena)
    if fetched is not None:                     # all in the page cache: run it now
        _run_fetched(conn, fetched, args, has_extents, len(pending))
        return True
    ahead = [p for p in tiers.pending_fetch(_reads_ahead(conn)) if p not in pending]
    conn.defer(tiers.fetch(pending + ahead, into_arena=into_arena),
               lambda fetched: _run_fetched(conn, fetched, args, has_extents, len(pending)))
    return True


def _reads_ahead(conn) -> list[bytes]:
    keys = []
    for queued_args, _, _ in islice(conn.backlog, 0, PREFETCH_COMMANDS):
        cmd = conn.commands.lookup(queued_args[0])
        if cmd is not None and cmd.reads is not None and cmd.arity_ok(len(queued_args)):
            keys += cmd.reads(conn, queued_args)
    return keys


def _run_fetched(conn, fetched: list, args: list, has_extents: bool, own: int) -> None:
    """Run a command whose values were just copied into DRAM.

    The first ``own`` fetched values are this command's (unstaged once it ran);
    the others were read ahead for commands behind it and stay staged until
    the connection's backlog drains.
    """
    tiers = conn.tiers
    staged = tiers.install(fetched[:own])
    conn.prefetched += tiers.install(fetched[own:])
    try:
        dispatch(conn, args, None, has_extents)
    finally:
        tiers.unstage(staged)


def run_transaction(conn, queued: list) -> None:
    """EXEC: the queued requests run next, in order, ahead of anything pipelined after EXEC.

    They go back to the front of the backlog rather than being run from inside
    EXEC's handler, so a queued command that must wait (for a tier fetch or
    for room) holds the rest of the transaction, and its reply, in place.
    """
    conn.write(b"*%d\r\n" % len(queued))
    conn.backlog.extendleft((args, None, has_extents) for args, has_extents in reversed(queued))


def _fail(conn, reply: bytes, aborts: bool = True) -> None:
    if conn.transaction.queued is not None and aborts:
        conn.transaction.aborted = True       # EXEC will answer EXECABORT
    conn.write(reply)


def _abort_transaction(conn, refusal: CommandError) -> CommandError:
    """EXEC refused before it runs (a user without it) ends the transaction, as Redis's execCommandAbort."""
    if conn.transaction.queued is not None:
        release_queued(conn.engine, conn.transaction.queued)
        conn.transaction.queued = None
    return CommandError(f"Transaction discarded because of: {refusal.code} {refusal}", "EXECABORT")


def release_extents(engine, args: list) -> None:
    """Give back arena extents received for a request that did not commit them."""
    for arg in args:
        if isinstance(arg, Extent) and not arg.committed:
            engine.release(arg)


def release_queued(engine, queued: list) -> None:
    """Give back the extents of queued requests that will never run."""
    for args, has_extents in queued:
        if has_extents:
            release_extents(engine, args)


def _ordering_only(result) -> None:
    """Resume after a wait whose only purpose was ordering (the reply is already queued)."""


def _unknown_command(args: list) -> str:
    shown = ""
    for arg in args[1:]:
        if len(shown) >= 128:
            break
        shown += "'" + arg[:128 - len(shown)].decode(errors="replace") + "' "
    return f"unknown command '{args[0][:128].decode(errors='replace')}', with args beginning with: {shown}"


# Requests `run_plain` takes, by their name as clients send it: (the only argument count, the
# handler for that form: SET's plain form is `set_plain`, without SET's options; the command's
# name, its commandstats row).
_PLAIN = {name: (argc, handler, base.decode().lower()) for base, argc, handler in ((b"GET", 2, get), (b"SET", 3, set_plain))
          for name in (base, base.lower())}
