"""Incremental RESP request parser that lands large values where they belong.

Why not parse into bytes like everyone else: a 4 MiB SET would then cost a
fresh 4 MiB buffer (page faults) and a copy into the store. Instead, when the
parser meets a bulk of at least ``BIG_BULK`` bytes it asks its owner for the
destination: ``parse`` stops at that bulk's header with ``value_size`` set, the
owner chooses where the value goes (the connection asks dispatch: an arena
extent for a value to store, a plain bytearray for anything else) and hands it
over with ``place_value`` (or ``refuse_value``), and the socket receives the rest
of that bulk straight into it (``recv_buffer`` hands out the destination's
unfilled tail). Calls only go forward: the reader never calls its owner. Small
arguments are parsed from one reusable buffer per connection.

The reader never touches a socket: ``recv_buffer()`` says where the next bytes
go, ``received(n)`` says how many arrived, ``parse()`` returns the complete
commands. Errors and limits follow Redis's networking.c, message for message;
a ``ProtocolError`` means: reply with it, then close the connection.
"""
from __future__ import annotations

import re
from itertools import compress, cycle, repeat
from typing import Any

BIG_BULK = 32 * 1024
INLINE_MAX = 64 * 1024        # Redis's PROTO_INLINE_MAX_SIZE
MAX_MULTIBULK = 2**31 - 1     # Redis's INT_MAX
UNAUTH_MULTIBULK = 10
UNAUTH_BULK = 16384
INITIAL_BUFFER = 16 * 1024
SPLIT_WINDOW = 8 * 1024       # bytes the batch cut looks at per pass (< BIG_BULK)
MAX_SPLIT_ARGS = 1024         # arguments of a command the batch cut takes; more go the exact way
# A bulk header of 10000 bytes or more near the start: that command is longer than the window, so the
# split could not take it; the exact parser reads it without the split's pass over its value's bytes.
# Looked for only when more than SHORT_SPLIT bytes wait: a split of fewer costs less than the look.
_LONG_BULK_HEAD = re.compile(rb"\$[0-9]{5}").search
LONG_BULK_LOOKAHEAD = 128
SHORT_SPLIT = 1024
LONE_MAX = SHORT_SPLIT        # bytes `_lone_command` looks at
_SPLIT_HEADS = {b"*%d" % n: n for n in range(1, MAX_SPLIT_ARGS + 1)}    # canonical array headers only
_bulk_header = [b"$%d" % n for n in range(SPLIT_WINDOW)].__getitem__      # length -> its canonical bulk header
UNIFORM_MAX_ARGS = 16         # argument counts `_uniform_commands` has masks for
UNIFORM_MIN_COMMANDS = 6      # fewer are cheaper cut one by one
UNIFORM_MIN_PARTS = 3 * UNIFORM_MIN_COMMANDS     # a split with fewer parts cannot hold that many
# argc -> which parts of one command are its bulk headers, and which its arguments
_UNIFORM_MASKS = {argc: ((False,) + (True, False) * argc, (False,) + (False, True) * argc)
                  for argc in range(1, UNIFORM_MAX_ARGS + 1)}

_DISCARD = memoryview(bytearray(1024 * 1024))


class ProtocolError(Exception):
    """Malformed input: the connection gets ``-ERR Protocol error: ...`` and is closed."""



def _uniform_commands(parts: list[bytes], out: list) -> int:
    """Cut a long run of commands that all have the first one's argument count (a
    pipeline of SETs, or of GETs) in C, with no Python step per command; the
    number of parts taken (0 when the run is short, mixed or fails its check).

    Each command then spans the same number of parts, so its array header sits
    at a fixed stride and its headers and arguments are picked out by a
    repeating mask. Misalignment (a value holding CRLF) shows up as a header
    that does not match its argument, which `_lengths_match` refuses.
    """
    argc = _SPLIT_HEADS.get(parts[0])
    if argc is None or argc > UNIFORM_MAX_ARGS:
        return 0
    stride = 2 * argc + 1
    count = (len(parts) - 1) // stride
    if count < UNIFORM_MIN_COMMANDS or parts[0:count * stride:stride].count(parts[0]) != count:
        return 0
    run = parts[:count * stride]
    header_mask, arg_mask = _UNIFORM_MASKS[argc]
    args = list(compress(run, cycle(arg_mask)))
    if not _lengths_match(list(compress(run, cycle(header_mask))), args):
        return 0
    out += zip(map(list, zip(*[iter(args)] * argc)), repeat(None), repeat(False))
    return len(run)


def _mixed_commands(parts: list[bytes], out: list) -> tuple[int, bool]:
    """Cut the complete small commands at the start of ``parts``, one step per command:
    the number of parts taken, and False when it stopped at a command the exact
    parser must read (True when only an incomplete command is left)."""
    complete, i = len(parts) - 1, 0
    while i < complete:
        argc = _SPLIT_HEADS.get(parts[i])
        if argc is None:
            return i, False
        stop = i + 1 + 2 * argc
        if stop > complete:
            return i, True
        args = parts[i + 2:stop:2]
        if not _lengths_match(parts[i + 1:stop:2], args):
            return i, False
        out.append((args, None, False))
        i = stop
    return i, True


def _lengths_match(headers: list[bytes], args: list[bytes]) -> bool:
    """Whether each header is exactly the canonical ``$len`` of its argument (no sign,
    no leading zero), for a whole batch in C: the expected headers come from a table
    indexed by length, and the two lists are compared at once."""
    return headers == list(map(_bulk_header, map(len, args)))


def _int(buf: bytearray, start: int, stop: int) -> int | None:
    """Redis's string2ll: optional '-', digits only, no spaces, '+' or leading zeros."""
    text = bytes(buf[start:stop])
    digits = text[1:] if text[:1] == b"-" else text
    if digits.isdigit() and (digits[0] != 48 or len(digits) == 1) and text != b"-0":
        return int(text)
    return None


_ESCAPES = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"b": b"\b", b"a": b"\a"}


def _is_hex(text: bytes) -> bool:
    return len(text) == 2 and all(c in b"0123456789abcdefABCDEF" for c in text)


def split_inline(line: bytes) -> list[bytes]:
    """Split an inline command like sdssplitargs: whitespace, quotes, escapes."""
    if b'"' not in line and b"'" not in line:
        return line.split()
    args, i, n = [], 0, len(line)
    while True:
        while i < n and line[i:i + 1].isspace():
            i += 1
        if i >= n:
            return args
        cur = bytearray()
        quote = None
        while True:
            if i >= n:
                if quote:
                    raise ProtocolError("unbalanced quotes in request")
                break
            c = line[i:i + 1]
            if quote:
                if c == b"\\" and quote == b'"' and line[i + 1:i + 2] == b"x" \
                        and _is_hex(line[i + 2:i + 4]):
                    cur.append(int(line[i + 2:i + 4], 16))
                    i += 3
                elif c == b"\\" and quote == b'"' and i + 1 < n:
                    i += 1
                    cur += _ESCAPES.get(line[i:i + 1], line[i:i + 1])
                elif c == b"\\" and quote == b"'" and line[i + 1:i + 2] == b"'":
                    i += 1
                    cur += b"'"
                elif c == quote:
                    if i + 1 < n and not line[i + 1:i + 2].isspace():
                        raise ProtocolError("unbalanced quotes in request")
                    i += 1
                    break
                else:
                    cur += c
            elif c.isspace():
                break
            elif c in (b'"', b"'"):
                quote = c
            else:
                cur += c
            i += 1
        args.append(bytes(cur))


class RequestReader:
    """Turns the bytes of one connection into commands (lists of arguments)."""

    def __init__(self, max_bulk_len: int):
        self.max_bulk_len = max_bulk_len
        self.authenticated = True
        self.buf = bytearray(INITIAL_BUFFER)
        self.mv = memoryview(self.buf)
        self.start = 0
        self.end = 0
        self.args: list | None = None   # arguments of the command being read
        self.want = 0                   # arguments still to come
        self.failure: Exception | None = None
        self.has_extents = False
        self.skip = 0                   # CRLF after a big bulk still to skip
        self.exact_until = 0            # the small-command split failed on the bytes before this
        self.value_size = 0             # a big bulk's length, waiting for `place_value`
        self.big: memoryview | None = None
        self.big_extent: Any = None
        self.big_got = 0
        self.discarding = 0             # bytes of a bulk with nowhere to go
        self.parsed_before_error: list = []

    # ------------------------------------------------------------ feeding

    def recv_buffer(self) -> memoryview:
        """Where the next received bytes must go."""
        if self.big is not None:
            return self.big[self.big_got:]
        if self.discarding:
            return _DISCARD[:min(len(_DISCARD), self.discarding)]
        if self.end == len(self.buf):
            self._make_room()
        return self.mv[self.end:]

    def recv_buffers(self) -> list[memoryview]:
        """Where the next bytes go, for one ``recvmsg_into``: while a big bulk is
        being received, its rest and then the request buffer, so the bulk's
        trailing CRLF and the next command arrive in the same call."""
        head = self.recv_buffer()
        if (self.big is None and not self.discarding) or self.start != self.end:
            return [head]
        self.start = self.end = self.exact_until = 0
        return [head, self.mv]

    def received(self, n: int) -> None:
        """``n`` bytes arrived in the buffers ``recv_buffer(s)`` handed out, in order."""
        if self.big is not None:
            take = min(n, len(self.big) - self.big_got)
            self.big_got += take
            n -= take
            if self.big_got == len(self.big):
                self._finish_big(self.big_extent)
        elif self.discarding:
            take = min(n, self.discarding)
            self.discarding -= take
            n -= take
            if not self.discarding:
                self._finish_big(None)
        self.end += n

    def _make_room(self) -> None:
        live = self.end - self.start
        self.exact_until = max(0, self.exact_until - self.start)
        if self.start:
            self.buf[:live] = self.buf[self.start:self.end]
        else:
            bigger = bytearray(2 * len(self.buf))
            bigger[:live] = self.buf[:live]
            self.mv.release()
            self.buf, self.mv = bigger, memoryview(bigger)
        self.start, self.end = 0, live

    def pending_extents(self) -> list:
        """Destinations of a command cut short (to give back when the client goes)."""
        held = [a for a in (self.args or []) if not isinstance(a, (bytes, type(None)))]
        if self.big_extent is not None:
            held.append(self.big_extent)
        return held

    # ------------------------------------------------------------ parsing

    def parse(self) -> list[tuple[list, Exception | None, bool]]:
        """Complete commands as (args, failure, has_extents) tuples. With ``value_size`` set
        after it, parsing stopped at a big bulk of the command in ``args``: place it, then
        parse again."""
        if self.args is None and self.end - self.start <= LONE_MAX and self.authenticated \
                and self.buf.find(b"\r\n*", self.start, self.end) < 0:      # a second command would start so
            lone = self._lone_command()
            if lone is not None:
                return lone
        out = []
        try:
            self._parse_into(out)
        except ProtocolError:
            self.parsed_before_error = out
            raise
        if self.start == self.end and self.big is None and not self.discarding and not self.value_size:
            self.start = self.end = self.exact_until = 0
        return out

    def _parse_into(self, out: list) -> None:
        buf = self.buf
        while self.big is None and not self.discarding and not self.value_size:
            if self.skip:
                take = min(self.skip, self.end - self.start)
                self.start += take
                self.skip -= take
                if self.skip:
                    break
            if self.args is None and self.authenticated and self.end - self.start > 4 \
                    and buf[self.start] == 42 and self.start >= self.exact_until:
                self._cut_batch(out)
            if self.args is None and not self._begin_command(out):
                break
            if self.args is not None:
                if not self._read_bulks(buf):
                    break
                out.append((self.args, self.failure, self.has_extents))
                self.args = None

    def _lone_command(self) -> list | None:
        """The buffer's bytes when they are exactly one small command, as `parse` returns it;
        None when they are anything else (the usual path takes them, from the same start).

        A client that waits for each reply sends one command per read: this one
        C-level split and header check replaces the batch cut's steps and the
        exact parser's look at an empty rest. The check is the batch cut's, so both
        paths accept exactly the same input: a canonical array header, each ``$len``
        equal to its argument's length, and the buffer ending at the last CRLF.
        """
        parts = self.mv[self.start:self.end].tobytes().split(b"\r\n")
        argc = _SPLIT_HEADS.get(parts[0])
        if argc is None or len(parts) != 2 * argc + 2 or parts[-1]:
            return None
        args = parts[2::2]
        if not _lengths_match(parts[1:-1:2], args):
            return None
        self.start = self.end = self.exact_until = 0
        return [(args, None, False)]

    def _cut_batch(self, out: list) -> None:
        """The batch cut, for pipelined batches of small commands: one C-level split of
        the buffer on CRLF, then the commands are cut out of the parts, each
        ``$len`` header checked against its argument in C (`_lengths_match`): a
        long run of commands of one shape at once (`_uniform_commands`), else
        command by command (`_mixed_commands`).

        A command that opens with a bulk too long for the window (a SET of a
        big value) is left to the exact parser before any split.

        Anything unusual (a value holding CRLF, a big bulk, a malformed header,
        more than ``MAX_SPLIT_ARGS`` arguments, an incomplete command) is left
        to the exact parser, so both paths accept and reject exactly the same
        input; the rest of a window where a check failed is not split again,
        so bad bytes cost one wasted split, not one per command behind them.
        """
        start = self.start
        if self.end - start > SHORT_SPLIT and _LONG_BULK_HEAD(self.buf, start, start + LONG_BULK_LOOKAHEAD):
            return
        window = min(self.end, start + SPLIT_WINDOW)
        parts = self.mv[start:window].tobytes().split(b"\r\n")
        taken = _uniform_commands(parts, out) if len(parts) > UNIFORM_MIN_PARTS else 0
        if not taken:
            taken, clean = _mixed_commands(parts, out)
            if not clean:
                self.exact_until = window
        if taken:       # what follows the parts taken is short: measure it rather than them
            self.start = window - len(b"\r\n".join(parts[taken:]))

    def _begin_command(self, out: list) -> bool:
        buf, pos, end = self.buf, self.start, self.end
        if pos >= end:
            return False
        if buf[pos] != 42:                                   # not '*': inline
            nl = buf.find(b"\n", pos, end)
            if nl < 0:
                if end - pos > INLINE_MAX:
                    raise ProtocolError("too big inline request")
                return False
            line = bytes(buf[pos:nl]).rstrip(b"\r")
            self.start = nl + 1
            args = split_inline(line)
            if args:
                out.append((args, None, False))
            return True
        nl = buf.find(b"\r\n", pos, end)
        if nl < 0:
            if end - pos > INLINE_MAX:
                raise ProtocolError("too big mbulk count string")
            return False
        n = _int(buf, pos + 1, nl)
        if n is None or n > MAX_MULTIBULK:
            raise ProtocolError("invalid multibulk length")
        if not self.authenticated and n > UNAUTH_MULTIBULK:
            raise ProtocolError("unauthenticated multibulk length")
        self.start = nl + 2
        if n > 0:
            self.args, self.want, self.failure, self.has_extents = [], n, None, False
        return True

    def _read_bulks(self, buf: bytearray) -> bool:
        """Read arguments into ``self.args``; True once all have arrived.

        This loop runs once per argument of every command: locals only, and
        the position is written back to ``self.start`` only when leaving.
        """
        args, mv, find, end = self.args, self.mv, buf.find, self.end
        pos, want = self.start, self.want
        try:
            while want:
                if self.skip:
                    take = min(self.skip, end - pos)
                    pos += take
                    self.skip -= take
                    if self.skip:
                        return False
                if pos >= end:
                    return False
                if buf[pos] != 36:                           # '$'
                    raise ProtocolError(f"expected '$', got '{chr(buf[pos])}'")
                nl = find(b"\r\n", pos, end)
                if nl < 0:
                    if end - pos > INLINE_MAX:
                        raise ProtocolError("too big bulk count string")
                    return False
                digits = buf[pos + 1:nl]
                if not digits.isdigit() or (digits[0] == 48 and len(digits) > 1):
                    raise ProtocolError("invalid bulk length")
                size = int(digits)
                if size > self.max_bulk_len:
                    raise ProtocolError("invalid bulk length")
                if size > UNAUTH_BULK and not self.authenticated:
                    raise ProtocolError("unauthenticated bulk length")
                body = nl + 2
                if size >= BIG_BULK:
                    pos, self.value_size = body, size       # the owner places it (`place_value`)
                    return False
                if body + size + 2 > end:
                    return False
                args.append(mv[body:body + size].tobytes())
                pos = body + size + 2
                want -= 1
            return True
        finally:
            if self.big is None and not self.discarding:
                self.start, self.want = pos, want

    def place_value(self, view: memoryview, extent: Any) -> None:
        """Receive the big bulk that stopped `parse` into ``view``; ``extent`` becomes the
        argument (an arena extent, or a heap bytearray standing in for one)."""
        size, self.value_size = self.value_size, 0
        take = min(self.end - self.start, size)
        self.has_extents = True
        view[:take] = self.mv[self.start:self.start + take]
        self.start += take
        self.big, self.big_extent, self.big_got = view, extent, take
        if take == size:
            self._finish_big(extent)

    def refuse_value(self, failure: Exception) -> None:
        """The big bulk that stopped `parse` has nowhere to go: its bytes are drained and
        ``failure`` travels with the command, to be reported in order."""
        size, self.value_size = self.value_size, 0
        take = min(self.end - self.start, size)
        self.failure = failure
        self.start += take
        self.discarding = size - take
        if not self.discarding:
            self._finish_big(None)

    def _finish_big(self, extent) -> None:
        self.args.append(bytes(extent) if isinstance(extent, bytearray) else extent)
        self.big, self.big_extent, self.big_got = None, None, 0
        self.want -= 1
        self.skip = 2
