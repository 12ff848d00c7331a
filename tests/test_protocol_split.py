"""The reader's batch cut for pipelined small commands (`RequestReader._cut_batch`), and its
look at a buffer that holds exactly one small command (`RequestReader._lone_command`).

It splits a window of the buffer on CRLF and checks every ``$len`` header of
the batch against its argument at once; whatever it takes must be exactly
what the exact parser takes, and whatever it refuses is left to that parser.
What is checked, each time against the exact parser alone on the same bytes:
- headers that are almost canonical (leading zero, sign, spaces, underscores,
  a newline or a ``$`` inside, a length one off) anywhere in a batch;
- a value holding CRLF or a lone LF in the middle of a batch;
- array headers that are not canonical (``*03``, ``*+3``) or past the split's limit;
- a window whose check fails is split once, not once per command behind it;
- a command that opens with a bulk too long for the window is not split at all;
- a lone command, odd or canonical, and one right behind a big bulk's missing CRLF.
"""
from __future__ import annotations

import pytest

from kvstore.net.protocol import reader as reader_module
from kvstore.net.protocol.reader import MAX_SPLIT_ARGS, RequestReader
from test_protocol_reader import PIPELINE, outcome, parse_all
from test_redis_compat import encode_command


@pytest.mark.parametrize("header", [b"$05", b"$+5", b"$ 5", b"$5 ", b"$0_5", b"$4", b"$6", b"$5\n", b"$\n5",
                                    b"$$5", b"$-5", b"5", b"$", b"$5$"])
@pytest.mark.parametrize("where", ["alone", "first", "middle", "last"])
def test_a_header_that_is_not_canonical_is_answered_as_the_exact_parser_answers(header, where, monkeypatch):
    odd = b"*2\r\n$3\r\nGET\r\n" + header + b"\r\nvalue\r\n"
    stream = {"alone": odd, "first": odd + PIPELINE, "middle": PIPELINE + odd + PIPELINE,
              "last": PIPELINE + odd}[where]
    assert outcome(stream) == outcome(stream, fast=False, monkeypatch=monkeypatch)


@pytest.mark.parametrize("head", [b"*03", b"*+3", b"* 3", b"*3 ", b"*%d" % (MAX_SPLIT_ARGS + 1)])
def test_an_array_header_that_is_not_canonical_is_answered_as_the_exact_parser_answers(head, monkeypatch):
    args = [b"x"] * (MAX_SPLIT_ARGS + 1) if head.endswith(b"%d" % (MAX_SPLIT_ARGS + 1)) else [b"SET", b"k", b"v"]
    stream = PIPELINE + head + b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args) + PIPELINE
    assert outcome(stream) == outcome(stream, fast=False, monkeypatch=monkeypatch)


@pytest.mark.parametrize("value", [b"a\r\nb", b"\r\n", b"a\nb", b"\r", b"$3\r\nabc", b"*1\r\n$1\r\nx"])
def test_a_lone_command_holding_line_ends_comes_back_whole(value):
    assert parse_all(encode_command("SET", "k", value)) == [[b"SET", b"k", value]]
    for cut in range(1, len(encode_command("SET", "k", value))):
        assert parse_all(encode_command("SET", "k", value), chunk_sizes=(cut, len)) == [[b"SET", b"k", value]]


@pytest.mark.parametrize("head", [b"*03", b"*+3", b"*3 ", b"*0", b"*-1", b"*4", b"*2"])
def test_a_lone_command_with_an_odd_array_header_is_answered_as_the_exact_parser_answers(head, monkeypatch):
    stream = head + b"\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n"
    assert outcome(stream) == outcome(stream, fast=False, monkeypatch=monkeypatch)


@pytest.mark.parametrize("after", [b"", b"\r\n", b"XX", b"\r"])
def test_a_command_behind_a_big_bulk_is_answered_as_the_exact_parser_answers(after, monkeypatch):
    """The CRLF after a big bulk is skipped whatever it holds: a command sent in its place is
    not read as a lone command."""
    head = encode_command("SET", "k", "v" * 40_000)[:-2] + after
    stream, chunks = head + encode_command("GET", "k"), (len(head), len)
    fast = outcome(stream, chunk_sizes=chunks)
    assert fast == outcome(stream, fast=False, monkeypatch=monkeypatch, chunk_sizes=chunks)
    if after == b"\r\n":
        assert fast[0][-1] == [b"GET", b"k"]


@pytest.mark.parametrize("value", [b"a\r\nb", b"\r\n", b"a\nb", b"\r", b"$3\r\nabc", b"*1\r\n$1\r\nx"])
def test_values_holding_line_ends_come_back_whole(value):
    cmds = [[b"SET", b"k%d" % i, value if i % 5 == 2 else b"v" * i] for i in range(40)]
    assert parse_all(b"".join(encode_command(*c) for c in cmds)) == cmds


def test_a_window_whose_check_fails_is_split_once(monkeypatch):
    splits = []
    real = RequestReader._cut_batch
    monkeypatch.setattr(RequestReader, "_cut_batch", lambda self, out: splits.append(1) or real(self, out))
    cmds = [[b"SET", b"k%d" % i, b"a\r\nb" if i == 0 else b"v"] for i in range(30)]
    assert parse_all(b"".join(encode_command(*c) for c in cmds)) == cmds
    assert len(splits) == 1


def test_a_command_opening_with_a_long_bulk_is_left_to_the_exact_parser(monkeypatch):
    cuts = []
    real = reader_module._mixed_commands
    monkeypatch.setattr(reader_module, "_mixed_commands", lambda parts, out: cuts.append(1) or real(parts, out))
    big = encode_command("SET", "k", "v" * 40_000)
    assert parse_all(big) == [[b"SET", b"k", b"v" * 40_000]]
    assert cuts == [], "no split of the value's bytes"


@pytest.mark.parametrize("stream", [encode_command("SET", "k", "v" * 10_000) + PIPELINE,
                                    PIPELINE + encode_command("SET", "k", "v" * 40_000) + PIPELINE,
                                    encode_command("SET", "$12345", "v") + PIPELINE,
                                    encode_command("SET", "k", "$99999") + PIPELINE])
def test_long_bulks_and_look_alikes_parse_as_the_exact_parser_parses(stream, monkeypatch):
    assert outcome(stream) == outcome(stream, fast=False, monkeypatch=monkeypatch)
