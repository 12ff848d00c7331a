"""Requests for every command in the command table, as hypothesis strategies.

The grammar knows each command's name, arity, subcommands and key positions
(`kvstore.commands.families.build_table`, the table a node dispatches with), so most
requests get the right shape and reach the handlers; one in six gets a wrong
argument count. Arguments are drawn from what breaks parsers: boundary
integers (0, -1, 2^31, 2^63, beyond 64 bits, "01", "-0", "1.5"), the option
words the commands take (followed by such integers: huge counts, TTLs and
sizes), binary keys (NUL, CRLF, 0xFF, empty, long), values from empty to
1 MiB (past the reader's big-bulk threshold), tensor headers that declare
absurd geometries, and the arena token of the node under test (so fast-path
commands get past their token check and meet huge sizes and stale ids).

Requests that would take the node down on purpose (SHUTDOWN) always carry
ABORT; CLIENT PAUSE pauses for at most 50 ms (a long pause stalls the checks
between batches, as it would in Redis); CONFIG SET names only settings that cannot lock the fuzzer out or
flood the log (not requirepass, buffer limits, maxclients or loglevel); ACL
rules are given only to users of the fuzzer's own (fuzz1, fuzz2), so the
default user keeps working.
"""
from __future__ import annotations

import struct
from functools import cache

from hypothesis import strategies as st

from kvstore.commands.families import build_table
from kvstore.commands.table import Command
from proto import fastpath as fp

COMMANDS = build_table()

INTEGERS = [0, 1, -1, 2, 3, 5, 16, 100, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 10**30]
NOT_INTEGERS = [b"", b"01", b"-0", b"+1", b" 1", b"1.5", b"abc", b"0x10", b"9" * 40]
OPTION_WORDS = [b"NX", b"XX", b"GET", b"EX", b"PX", b"EXAT", b"PXAT", b"KEEPTTL", b"PARENT", b"PIN", b"TIMEOUT",
                b"TOKEN", b"WAIT", b"COUNT", b"MATCH", b"TYPE", b"SAMPLES", b"AUTH", b"SETNAME", b"GT", b"LT",
                b"ABORT", b"NOSAVE", b"NOW", b"FORCE", b"lib-name", b"lib-ver"]
KEYS = [b"k", b"k2", b"block:0", b"block:1", b"{tag}a", b"tenantA:1", b"\x00\r\n\xff", b"", b"x" * 300]
USERS = [b"fuzz1", b"fuzz2", b"fuzz\xff\x00"]
ACL_RULES = [b"on", b"off", b"nopass", b">pw", b"<pw", b"~*", b"~k*", b"%R~block:*", b"allkeys", b"resetkeys",
             b"+@all", b"-@all", b"+get", b"-get", b"+@kvcache", b"-@dangerous", b"+config|get", b"reset",
             b"#" + b"a" * 64, b"bogus", b"&*", b"resetchannels", b"+nosuch", b">\xff\x00pw", b"~\xff*",
             b"%R~\x00*", b"+\xff", b"&\xfe"]
# CONFIG SET may change these: none of them locks the fuzzer out, limits it, or floods the log.
CONFIG_NAMES = [b"maxmemory-policy", b"high-watermark", b"low-watermark", b"promote-hits", b"promote-window-ms",
                b"ssd-write-policy", b"protected-mode", b"dram-size", b"bind", b"save", b"appendonly", b"nosuch",
                b"maxmemory-samples"]
PAUSE_ARGUMENTS = [b"0", b"1", b"50", b"-1", b"", b"1.5", b"abc", b"ALL", b"WRITE", b"all", b"nosuch"]
TOKEN_FIRST = {"kv.lease", "kv.reserve", "kv.leasegpu", "kv.leaselayers", "kv.layerdone"}  # the arena token
BIG_VALUES = [b"v" * 40_000, b"v" * 40_000, b"v" * 40_000, b"w" * (1 << 20)]


@cache
def integers() -> st.SearchStrategy[bytes]:
    return st.one_of(st.sampled_from(INTEGERS).map(lambda n: b"%d" % n), st.sampled_from(NOT_INTEGERS),
                     st.integers(-10**6, 10**6).map(lambda n: b"%d" % n))


@cache
def keys() -> st.SearchStrategy[bytes]:
    return st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS), st.binary(max_size=24))


@cache
def values() -> st.SearchStrategy[bytes]:
    small = st.binary(max_size=64)
    return st.one_of(small, small, small, st.sampled_from(BIG_VALUES))


@cache
def tensor_headers() -> st.SearchStrategy[bytes]:
    """KV.BLOCK headers: the right magic, geometries from empty to absurd."""
    sizes = st.sampled_from([0, 1, 2, 16, 4096, 2**31 - 1, 2**32 - 1])
    bytes_per_layer = st.sampled_from([0, 1, 16, 4096, 2**40, 2**64 - 1])
    shape = st.lists(st.sampled_from([0, 1, 2, 16, -1, 2**62]), min_size=8, max_size=8)
    return st.builds(lambda n, b, dims, ndim, magic: struct.pack(fp.HEADER_FORMAT, magic, n, b, b"float16", ndim,
                                                                 0, *dims).ljust(fp.HEADER_SIZE, b"\0"),
                     sizes, bytes_per_layer, shape, st.sampled_from([0, 1, 2, 8, 9, 2**32 - 1]),
                     st.sampled_from([fp.HEADER_MAGIC, fp.HEADER_MAGIC, b"NOPE"]))


@cache
def arguments(token: bytes) -> st.SearchStrategy[bytes]:
    """Any argument that is not a key: a word, an integer, a value, the arena token, or noise."""
    return st.one_of(st.sampled_from(OPTION_WORDS), integers(), integers(), keys(), values(), tensor_headers(),
                     st.just(token), st.binary(max_size=16))


@cache
def casing(name: str) -> st.SearchStrategy[bytes]:
    return st.sampled_from([name.upper(), name.lower(), name.capitalize()]).map(str.encode)


@cache
def argument_count(arity: int, right_only: bool = False) -> st.SearchStrategy[int]:
    """Mostly a count a command of this arity accepts, one time in six one it does not."""
    least = arity if arity > 0 else -arity
    short = st.integers(least, least + 1)       # most commands take few optional arguments
    right = st.just(least) if arity > 0 else st.one_of(short, short, short, st.integers(least, least + 6))
    accepted = {least} if arity > 0 else set(range(least, least + 3))
    wrong = sorted({1, max(1, least - 1), least + 1, least + 2} - accepted)
    if not wrong or right_only:     # any count from 1 up is right (PING, INFO...)
        return right
    return st.one_of(right, right, right, right, right, st.sampled_from(wrong))


@cache
def entries() -> list[tuple[Command, str | None]]:
    """Every command of the table, and every subcommand of a container, as (command, subcommand)."""
    return [(cmd, sub) for cmd in sorted(COMMANDS.all_commands(), key=lambda c: c.name)
            for sub in ([None] if not cmd.subcommands else sorted(cmd.subcommands))]


def entry_name(args: list[bytes]) -> str:
    """``name`` or ``container|sub`` of a drawn request, as `entries` names it."""
    cmd = COMMANDS.lookup(args[0])
    if cmd is not None and cmd.subcommands and len(args) > 1:
        return f"{cmd.name}|{args[1].lower().decode(errors='replace')}"
    return args[0].lower().decode(errors="replace")


@cache
def _commands() -> st.SearchStrategy[tuple[Command, str | None]]:
    return st.sampled_from(sorted(COMMANDS.all_commands(), key=lambda c: c.name)).map(lambda cmd: (cmd, None))


def key_positions(cmd: Command, argc: int) -> set[int]:
    if cmd.first_key <= 0:
        return set()
    last = cmd.last_key if cmd.last_key >= 0 else argc + cmd.last_key
    return set(range(cmd.first_key, last + 1, cmd.step))


@st.composite
def request(draw, token: bytes = b"", entry: tuple[Command, str | None] | None = None) -> list[bytes]:
    """One request: for ``entry`` (a command and perhaps its subcommand, with an argument
    count it accepts), or for any command."""
    cmd, sub = entry if entry is not None else draw(_commands())
    argc = draw(argument_count(cmd.arity, right_only=entry is not None))
    args = [draw(casing(cmd.name))]
    if sub is not None:
        args.append(sub.encode())
    elif cmd.subcommands and argc > 1:
        known = st.sampled_from(sorted(cmd.subcommands)).map(str.encode)
        args.append(draw(st.one_of(known, known, known, st.sampled_from([b"help", b"nosuch", b""]))))
    if cmd.name in TOKEN_FIRST and argc > 1:
        args.append(draw(st.one_of(st.just(token), st.just(token), st.just(token), arguments(token))))
    special = _special_arguments(cmd, args)
    positions = key_positions(cmd, argc)
    while len(args) < argc:
        if special is not None:
            args.append(draw(special))
        elif len(args) in positions:
            args.append(draw(keys()))
        else:
            args.append(draw(arguments(token)))
    if cmd.name == "shutdown":
        args.append(b"ABORT")           # refused: the node stays up
    return args


def _special_arguments(cmd: Command, args: list[bytes]) -> st.SearchStrategy[bytes] | None:
    """Arguments that must stay in the fuzzer's own sandbox (see the module docstring)."""
    sub = args[1].lower() if len(args) > 1 else b""
    if cmd.name == "acl" and sub in (b"setuser", b"deluser", b"getuser", b"dryrun"):
        return st.one_of(st.sampled_from(USERS), st.sampled_from(ACL_RULES))
    if cmd.name == "config" and sub == b"set":
        return st.one_of(st.sampled_from(CONFIG_NAMES), integers(), st.sampled_from([b"yes", b"no", b"noeviction"]))
    if cmd.name == "client" and sub == b"pause":
        return st.sampled_from(PAUSE_ARGUMENTS)
    if cmd.name in ("auth", "hello"):
        return st.sampled_from([*USERS, b"pw", b"x", b"3", b"2", b"AUTH", b"SETNAME", b"nobody"])
    return None


def batches(token: bytes = b"", most: int = 30) -> st.SearchStrategy[list[list[bytes]]]:
    """Pipelines of 1..``most`` requests of any command, sent in one write."""
    return st.lists(request(token), min_size=1, max_size=most)
