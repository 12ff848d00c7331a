"""The command table: every command's name, arity, flags, key positions and handler.

One table answers three questions: how to dispatch a request (name -> handler,
arity checked before the handler runs, as Redis's processCommand does), what
``COMMAND``/``COMMAND INFO``/``COMMAND DOCS`` report (so redis-cli and
cluster-aware clients see the truth), and which argument positions carry
values (the reader receives those straight into the arena).

Handlers take ``(conn, args)`` and return the encoded reply, or None when they
queued the reply themselves (values sent from the arena).

Each family module declares its commands on a `Family`; the table is built
from the explicit list in commands/families.py, once per server, and handed
to dispatch (``conn.commands``) and to ACL (its `Catalog`). Importing a module
registers nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable


class CommandError(Exception):
    """A command failed: becomes ``-CODE message`` on the wire."""

    def __init__(self, message: str, code: str = "ERR"):
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class Command:
    name: str
    arity: int                      # > 0: exact argc; < 0: at least -arity
    flags: tuple[str, ...]
    handler: Callable
    group: str
    summary: str
    first_key: int = 1
    last_key: int = 1
    step: int = 1
    value_args: Callable[[int], bool] | None = None   # argument index -> carries a value?
    reads: Callable[[object, list], list[bytes]] | None = None  # keys whose values it reads
    subcommands: dict[str, tuple[int, str]] = field(default_factory=dict)   # name -> (arity, summary)
    spans_slots: bool = False       # in a cluster: keys may be in any slots this node serves

    def keys_of(self, args: list) -> list[bytes]:
        """The key arguments, from the legacy key spec (first, last, step) Redis's COMMAND reports;
        a negative last counts from the end."""
        if self.first_key <= 0 or len(args) <= self.first_key:
            return []
        last = self.last_key if self.last_key >= 0 else len(args) + self.last_key
        return args[self.first_key:last + 1:self.step]

    def arity_ok(self, argc: int) -> bool:
        return argc == self.arity if self.arity > 0 else argc >= -self.arity

    def check_subcommand(self, args: list) -> None:
        """Redis 7's checks for container commands (CLIENT, CONFIG, ...)."""
        sub = args[1].lower().decode(errors="replace")
        if sub not in self.subcommands:
            raise CommandError(f"unknown subcommand '{args[1][:128].decode(errors='replace')}'. "
                               f"Try {self.name.upper()} HELP.")
        arity = self.subcommands[sub][0]
        if not (len(args) == arity if arity > 0 else len(args) >= -arity):
            raise CommandError(f"wrong number of arguments for '{self.name}|{sub}' command")


class Family:
    """The commands one module defines (``FAMILY = Family()``, then ``@FAMILY.command(...)``
    on each handler); `CommandTable` is built from a list of families."""

    def __init__(self) -> None:
        self.commands: list[Command] = []

    def command(self, name: str, arity: int, flags: str, group: str, summary: str, *,
                keys: tuple[int, int, int] = (1, 1, 1), values=None, subcommands=None, reads=None,
                spans_slots: bool = False):
        """Declare the decorated function as the handler of ``name``.

        ``values(i)`` says whether argument ``i`` is a value to store (received
        straight into the arena); ``reads(conn, args)`` names the keys whose
        values the command reads (fetched into DRAM first when they live on SSD
        or GPU, so handlers only ever see DRAM). ``spans_slots``: in a cluster the
        command's keys need not share a hash slot, only be served by this node
        (the SDK sends each node the keys of a prefix that live there, unlike
        Redis's multi-key commands, which must stay in one slot).
        """
        def declare(fn: Callable) -> Callable:
            self.commands.append(Command(name.lower(), arity, tuple(flags.split()), fn, group, summary,
                                         *keys, value_args=values, reads=reads,
                                         subcommands=subcommands or {}, spans_slots=spans_slots))
            return fn
        return declare


class CommandTable:
    """Every command of the families it is built from, by name as clients send it
    (upper or lower case; `lookup` also folds mixed case)."""

    def __init__(self, families: Iterable[Family]):
        self.by_name: dict[bytes, Command] = {}
        for family in families:
            for cmd in family.commands:
                self.by_name[cmd.name.upper().encode()] = cmd
                self.by_name[cmd.name.encode()] = cmd

    def lookup(self, name: bytes) -> Command | None:
        cmd = self.by_name.get(name)
        if cmd is None:
            cmd = self.by_name.get(name.upper())
        return cmd

    def all_commands(self) -> list[Command]:
        return list({cmd.name: cmd for cmd in self.by_name.values()}.values())


def first_key(conn, args: list) -> list[bytes]:
    return [args[1]]


def all_keys(conn, args: list) -> list[bytes]:
    return args[1:]
