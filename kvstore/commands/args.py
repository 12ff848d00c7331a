"""Arguments as Redis reads them, in one place for every command family.

Integers are parsed strictly (Redis's string2ll: no sign on zero, no leading
zeros, 64-bit range); trailing options are ``NAME [value ...]`` words matched
case-insensitively, walked in order so a command can check conflicts (SET's
NX/XX) or act as it goes (HELLO's AUTH) exactly where Redis does; every
failure is a `CommandError` with Redis's words. The fast-path arguments
(lease TTLs, ids, the arena token) and storing a value argument live here
too, because several families take them.
"""
from __future__ import annotations

from typing import Callable, Iterator

from kvstore.commands.table import CommandError
from kvstore.store.arena import Extent
from proto import fastpath as fp

SYNTAX = "syntax error"
WRONG_TYPE_INT = "value is not an integer or out of range"


def parse_int(arg: bytes, message: str = WRONG_TYPE_INT) -> int:
    """An integer argument, strictly as Redis's string2ll reads it."""
    digits = arg[1:] if arg[:1] == b"-" else arg
    if len(digits) <= 19 and digits.isdigit() and (digits[0] != 48 or len(digits) == 1) and arg != b"-0":
        value = int(arg)
        if -2**63 <= value < 2**63:
            return value
    raise CommandError(message)


def options(args: list, start: int, takes: dict[bytes, int],
            error: str | Callable[[bytes], str] = SYNTAX) -> Iterator[tuple[bytes, list]]:
    """Walk ``args[start:]`` as options: yields (NAME in upper case, its values).

    ``takes`` names each option and how many values follow it. An unknown
    option, or one whose values are missing, raises ``error`` (a message, or a
    function of the offending word) when the walk reaches it.
    """
    i = start
    while i < len(args):
        name = args[i].upper()
        count = takes.get(name)
        if count is None or i + count >= len(args):
            raise CommandError(error if isinstance(error, str) else error(args[i]))
        yield name, args[i + 1:i + 1 + count]
        i += 1 + count


def option_map(args: list, start: int, takes: dict[bytes, int]) -> dict[bytes, bytes | None]:
    """Flags and one-value options as a dict: NAME -> its value (None for a flag).

    A repeated option: the last one counts.
    """
    return {name: values[0] if values else None for name, values in options(args, start, takes)}


def parse_ttl_ms(arg: bytes) -> int:
    """A fast-path lease or reservation TTL: 1 ms up to the protocol's maximum."""
    ttl = parse_int(arg, "TTL must be a positive integer of milliseconds")
    if not 0 < ttl <= fp.MAX_TTL_MS:
        raise CommandError(f"TTL must be between 1 and {fp.MAX_TTL_MS} milliseconds")
    return ttl


def parse_ids(args: list) -> list[int]:
    return [parse_int(a, "lease and reservation ids are integers") for a in args]


def check_arena_token(conn, token: bytes) -> None:
    """Refuse offsets to a client whose mapping is not of this node's current arena."""
    if token != conn.server.arena_identity[1]:
        raise CommandError("the client's arena mapping is not this node's arena (map it again)",
                           "STALEARENA")


def store(conn, key: bytes, value, parent: bytes | None = None, keep_ttl: bool = False,
          owner: int | None = None) -> None:
    """Publish a value argument under ``key``, written by tenant ``owner`` (the connection's
    user when None; a node pushing a slot's values names each one's): an `Extent` the reader
    already filled is committed where it lies; a small value (bytes) is copied into the arena."""
    if isinstance(value, Extent):
        if owner is not None:
            value.owner = owner
        conn.engine.commit(key, value, parent, keep_ttl)
    else:
        conn.engine.put(key, value, parent, keep_ttl, conn.user.tenant if owner is None else owner)
