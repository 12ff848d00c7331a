"""Unit tests of the RESP reply encoders (kvstore.net.protocol.writer).

Each expectation is the exact byte string Redis 7 sends for the same reply;
the RESP2 and RESP3 forms differ only for nulls, maps, sets and verbatim text.
"""
from __future__ import annotations

import pytest

from kvstore.net.protocol import writer
from kvstore.net.protocol.writer import Encoder


def test_constants():
    assert (writer.OK, writer.PONG, writer.QUEUED) == (b"+OK\r\n", b"+PONG\r\n", b"+QUEUED\r\n")
    assert (writer.ZERO, writer.ONE, writer.EMPTY_ARRAY) == (b":0\r\n", b":1\r\n", b"*0\r\n")
    assert (writer.NULL_BULK, writer.NULL_ARRAY, writer.NULL3) == (b"$-1\r\n", b"*-1\r\n", b"_\r\n")


def test_simple_and_integer():
    assert writer.simple("OK") == writer.simple(b"OK") == b"+OK\r\n"
    assert writer.integer(0) == b":0\r\n"
    assert writer.integer(-42) == b":-42\r\n"
    assert writer.integer(2**63 - 1) == b":9223372036854775807\r\n"


def test_error_flattens_newlines():
    assert writer.error("unknown command") == b"-ERR unknown command\r\n"
    assert writer.error("command not allowed", "OOM") == b"-OOM command not allowed\r\n"
    assert writer.error("a\r\nb\nc") == b"-ERR a  b c\r\n"
    assert writer.error("caf\u00e9") == "-ERR caf\u00e9\r\n".encode()


@pytest.mark.parametrize("data, encoded", [
    (b"", b"$0\r\n\r\n"),
    (b"hello", b"$5\r\nhello\r\n"),
    ("text", b"$4\r\ntext\r\n"),
    (bytearray(b"a\r\nb"), b"$4\r\na\r\nb\r\n"),
    (b"\x00\xff", b"$2\r\n\x00\xff\r\n"),
])
def test_bulk(data, encoded):
    assert writer.bulk(data) == encoded


def test_bulk_header_and_arrays():
    assert writer.bulk_header(1 << 20) == b"$1048576\r\n"
    assert writer.array([]) == b"*0\r\n"
    assert writer.array([writer.integer(1), writer.bulk(b"x")]) == b"*2\r\n:1\r\n$1\r\nx\r\n"
    assert writer.bulk_array([b"a", None, "b"]) == b"*3\r\n$1\r\na\r\n$-1\r\n$1\r\nb\r\n"
    assert writer.array([writer.array([writer.ONE])]) == b"*1\r\n*1\r\n:1\r\n"


PAIRS = [(writer.bulk(b"hits"), writer.integer(3)), (writer.bulk(b"misses"), writer.integer(0))]
ITEMS = [writer.bulk(b"a"), writer.bulk(b"b")]


def test_resp2_forms():
    enc = Encoder()
    assert enc.protocol == 2
    assert enc.null == b"$-1\r\n"
    assert enc.null_array == b"*-1\r\n"
    assert enc.map(PAIRS) == b"*4\r\n$4\r\nhits\r\n:3\r\n$6\r\nmisses\r\n:0\r\n"
    assert enc.set(ITEMS) == b"*2\r\n$1\r\na\r\n$1\r\nb\r\n"
    assert enc.verbatim("# Server\r\nx:1\r\n") == b"$15\r\n# Server\r\nx:1\r\n\r\n"


def test_resp3_forms():
    enc = Encoder(3)
    assert enc.null == enc.null_array == b"_\r\n"
    assert enc.map(PAIRS) == b"%2\r\n$4\r\nhits\r\n:3\r\n$6\r\nmisses\r\n:0\r\n"
    assert enc.set(ITEMS) == b"~2\r\n$1\r\na\r\n$1\r\nb\r\n"
    assert enc.verbatim("# Server\r\nx:1\r\n") == b"=19\r\ntxt:# Server\r\nx:1\r\n\r\n"
    assert enc.map([]) == b"%0\r\n"


def test_protocol_switch_changes_forms():
    enc = Encoder(2)
    enc.protocol = 3
    assert enc.null == b"_\r\n"
    enc.protocol = 2
    assert enc.map([]) == b"*0\r\n"
