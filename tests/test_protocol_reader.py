"""Unit tests of the incremental RESP request parser (kvstore.net.protocol.reader).

No sockets: bytes are fed the way the connection feeds them (write into
``recv_buffer()``, report with ``received(n)``, collect with ``parse()``), in
every split and in random chunk sizes. What is checked:
- the commands that come out do not depend on how the stream was cut;
- parsing stops at a bulk of at least ``BIG_BULK`` bytes; it lands in the
  destination given to ``place_value`` (here by an allocate function, as
  dispatch gives it to the connection), and that destination object itself
  becomes the argument (no copy of the value is made anywhere else);
- a refused bulk (``refuse_value``: the allocate function raised) makes the
  command carry the failure while the rest of the stream still parses;
- inline commands split as Redis's sdssplitargs splits them (quotes, escapes);
- every malformed input raises ProtocolError with Redis's message (the cases
  and messages are the ones tests/test_bad_input.py checks against a real
  redis-server), and random bytes raise nothing else.
"""
from __future__ import annotations

import itertools
import random
import re
import tracemalloc
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.net.protocol.reader import (BIG_BULK, UNAUTH_BULK, UNAUTH_MULTIBULK, ProtocolError,
                                     RequestReader, split_inline)
from test_bad_input import MALFORMED
from test_redis_compat import encode_command

DEFAULT_MAX_BULK = 512 * 1024 * 1024


@dataclass(eq=False)
class Holder:
    """A destination for a big bulk, as an arena extent would be."""

    data: bytearray


class Recorder:
    """An allocate function that hands out Holders and remembers its calls."""

    def __init__(self):
        self.calls: list[tuple[list, int]] = []
        self.holders: list[Holder] = []

    def __call__(self, args: list, size: int) -> tuple[memoryview, Holder]:
        self.calls.append((list(args), size))
        holder = Holder(bytearray(size))
        self.holders.append(holder)
        return memoryview(holder.data), holder


def on_heap(args: list, size: int) -> tuple[memoryview, bytearray]:
    buf = bytearray(size)
    return memoryview(buf), buf


def feed(reader: RequestReader, data: bytes, chunk_sizes=(len,), out: list | None = None,
         allocate=on_heap) -> list:
    """Deliver ``data`` in chunks of the given sizes (cycled); return what parse() gave.

    Each chunk may take several ``recv_buffer`` rounds (a big bulk's
    destination only takes that bulk's bytes), with a parse after each, as the
    connection does; where parse stops at a big bulk, ``allocate(args, size)``
    gives its destination, or raises to refuse it, as dispatch does for the
    connection. Commands are also appended to ``out`` as they come.
    """
    source = memoryview(data)
    out = [] if out is None else out
    pos = 0
    for size in itertools.cycle(chunk_sizes):
        if pos >= len(data):
            return out
        stop = min(pos + (size(data) if callable(size) else size), len(data))
        while pos < stop:
            buf = reader.recv_buffer()
            n = min(len(buf), stop - pos)
            buf[:n] = source[pos:pos + n]
            reader.received(n)
            pos += n
            out += reader.parse()
            while reader.value_size:
                try:
                    reader.place_value(*allocate(reader.args, reader.value_size))
                except Exception as exc:
                    reader.refuse_value(exc)
                out += reader.parse()
    return out


def args_of(parsed: list) -> list[list]:
    return [[bytes(a.data) if isinstance(a, Holder) else a for a in args] for args, _, _ in parsed]


def parse_all(data: bytes, chunk_sizes=(len,), max_bulk_len: int = DEFAULT_MAX_BULK) -> list[list]:
    return args_of(feed(RequestReader(max_bulk_len), data, chunk_sizes, allocate=Recorder()))


BIG_VALUE = bytes(range(256)) * (BIG_BULK // 256 + 5)
SMALL_STREAM = (encode_command("SET", "key", "value") + b"PING\r\n" + b"\r\n"
                + encode_command("MSET", "a", "", "b", "\r\n$*") + b"*0\r\n" + b"*-1\r\n"
                + b'ECHO "two words" \'x y\'\r\n' + encode_command("GET", "key"))
SMALL_COMMANDS = [[b"SET", b"key", b"value"], [b"PING"], [b"MSET", b"a", b"", b"b", b"\r\n$*"],
                  [b"ECHO", b"two words", b"x y"], [b"GET", b"key"]]


# ----------------------------------------------------------------- chunking

def test_small_stream_in_one_piece():
    assert parse_all(SMALL_STREAM) == SMALL_COMMANDS


def test_split_in_two_at_every_byte_boundary():
    for cut in range(1, len(SMALL_STREAM)):
        assert parse_all(SMALL_STREAM, (cut, len(SMALL_STREAM))) == SMALL_COMMANDS, cut


def test_one_byte_at_a_time():
    assert parse_all(SMALL_STREAM, (1,)) == SMALL_COMMANDS


def test_big_bulk_split_at_every_boundary_around_it():
    """Cuts inside the header, the value's first and last bytes and the CRLF after it."""
    stream = encode_command("SET", "big", BIG_VALUE) + b"PING\r\n"
    value_at = stream.index(BIG_VALUE)
    value_end = value_at + len(BIG_VALUE)
    cuts = [*range(1, value_at + 3), *range(value_end - 2, len(stream))]
    for cut in cuts:
        assert parse_all(stream, (cut, len(stream))) == [[b"SET", b"big", BIG_VALUE], [b"PING"]], cut


@pytest.mark.parametrize("seed", range(5))
def test_random_chunk_sizes(seed):
    rng = random.Random(seed)
    stream = (SMALL_STREAM + encode_command("SET", "big", BIG_VALUE) + SMALL_STREAM
              + encode_command("MSET", "x", BIG_VALUE, "y", BIG_VALUE[::-1]))
    sizes = [rng.choice((1, 2, 3, 7, 100, 4096, 40_000)) for _ in range(200)]
    expected = SMALL_COMMANDS + [[b"SET", b"big", BIG_VALUE]] + SMALL_COMMANDS \
        + [[b"MSET", b"x", BIG_VALUE, b"y", BIG_VALUE[::-1]]]
    assert parse_all(stream, sizes) == expected


def test_reader_buffer_grows_for_a_long_small_argument():
    """Arguments below BIG_BULK but above the initial buffer still parse."""
    value = b"v" * (BIG_BULK - 1)
    assert parse_all(encode_command("SET", "k", value), (1000,)) == [[b"SET", b"k", value]]


# ----------------------------------------------------------------- big bulks

def test_big_bulk_lands_in_the_allocated_holder():
    recorder = Recorder()
    parsed = feed(RequestReader(DEFAULT_MAX_BULK), encode_command("SET", "big", BIG_VALUE), (5000,),
                  allocate=recorder)
    [(args, failure, has_extents)] = parsed
    [holder] = recorder.holders
    assert failure is None and has_extents
    assert recorder.calls == [([b"SET", b"big"], len(BIG_VALUE))]
    assert args[2] is holder
    assert bytes(holder.data) == BIG_VALUE
    assert args[:2] == [b"SET", b"big"]


def test_bulk_just_below_big_bulk_is_plain_bytes():
    recorder = Recorder()
    value = b"x" * (BIG_BULK - 1)
    [(args, _, has_extents)] = feed(RequestReader(DEFAULT_MAX_BULK), encode_command("SET", "k", value),
                                    allocate=recorder)
    assert args == [b"SET", b"k", value] and not has_extents and not recorder.calls


def test_big_bulk_is_not_copied_on_the_way():
    """Receiving a 4 MiB bulk allocates far less than the value's size."""
    size = 4 << 20
    value = bytearray(size)
    value[::4096] = b"\x07" * (size // 4096)
    holder = Holder(bytearray(size))
    allocate = lambda args, n: (memoryview(holder.data), holder)  # noqa: E731
    stream = encode_command("SET", "big", bytes(value))
    reader = RequestReader(DEFAULT_MAX_BULK)
    tracemalloc.start()
    try:
        parsed = feed(reader, stream, (64 * 1024,), allocate=allocate)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert parsed[0][0][2] is holder and holder.data == value
    assert peak < size // 8, f"{peak} bytes allocated while receiving a {size}-byte value"


def test_a_big_bulk_received_on_the_heap_is_bytes():
    stream = encode_command("SET", "big", BIG_VALUE)
    [(args, _, _)] = feed(RequestReader(DEFAULT_MAX_BULK), stream, (3000,))
    assert args == [b"SET", b"big", BIG_VALUE] and isinstance(args[2], bytes)


def test_allocate_failure_travels_with_the_command_and_the_stream_stays_in_sync():
    class NoRoom(Exception):
        pass

    def allocate(args, size):
        raise NoRoom("no room")

    stream = (encode_command("SET", "big", BIG_VALUE) + encode_command("SET", "small", "v")
              + b"PING\r\n")
    for sizes in ((len(stream),), (1, 7, 40_000), (BIG_BULK // 3,)):
        parsed = feed(RequestReader(DEFAULT_MAX_BULK), stream, sizes, allocate=allocate)
        assert [args for args, _, _ in parsed] == [[b"SET", b"big", None], [b"SET", b"small", b"v"],
                                                   [b"PING"]]
        failure = parsed[0][1]
        assert isinstance(failure, NoRoom) and str(failure) == "no room"
        assert parsed[1][1] is None and parsed[2][1] is None


def test_a_failed_bulk_does_not_stop_later_bulks_of_the_same_command():
    calls = []

    def allocate(args, size):
        calls.append(size)
        if len(calls) == 1:
            raise MemoryError("first")
        buf = bytearray(size)
        return memoryview(buf), Holder(buf)

    stream = encode_command("MSET", "a", BIG_VALUE, "b", BIG_VALUE[::-1]) + b"PING\r\n"
    parsed = feed(RequestReader(DEFAULT_MAX_BULK), stream, (999,), allocate=allocate)
    (args, failure, has_extents), (ping, _, _) = parsed
    assert isinstance(failure, MemoryError) and has_extents
    assert args[:4] == [b"MSET", b"a", None, b"b"] and bytes(args[4].data) == BIG_VALUE[::-1]
    assert ping == [b"PING"]


def test_a_command_cut_short_reports_its_holders():
    recorder = Recorder()
    reader = RequestReader(DEFAULT_MAX_BULK)
    stream = encode_command("MSET", "a", BIG_VALUE, "b", BIG_VALUE)
    assert feed(reader, stream[:-100], (4096,), allocate=recorder) == []
    assert reader.pending_extents() == recorder.holders and len(recorder.holders) == 2


# ----------------------------------------------------------------- inline

@pytest.mark.parametrize("line, expected", [
    (b"SET k v", [b"SET", b"k", b"v"]),
    (b"  SET \t k   v  ", [b"SET", b"k", b"v"]),
    (b'SET "a b" \'c d\'', [b"SET", b"a b", b"c d"]),
    (b'ECHO "a\\x41\\n\\q\\"b"', [b"ECHO", b'aA\nq"b']),
    (b'ECHO "\\r\\t\\b\\a\\\\"', [b"ECHO", b"\r\t\b\a\\"]),
    (b'ECHO "\\x4"', [b"ECHO", b"x4"]),
    (b'ECHO "\\xZZ"', [b"ECHO", b"xZZ"]),
    (b"ECHO 'a\\nb'", [b"ECHO", b"a\\nb"]),
    (b'ECHO a"b c"', [b"ECHO", b"ab c"]),
    (b'ECHO ""', [b"ECHO", b""]),
    (b"ECHO  '' x", [b"ECHO", b"", b"x"]),
    (b'ECHO "a"\t', [b"ECHO", b"a"]),
])
def test_inline_split_as_redis(line, expected):
    """Expectations are redis-server 7's ECHO replies to the same lines."""
    assert split_inline(line) == expected
    assert parse_all(line + b"\r\n") == [expected]


@pytest.mark.parametrize("line, expected", [
    (b"ECHO 'it\\'s'", [b"ECHO", b"it's"]),
    (b"ECHO 'a\\'", ProtocolError),
    (b"ECHO 'ab\\\\'", ProtocolError),
])
def test_inline_single_quote_escape_as_redis(line, expected):
    """sdssplitargs turns \\' inside single quotes into a quote (redis-server 7 checked)."""
    if expected is ProtocolError:
        with pytest.raises(ProtocolError, match="unbalanced quotes in request"):
            split_inline(line)
    else:
        assert split_inline(line) == expected


@pytest.mark.parametrize("line", [b'SET k "abc', b'ECHO "a"b', b"ECHO 'a'b", b'ECHO "abc\\"'])
def test_inline_unbalanced_quotes(line):
    with pytest.raises(ProtocolError, match="^unbalanced quotes in request$"):
        split_inline(line)


def test_inline_lf_only_and_empty_lines():
    assert parse_all(b"PING\n\r\n\nECHO x\n") == [[b"PING"], [b"ECHO", b"x"]]


# ----------------------------------------------------------------- errors

PROTOCOL_ERRORS = {name: case for name, case in MALFORMED.items() if case.closes}
SKIPPED_FRAMES = {name: case for name, case in MALFORMED.items() if not case.closes}
ERR_PREFIX = b"-ERR Protocol error: "


@pytest.mark.parametrize("case", PROTOCOL_ERRORS)
def test_protocol_error_has_redis_message(case):
    bad = PROTOCOL_ERRORS[case]
    message = bad.reply.removeprefix(ERR_PREFIX).removesuffix(b"\r\n").decode()
    reader = RequestReader(DEFAULT_MAX_BULK)
    before: list = []
    with pytest.raises(ProtocolError) as raised:
        feed(reader, encode_command("PING") + bad.payload, out=before, allocate=Recorder())
    assert str(raised.value) == message
    before += reader.parsed_before_error
    assert [args for args, _, _ in before] == [[b"PING"]], "commands before the error still run"


def command_answered_by(reply: bytes) -> list[bytes]:
    """The command a reply in MALFORMED answers: PONG, or the unknown command it names."""
    if reply == b"+PONG\r\n":
        return [b"PING"]
    return [re.match(rb"-ERR unknown command '(.*?)'", reply).group(1)]


@pytest.mark.parametrize("case", SKIPPED_FRAMES)
def test_frames_redis_skips_raise_nothing(case):
    skipped = SKIPPED_FRAMES[case]
    assert parse_all(skipped.payload, (1,)) == [command_answered_by(skipped.reply)]


@pytest.mark.parametrize("payload, message", [
    (b"*%d\r\n" % (UNAUTH_MULTIBULK + 1), "unauthenticated multibulk length"),
    (b"*1\r\n$%d\r\n" % (UNAUTH_BULK + 1), "unauthenticated bulk length"),
])
def test_limits_before_auth(payload, message):
    reader = RequestReader(DEFAULT_MAX_BULK)
    reader.authenticated = False
    with pytest.raises(ProtocolError, match=f"^{message}$"):
        feed(reader, payload)


def test_limits_before_auth_allow_the_largest_legal_request():
    reader = RequestReader(DEFAULT_MAX_BULK)
    reader.authenticated = False
    args = [b"x" * UNAUTH_BULK] * UNAUTH_MULTIBULK
    assert args_of(feed(reader, encode_command(*args))) == [args]


def test_bulk_above_max_bulk_len():
    limit = 1 << 20
    assert parse_all(b"*1\r\n$%d\r\n" % limit + b"x" * limit + b"\r\n", max_bulk_len=limit) \
        == [[b"x" * limit]]
    with pytest.raises(ProtocolError, match="^invalid bulk length$"):
        parse_all(b"*1\r\n$%d\r\n" % (limit + 1), max_bulk_len=limit)


# ----------------------------------------------------------------- properties

small_args = st.binary(max_size=64)
big_args = st.integers(BIG_BULK, BIG_BULK + 40_000).map(lambda n: bytes([n % 251]) * n)
commands = st.lists(st.lists(st.one_of(small_args, small_args, small_args, big_args),
                             min_size=1, max_size=6), min_size=1, max_size=8)
# Any sizes, but not only tiny ones: a few bytes at a time through megabytes is slow, not harder.
chunks = st.lists(st.integers(1, 80_000), min_size=1, max_size=30).map(lambda sizes: sizes + [8192])


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.data_too_large])
@given(commands, chunks)
def test_any_commands_in_any_chunks_come_back_exactly(cmds, sizes):
    stream = b"".join(encode_command(*args) for args in cmds)
    assert parse_all(stream, sizes) == cmds


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.lists(st.integers(1, 64), min_size=1, max_size=10))
def test_random_bytes_raise_only_protocol_error(data, sizes):
    try:
        parse_all(data, sizes, max_bulk_len=1 << 20)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([b"*", b"$", b"\r\n", b"\n", b"1", b"0", b"-", b"3", b"PING",
                                 b'"', b"'", b"\\", b" ", b"x"]), max_size=60),
       st.lists(st.integers(1, 16), min_size=1, max_size=10))
def test_resp_like_tokens_raise_only_protocol_error(tokens, sizes):
    try:
        parse_all(b"".join(tokens), sizes, max_bulk_len=1 << 20)
    except ProtocolError:
        pass


# ----------------------------------------------------------------- the batch cut for small commands

PIPELINE = b"".join(encode_command("SET", "key:%d" % i, "v" * 100) for i in range(16))


def test_a_pipelined_batch_of_small_commands_is_cut_in_one_pass(monkeypatch):
    calls = []
    real = RequestReader._begin_command
    monkeypatch.setattr(RequestReader, "_begin_command", lambda self, out: calls.append(1) or real(self, out))
    assert parse_all(PIPELINE) == [[b"SET", b"key:%d" % i, b"v" * 100] for i in range(16)]
    assert len(calls) == 1, "the exact parser only sees the end of the buffer"


@pytest.mark.parametrize("element", [b"+k", b"=5\r\ntxt:k", b"(5", b",1.5", b":5", b"_", b"#t", b"-ERR x",
                                     b"~1\r\n$1\r\nk", b"%1\r\n$1\r\nk\r\n$1\r\nv", b">1\r\n$1\r\nk",
                                     b"*1\r\n$1\r\nk", b"$-1"])
def test_an_element_that_is_not_a_bulk_string_is_answered_as_the_exact_parser_answers(element, monkeypatch):
    stream = PIPELINE + b"*2\r\n$3\r\nGET\r\n" + element + b"\r\n" + PIPELINE
    assert outcome(stream) == outcome(stream, fast=False, monkeypatch=monkeypatch)


def test_a_huge_array_header_is_left_to_the_exact_parser(monkeypatch):
    """A reader that made a list on reading the header would make one of that size."""
    for stream in (PIPELINE + b"*2\r\n$3\r\nGET\r\n*2000000000\r\n", PIPELINE + b"*99999\r\n" + PIPELINE):
        assert outcome(stream) == outcome(stream, fast=False, monkeypatch=monkeypatch)


def outcome(stream: bytes, fast: bool = True, monkeypatch=None, chunk_sizes=(len,)) -> tuple[list, str | None]:
    """The commands parsed from ``stream`` in one piece and the protocol error, if any,
    with or without the batch cut and the lone-command look."""
    if not fast:
        monkeypatch.setattr(RequestReader, "_cut_batch", lambda self, out: None)
        monkeypatch.setattr(RequestReader, "_lone_command", lambda self: None)
    reader, parsed = RequestReader(DEFAULT_MAX_BULK), []
    try:
        feed(reader, stream, chunk_sizes, out=parsed, allocate=Recorder())
        return args_of(parsed), None
    except ProtocolError as exc:
        return args_of(parsed + reader.parsed_before_error), str(exc)
