"""A short grammar-based fuzz of every command in the command table, against a live
`kvstore serve` (the long run, >= 100,000 commands, is `python -m loadtest.fuzz_commands`).

Hypothesis draws pipelines (loadtest/command_grammar.py: right and wrong
arities, boundary integers, huge counts, binary keys, values up to 1 MiB);
after each one the node must be alive and answer PING, every reply must be
well-formed RESP with one reply per request, none may be an internal error,
and the node's RSS may not grow past a bound. The strict reply checker is
itself checked first, so a pass means something.
"""
from __future__ import annotations

import random

import pytest

from loadtest.command_grammar import entries
from loadtest.fuzz_commands import BadReply, Incomplete, Session, fuzz, reply_end
from kvstore.commands.families import build_table

TABLE = build_table()

COMMANDS = 10_000
SECONDS = 15                    # at most, after the sweep of every command: a loaded machine sends fewer
MAX_RSS_GROWTH = 50 * 2**20


@pytest.mark.parametrize("reply", [
    b"+OK\r\n", b"-ERR no\r\n", b":-12\r\n", b"$3\r\nabc\r\n", b"$-1\r\n", b"*-1\r\n", b"*0\r\n",
    b"*2\r\n$1\r\na\r\n:1\r\n", b"_\r\n", b",1.5\r\n", b",inf\r\n", b"#t\r\n", b"%1\r\n+a\r\n:1\r\n",
    b"~1\r\n+a\r\n", b"=7\r\ntxt:abc\r\n", b"!3\r\nERR\r\n", b"(123\r\n", b"|1\r\n+a\r\n+b\r\n:1\r\n",
])
def test_checker_accepts_well_formed_replies(reply):
    assert reply_end(reply) == len(reply)


@pytest.mark.parametrize("reply", [
    b"-no code\r\n", b":1.5\r\n", b":\r\n", b"$3\r\nabcd\r\n", b"$-2\r\n", b"%-1\r\n", b"#x\r\n", b"_x\r\n",
    b"?\r\n", b"*1\r\n$x\r\n", b",1,5\r\n", b"$01\r\na\r\n" b"\r\n",
])
def test_checker_refuses_malformed_replies(reply):
    with pytest.raises((BadReply, ValueError)):
        if reply_end(reply) != len(reply):
            raise BadReply("trailing bytes")


def test_checker_waits_for_a_whole_reply():
    with pytest.raises(Incomplete):
        reply_end(b"*2\r\n$3\r\nab")


def test_entries_are_every_command_and_subcommand():
    names = {f"{cmd.name}|{sub}" if sub else cmd.name for cmd, sub in entries()}
    assert names == {c.name for c in TABLE.all_commands() if not c.subcommands} | {
        f"{c.name}|{sub}" for c in TABLE.all_commands() for sub in c.subcommands}


def test_node_survives_generated_commands(server):
    alive = lambda: server.proc.poll() is None      # noqa: E731
    session = Session(server.host, server.port, alive)
    rng_seed = random.randrange(2**32)
    start_rss = session.rss()
    try:
        fuzz(session, COMMANDS, rng_seed, seconds=SECONDS)
    except BadReply as exc:
        pytest.fail(f"seed {rng_seed}: {exc}\n--- node log ---\n{server.log()[-4000:]}")
    finally:
        session.close()
    assert alive()
    unsent = {f"{cmd.name}|{sub}" if sub else cmd.name for cmd, sub in entries()} - set(session.tally.sent)
    assert not unsent, f"seed {rng_seed}: never sent {sorted(unsent)}"
    assert session.rss() - start_rss < MAX_RSS_GROWTH, f"seed {rng_seed}"
