"""RESP2 requests and replies for the client, without any I/O (sans-I/O).

The sync and the async connection share this module; each only supplies the
few lines that move bytes. Two design choices keep large values from being
copied:

* `RequestBuffer` lays out a round trip as a list of buffers for one
  `sendmsg`: headers and small arguments are packed into shared bytearrays,
  while an argument of `INLINE_LIMIT` bytes or more travels as the caller's own
  memoryview, never concatenated into a copy.

* `ReplyReader` parses from one reusable receive buffer. Its `read()` is a
  generator that yields a writable memoryview whenever it needs bytes; the
  driver `recv_into`s that view and sends back the count. Usually the view is
  the free tail of the receive buffer, but the remaining body of a large bulk
  reply is yielded as a slice of its destination (the caller's buffer for
  get_into, or one bytearray of the exact size), so the kernel copies the
  value straight to where it ends up.

Where a bulk reply goes is decided per reply by a sink: `None` allocates a
bytearray, `into(view)` fills a caller's buffer, and a value too large for
that buffer is read and dropped so the connection stays in step.

Error replies are returned as `ResponseError` values rather than raised, so
every reply of a pipelined round trip is read before anything is raised.
Bytes that are not RESP raise `ProtocolError`: the connection is then unusable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterable

from client.buffers import readable_view
from client.errors import ProtocolError, error_from_reply

CRLF = b"\r\n"
INLINE_LIMIT = 16 * 1024        # arguments this long or longer are sent as their own buffer
RECEIVE_BUFFER = 64 * 1024      # initial size of a connection's receive buffer
DIRECT_MIN = 16 * 1024          # bulk bodies with this much left are received straight into place
MIN_READ = 4096                 # make room before receiving into a smaller free tail
MAX_LINE = 1 << 20              # longest header, status or error line accepted
IOV_MAX = 1024                  # buffers per sendmsg call (Linux's UIO_MAXIOV)

SIMPLE, ERROR, INTEGER, BULK, ARRAY = b"+-:$*"

Reply = Any
Receive = Generator[memoryview, int, Reply]


class RequestBuffer:
    """The requests of one round trip, laid out as buffers for `sendmsg`."""

    def __init__(self) -> None:
        self.buffers: list[bytes | bytearray | memoryview] = []
        self._head = bytearray()

    def add(self, args: Iterable[Any]) -> None:
        """Append one command; each argument is str, int, or a bytes-like value."""
        args = list(args)
        head = self._head
        head += b"*%d\r\n" % len(args)
        for arg in args:
            view = _argument(arg)
            head += b"$%d\r\n" % view.nbytes
            if view.nbytes < INLINE_LIMIT:
                head += view
                head += CRLF
            else:
                self.buffers.append(head)
                self.buffers.append(view)
                head = bytearray(CRLF)
        self._head = head

    def finish(self) -> list[bytes | bytearray | memoryview]:
        """The buffers to send, in order."""
        if self._head:
            self.buffers.append(self._head)
            self._head = bytearray()
        return self.buffers


def pack(requests: Iterable[Iterable[Any]]) -> list[bytes | bytearray | memoryview]:
    """Lay out several commands (a pipeline) for one `sendmsg`."""
    out = RequestBuffer()
    for args in requests:
        out.add(args)
    return out.finish()


def drop_sent(buffers: list, sent: int) -> list:
    """What is left to send after `sendmsg` reported `sent` bytes written."""
    for i, buf in enumerate(buffers):
        size = len(buf)
        if sent < size:
            rest = buffers[i:]
            if sent:
                rest[0] = memoryview(buf)[sent:]
            return rest
        sent -= size
    return []


def _argument(arg: Any) -> memoryview:
    if isinstance(arg, int) and not isinstance(arg, bool):
        return memoryview(b"%d" % arg)
    return readable_view(arg)


# --- where bulk replies go -------------------------------------------------------

@dataclass
class Placement:
    """A sink's answer for one bulk reply: write it into `view` (None: drop it), return `result`."""

    view: memoryview | None
    result: Reply


Sink = Callable[[int], Placement] | None


def into(buffer: memoryview, too_small: Callable[[int], Reply]) -> Sink:
    """A sink that receives a bulk reply into `buffer` and yields its length.

    A value larger than the buffer is dropped and `too_small(size)` becomes
    the reply, so the caller can raise once the round trip is complete.
    """
    def place(size: int) -> Placement:
        if size > buffer.nbytes:
            return Placement(None, too_small(size))
        return Placement(buffer[:size], size)
    return place


# --- replies -----------------------------------------------------------------------

class ReplyReader:
    """Parses RESP2 replies out of one receive buffer that lives as long as the connection."""

    def __init__(self, size: int = RECEIVE_BUFFER) -> None:
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    @property
    def buffered(self) -> int:
        """Bytes received but not parsed yet (non-zero between replies means the peer misbehaved)."""
        return self._end - self._start

    def read(self, sink: Sink = None) -> Receive:
        """Parse one reply; yields memoryviews to fill, returns the reply.

        Replies map to Python as: simple string -> str, error -> ResponseError,
        integer -> int, bulk -> bytearray (or the sink's result), null -> None,
        array -> list.
        """
        line = yield from self._line()
        if not line:
            raise ProtocolError("empty reply line")
        kind, body = line[0], line[1:]
        if kind == BULK:
            size = _length(body)
            return None if size < 0 else (yield from self._bulk(size, sink))
        if kind == INTEGER:
            return _integer(body)
        if kind == SIMPLE:
            return body.decode()
        if kind == ERROR:
            return error_from_reply(body.decode(errors="replace"))
        if kind == ARRAY:
            count = _length(body)
            if count < 0:
                return None
            items = []
            for _ in range(count):
                items.append((yield from self.read(sink)))
            return items
        raise ProtocolError(f"unexpected reply type {bytes(line[:16])!r}")

    def _line(self) -> Generator[memoryview, int, bytearray]:
        while True:
            end = self._buf.find(CRLF, self._start, self._end)
            if end >= 0:
                line = self._buf[self._start:end]
                self._start = end + 2
                return line
            if self._end - self._start > MAX_LINE:
                raise ProtocolError(f"no line end in {MAX_LINE} bytes")
            yield from self._fill()

    def _bulk(self, size: int, sink: Sink) -> Receive:
        if sink is None:
            if self._end - self._start >= size + 2:
                value = self._buf[self._start:self._start + size]
                self._start += size
            else:
                value = bytearray(size)
                yield from self._receive(memoryview(value), size)
        else:
            placement = sink(size)
            value = placement.result
            yield from self._receive(placement.view, size)
        yield from self._crlf()
        return value

    def _receive(self, dest: memoryview | None, size: int) -> Generator[memoryview, int, None]:
        """Move `size` body bytes into dest (or drop them when dest is None)."""
        filled = 0
        while True:
            take = min(self._end - self._start, size - filled)
            if dest is not None and take:
                dest[filled:filled + take] = self._view[self._start:self._start + take]
            self._start += take
            filled += take
            if filled == size:
                return
            if dest is not None and size - filled >= DIRECT_MIN:
                filled += yield dest[filled:size]
            else:
                yield from self._fill()

    def _crlf(self) -> Generator[memoryview, int, None]:
        while self._end - self._start < 2:
            yield from self._fill()
        if self._buf[self._start:self._start + 2] != CRLF:
            raise ProtocolError("bulk reply not terminated by CRLF")
        self._start += 2

    def _fill(self) -> Generator[memoryview, int, None]:
        """Receive more bytes at the end of the buffer, making room first."""
        pending = self._end - self._start
        if pending == 0:
            self._start = self._end = 0
        elif len(self._buf) - self._end < MIN_READ:
            if self._start < MIN_READ:
                self._grow()
            else:
                self._view[:pending] = self._view[self._start:self._end]
                self._start, self._end = 0, pending
        self._end += yield self._view[self._end:]

    def _grow(self) -> None:
        bigger = bytearray(2 * len(self._buf))
        bigger[:self._end] = self._view[:self._end]
        self._buf = bigger
        self._view = memoryview(bigger)


def _length(body: bytearray) -> int:
    size = _integer(body)
    if size < -1:
        raise ProtocolError(f"negative length {size}")
    return size


def _integer(body: bytearray) -> int:
    try:
        return int(body)
    except ValueError:
        raise ProtocolError(f"not an integer: {bytes(body[:32])!r}") from None
