"""One client connection: the socket, its request and reply buffers, and its backlog.

Parsed requests wait in the backlog and go one at a time to
`kvstore.commands.dispatch` (which decides what runs and what it answers); this
module only moves bytes and keeps replies in request order.

Why raw non-blocking sockets on the event loop (``add_reader``/``add_writer``)
rather than asyncio transports: a transport copies whatever it cannot send at
once into its own buffer, and hands received data over as fresh bytes. Here
the socket receives straight into the reader's buffer or into a value's arena
extent (``recv_into``), and replies leave with one ``sendmsg`` of a list of
buffers: replies gathered in a bytearray (values copied in while a few MiB
are queued, `write_value`), larger values as memoryviews of the arena, each
under a read lease until the kernel has taken its last byte.

Backpressure: while replies are waiting for the socket we stop reading from
that client, so a client that does not read cannot make us buffer without
bound. Two limits close a client, as in Redis: replies queued past
client-output-buffer-limit (hard, or soft for too long), and a request in
progress past client-query-buffer-limit (its unparsed bytes, the arguments
read so far and the part of a big bulk received).

TLS: an `ssl.SSLSocket` has no ``sendmsg``/``recvmsg_into`` and says "would
block" with SSLWantRead/WriteError, so a TLS client sends one buffer per call
and receives into one buffer per call, and decrypted bytes OpenSSL already
holds (``pending()``) are read without waiting for the socket to be readable.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from array import array
from collections import deque
from itertools import islice

from kvstore.admin import acl
from kvstore.commands.dispatch import dispatch, release_queued, run_plain, value_destination
from kvstore.commands.table import CommandError
from kvstore.net.client_state import ClientInfo, RedirectFlags, ReplyMode, Transaction
from kvstore.net.protocol import writer
from kvstore.net.protocol.reader import ProtocolError, RequestReader
from kvstore.store.arena import Extent
from kvstore.store.room import OutOfMemory

log = logging.getLogger("kvstore")

BIG_REPLY = 64 * 1024      # values below this are always copied into the reply buffer
COPIED_REPLIES = 4 * 1024 * 1024   # bigger ones too while the replies queued stay within this
IOV_MAX = 512
READS_PER_EVENT = 64
ARG_OVERHEAD = 48          # bytes a parsed argument costs beyond its length (object, list slot)
WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class Connection:
    """A client of the server, with its reader, write queue and identity."""

    # Every command reads a dozen of these: declared, they are read at a slot's speed (an
    # object with 30 or more attributes in its dict reads each about 30 % slower in
    # CPython 3.11). ``__dict__`` stays for tools that wrap a method of one connection,
    # ``__weakref__`` for the keys a connection WATCHes.
    __slots__ = ("server", "engine", "tiers", "commands", "sock", "fd", "id", "enc", "client_info",
                 "created", "last_active", "last_command", "addr", "laddr", "tls", "user",
                 "authenticated", "reader", "wbuf", "out", "close_after_reply", "closed", "reading",
                 "writing", "transaction", "redirects", "reply_mode", "close_callbacks", "backlog",
                 "prefetched", "waiting", "later", "protocol_error", "pending_fds", "out_bytes",
                 "soft_limit_since", "over_output_limit", "counted_args", "__dict__", "__weakref__")

    def __init__(self, server, sock: socket.socket, conn_id: int):
        self.server = server
        self.engine = server.engine
        self.tiers = server.tiers           # the TierManager, None without lower tiers
        self.commands = server.commands
        self.sock = sock
        self.fd = sock.fileno()
        self.id = conn_id
        self.enc = writer.Encoder(2)
        self.client_info = ClientInfo()
        self.created = self.last_active = time.monotonic()
        self.last_command = "NULL"
        self.addr, self.laddr = _addresses(sock)
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.user = server.users.default
        self.authenticated = self.user.enabled and self.user.nopass
        self.reader = RequestReader(server.config.proto_max_bulk_len)
        self.reader.authenticated = self.authenticated
        self.wbuf = bytearray()
        self.out: deque = deque()          # (buffer, lease or None) waiting for the socket
        self.close_after_reply = False
        self.closed = False
        self.reading = True
        self.writing = False
        self.transaction = Transaction()
        self.redirects = RedirectFlags()
        self.reply_mode = ReplyMode()
        self.close_callbacks: list = []     # run once when the client goes (leases, reservations)
        self.backlog: deque = deque()       # parsed commands not run yet
        self.prefetched: list[int] = []     # entries staged for commands still in the backlog
        self.waiting: asyncio.Future | None = None
        self.later: deque = deque()         # (future, resume) deferred behind ``waiting``
        self.protocol_error: ProtocolError | None = None
        self.pending_fds: list[int] = []    # sent with the next reply bytes (SCM_RIGHTS)
        self.out_bytes = 0                  # bytes queued in ``out``
        self.soft_limit_since: float | None = None
        self.over_output_limit = False      # replies past the limit: closed, nothing more queued
        self.counted_args: tuple = (None, 0, 0)     # (args list, how many, their bytes) for the query limit

    # ------------------------------------------------------------- identity

    def log_in(self, user) -> None:
        """AUTH succeeded: this connection acts as ``user`` from now on."""
        self.user = user
        self.authenticated = self.reader.authenticated = True

    def describe(self, running: list | None = None) -> str:
        """A CLIENT LIST line; ``running``: the request this connection is running (CLIENT LIST or
        INFO of its own), which Redis still counts in the query buffer."""
        now = time.monotonic()
        qbuf = self.reader.end - self.reader.start
        if running is not None:
            qbuf += 3 + len(str(len(running))) + sum(len(a) + 5 + len(str(len(a))) for a in running)
        return (f"id={self.id} addr={self.addr} laddr={self.laddr} fd={self.fd} name={self.client_info.name.decode()} "
                f"age={int(now - self.created)} idle={int(now - self.last_active)} flags=N db=0 sub=0 psub=0 "
                f"ssub=0 multi={-1 if self.transaction.queued is None else len(self.transaction.queued)} qbuf={qbuf} qbuf-free={len(self.reader.buf) - self.reader.end} "
                f"argv-mem=0 multi-mem=0 rbs={len(self.reader.buf)} rbp=0 obl={len(self.wbuf)} oll={len(self.out)} "
                f"omem={self.out_bytes} tot-mem={len(self.reader.buf)} events=r cmd={self.last_command} "
                f"user={acl.printable(self.user.name)} redir=-1 "
                f"resp={self.enc.protocol} lib-name={self.client_info.lib_name.decode()} lib-ver={self.client_info.lib_ver.decode()}")

    # ------------------------------------------------------------- reading

    def on_readable(self) -> None:
        reader = self.reader
        if self._receive() is None:
            return
        self.last_active = time.monotonic()
        big_in_progress = reader.big is not None
        if not self._run_safely():
            return
        if reader.big is not None and not big_in_progress and not self._receive_big():
            return
        if (reader.end != reader.start or reader.args or reader.big_got) \
                and self._query_bytes() > self.server.config.client_query_buffer_limit:
            self._close_for_query_limit()
            return
        self.flush()
        if self.tls and self.reading and not self.closed and self.sock.pending():
            self.server.loop.call_soon(self._read_pending_tls)

    def _receive(self) -> int | None:
        """Read what the socket holds into the reader's buffers: the bytes received, or
        None when the client is gone (closed here)."""
        reader = self.reader
        got = 0
        try:
            for _ in range(READS_PER_EVENT):
                if (reader.big is None and not reader.discarding) or self.tls:
                    buf = reader.recv_buffer()
                    n, room = self.sock.recv_into(buf), len(buf)
                else:
                    bufs = reader.recv_buffers()
                    n, room = self.sock.recvmsg_into(bufs)[0], sum(len(b) for b in bufs)
                if n == 0:
                    self.close()
                    return None
                reader.received(n)
                got += n
                if (n < room and not self.tls) or (reader.big is None and not reader.discarding):
                    break           # TLS hands out a record per call: keep reading a big bulk
        except WOULD_BLOCK:
            pass
        except OSError:
            self.close()
            return None
        return got

    def _receive_big(self) -> bool:
        """The parse just began a big bulk (a SET's value): a client writes the value right
        behind its header, so it is usually in the socket already and is read now, with
        the command run in this same turn, instead of after another wait for the socket
        (a loop turn of the interpreter). False when the client is gone."""
        if self.waiting is not None or not self.reading:
            return True
        got = self._receive()
        if got is None:
            return False
        return not got or self._run_safely()

    def _run_safely(self) -> bool:
        """Run what was parsed; False when that cost the client its connection."""
        try:
            self._run_parsed()
        except Exception:
            # A bug must cost one client its connection, never the node.
            log.exception("closing client id=%d after an internal error", self.id)
            self.close()
            return False
        return not self.closed

    def _read_pending_tls(self) -> None:
        """Read what OpenSSL already decrypted: the socket will not say it is readable."""
        if not self.closed and self.reading and self.waiting is None:
            self.on_readable()

    def _query_bytes(self) -> int:
        """Bytes held for the request being received: unparsed input, the arguments parsed
        so far (counted once each as they arrive) and the part of a big bulk received."""
        reader = self.reader
        size = reader.end - reader.start + reader.big_got
        args = reader.args
        if args:
            counted, count, nbytes = self.counted_args
            if counted is not args:
                count, nbytes = 0, 0
            nbytes += sum(len(a) + ARG_OVERHEAD if type(a) is bytes else ARG_OVERHEAD for a in args[count:])
            self.counted_args = (args, len(args), nbytes)
            size += nbytes
        return size

    def _close_for_query_limit(self) -> None:
        log.warning("Closing client that reached max query buffer length: %s", self.describe())
        self.server.stats.query_limit_disconnections += 1
        self.close()

    def _run_parsed(self) -> None:
        if self.protocol_error is None:
            try:
                self._parse()
            except ProtocolError as exc:
                self.backlog.extend(self.reader.parsed_before_error)
                self.protocol_error = exc
        self._run_backlog()

    def _parse(self) -> None:
        """Parse what arrived into the backlog. The reader stops at a big bulk's header;
        dispatch says where that value lands (an extent of the arena when it is a value
        to store) and the reader goes on, receiving the value there."""
        reader = self.reader
        self.backlog.extend(reader.parse())
        while reader.value_size:
            try:
                reader.place_value(*value_destination(self, reader.args, reader.value_size))
            except OutOfMemory as exc:          # reported in order, when the command runs
                reader.refuse_value(exc)
            self.backlog.extend(reader.parse())

    def _run_backlog(self) -> None:
        """Run parsed commands in order; stop while one waits for a tier."""
        backlog = self.backlog
        while backlog and self.waiting is None and not self.close_after_reply:
            run_plain(self)
            if backlog and self.waiting is None and not self.close_after_reply:
                dispatch(self, *backlog.popleft())
        if self.prefetched and not backlog and self.waiting is None:
            self.tiers.unstage(self.prefetched)
            self.prefetched = []
        if not backlog and self.waiting is None and self.protocol_error is not None \
                and not self.close_after_reply:
            log.info("Protocol error (%s) from client id=%d addr=%s", self.protocol_error, self.id, self.addr)
            self.wbuf += writer.error(f"Protocol error: {self.protocol_error}")
            self.close_after_reply = True

    def defer(self, awaitable, resume) -> None:
        """Pause this client's commands until ``awaitable`` is done, then ``resume(result)``.

        Replies stay in request order: later commands wait in the backlog, and
        we stop reading from the socket meanwhile. A command may defer twice
        (a layer wait, then an SSD write to acknowledge): the second wait
        starts when the first has resumed, never in its place.
        """
        future = asyncio.ensure_future(awaitable)
        if self.waiting is not None:
            self.later.append((future, resume))
            return
        self._wait_for(future, resume)

    def _wait_for(self, future: asyncio.Future, resume) -> None:
        self.waiting = future
        if self.reading:
            self.server.loop.remove_reader(self.fd)
            self.reading = False
        future.add_done_callback(lambda done: self._resume(done, resume))

    def _resume(self, future, resume) -> None:
        self.waiting = None
        try:
            resume(future.result())
        except Exception:
            log.exception("deferred command failed")
            self.wbuf += writer.error("internal error while running the command")
        if self.waiting is None and self.later:
            self._wait_for(*self.later.popleft())
            return
        if self.closed:
            return
        self._run_backlog()
        self.flush()

    # ------------------------------------------------------------- writing

    def write(self, data: bytes) -> None:
        self.wbuf += data

    def write_value(self, entry: int) -> None:
        """Queue the value of ``entry`` as a bulk reply: copied into the reply buffer, or,
        past ``COPIED_REPLIES`` of queued replies, sent from the arena under a hold.

        Copying first is the cheaper send for values up to a few MiB: the kernel's
        copy out of an arena page (page-aligned, behind a reply header of a few
        bytes) runs at a fraction of memcpy's speed on these hosts (64 KiB: 22 us
        against 14 us for the same bytes a few bytes further on, measured alone),
        where memcpy does not care; a 4 MiB copy costs as much as it saves.
        """
        if self.over_output_limit:
            return                  # closing: hold no more values for it
        engine = self.engine
        view = engine.view(entry)
        size = len(view)
        self.wbuf += b"$%d\r\n" % size
        if size < BIG_REPLY or len(self.wbuf) + self.out_bytes + size <= COPIED_REPLIES or self.reply_mode.muting:
            self.wbuf += view
            self.wbuf += b"\r\n"
            if size >= BIG_REPLY:
                self._check_output_limit()
            return
        lease = (engine.holds.hold(entry), entry, engine.key_of(entry))     # None token: heap-staged copy
        self.out.append((self.wbuf, None))
        self.out.append((view, lease))
        self.out_bytes += len(self.wbuf) + size
        self.wbuf = bytearray(b"\r\n")
        self._check_output_limit()

    def flush(self) -> None:
        if self.closed or self.waiting is not None:
            return                  # replies go out in order, after what we wait for
        if self.over_output_limit:
            self.close()
            return
        if self.wbuf and not self.out and not self.pending_fds and self._send_small():
            return
        if self.wbuf:
            self.out.append((self.wbuf, None))
            self.out_bytes += len(self.wbuf)
            self.wbuf = bytearray()
        out = self.out
        while out:
            try:
                if self.pending_fds:
                    sent = self._send_with_fds()
                elif len(out) == 1 or self.tls:
                    sent = self.sock.send(out[0][0])
                else:
                    sent = self.sock.sendmsg([b for b, _ in islice(out, 0, IOV_MAX)])
            except WOULD_BLOCK:
                break
            except OSError:
                self.close()
                return
            if not self._consume(sent):
                break
        self._check_output_limit()
        if self.over_output_limit:
            self.close()
            return
        self._update_interest()

    def _check_output_limit(self) -> None:
        """Redis's client-output-buffer-limit for normal clients: past the hard limit, or
        past the soft one for longer than its seconds, the client is closed (at once when
        nothing runs for it, else once its current command ends)."""
        hard, soft, seconds = self.server.output_limit
        if not (hard or soft) or self.over_output_limit:
            return
        queued, now = len(self.wbuf) + self.out_bytes, time.monotonic()
        if soft and queued > soft and self.soft_limit_since is None:
            self.soft_limit_since = now
            self.server.loop.call_later(seconds + 0.01, self._soft_limit_deadline, now)
        elif not (soft and queued > soft):
            self.soft_limit_since = None
        over_soft = self.soft_limit_since is not None and now - self.soft_limit_since > seconds
        if (hard and queued > hard) or over_soft:
            log.warning("Client %s scheduled to be closed ASAP for overcoming of output buffer limits.",
                        self.describe())
            self.server.stats.output_limit_disconnections += 1
            self.over_output_limit = self.close_after_reply = True

    def _soft_limit_deadline(self, since: float) -> None:
        if self.closed or self.soft_limit_since != since:
            return                  # gone, or back under the soft limit since
        self._check_output_limit()
        if self.over_output_limit and self.waiting is None:
            self.close()

    def _send_small(self) -> bool:
        """The common case, one buffer of small replies: True when it all went out."""
        try:
            sent = self.sock.send(self.wbuf)
        except WOULD_BLOCK:
            return False
        except OSError:
            self.close()
            return True
        if sent < len(self.wbuf):
            del self.wbuf[:sent]
            return False
        self.wbuf = bytearray()
        if self.writing or not self.reading or self.close_after_reply:
            self._update_interest()
        return True

    def attach_fds(self, fds: list[int]) -> None:
        """Pass ``fds`` to the client with the next reply (Unix sockets only)."""
        if self.sock.family != socket.AF_UNIX:
            raise CommandError("file descriptors can only be passed over a Unix socket")
        self.pending_fds.extend(fds)

    def _send_with_fds(self) -> int:
        bufs = [b for b, _ in islice(self.out, 0, IOV_MAX)]
        fds = array("i", self.pending_fds)
        sent = self.sock.sendmsg(bufs, [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        self.pending_fds = []
        return sent

    def _consume(self, sent: int) -> bool:
        """Drop what the kernel took; True when every queued buffer went out."""
        self.out_bytes -= sent
        out = self.out
        while sent and out:
            buf, lease = out[0]
            n = len(buf)
            if sent < n:
                out[0] = (memoryview(buf)[sent:], lease)
                return False
            sent -= n
            out.popleft()
            if lease is not None:
                self.engine.holds.release(lease[0])
        return not out

    def _update_interest(self) -> None:
        loop = self.server.loop
        if self.out:
            if not self.writing:
                loop.add_writer(self.fd, self.flush)
                self.writing = True
            if self.reading:
                loop.remove_reader(self.fd)
                self.reading = False
            return
        if self.writing:
            loop.remove_writer(self.fd)
            self.writing = False
        if self.close_after_reply:
            self.close()
        elif not self.reading and self.waiting is None:
            self.reading = True
            loop.add_reader(self.fd, self.on_readable)
            if self.tls and self.sock.pending():
                loop.call_soon(self._read_pending_tls)
            elif self.reader.end > self.reader.start:
                loop.call_soon(self.on_readable_buffered)

    def on_readable_buffered(self) -> None:
        """Run commands that arrived while we were not reading."""
        if not self.closed and self.reading and self.waiting is None:
            self._run_parsed()
            self.flush()

    # ------------------------------------------------------------- closing

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        loop = self.server.loop
        loop.remove_reader(self.fd)
        loop.remove_writer(self.fd)
        # The fd number may go to the next client at once: a wait that ends after this
        # must not touch the loop's registration for it.
        self.reading = self.writing = False
        for extent in self.reader.pending_extents():
            if isinstance(extent, Extent):
                self.engine.release(extent)
        if self.transaction.queued:
            release_queued(self.engine, self.transaction.queued)
        release_queued(self.engine, [(args, has_extents) for args, _, has_extents in self.backlog])
        self.backlog.clear()
        if self.prefetched:
            self.tiers.unstage(self.prefetched)
            self.prefetched = []
        for _, lease in self.out:
            if lease is not None:
                self.engine.holds.release(lease[0])
        self.out.clear()
        self.out_bytes = 0
        for callback in self.close_callbacks:
            try:
                callback(self)
            except Exception:
                log.exception("close callback failed")
        self.close_callbacks.clear()
        self.sock.close()
        self.server.forget(self)


def _addresses(sock: socket.socket) -> tuple[str, str]:
    if sock.family == socket.AF_UNIX:
        return "/unixsocket:0", sock.getsockname() + ":0"
    peer, local = sock.getpeername(), sock.getsockname()
    return f"{peer[0]}:{peer[1]}", f"{local[0]}:{local[1]}"
