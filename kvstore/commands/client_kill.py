"""CLIENT KILL, CLIENT PAUSE/UNPAUSE and COMMAND GETKEYS: the parts of CLIENT and COMMAND
with rules of their own.

CLIENT KILL has Redis's two forms: ``CLIENT KILL addr:port`` (OK, or "No such
client") and filters (``ID``, ``TYPE``, ``ADDR``, ``LADDR``, ``USER``,
``SKIPME``), all of which a client must match, answering how many were
closed. Every connection here is a normal client (no replicas, no pub/sub),
so ``TYPE normal`` matches all and the other types none. The caller itself
is closed after its reply, as in Redis. COMMAND GETKEYS answers from the
command table's key positions, so it agrees with what cluster routing and
ACLs check.
"""
from __future__ import annotations

from kvstore.admin import acl

from kvstore.commands.args import SYNTAX, parse_int
from kvstore.commands.table import CommandError
from kvstore.net import client_pause as pauses
from kvstore.net.protocol import writer

CLIENT_TYPES = (b"normal", b"master", b"replica", b"slave", b"pubsub")


def _filters(conn, args: list) -> tuple[list, bool]:
    """The match tests CLIENT KILL's filters ask for, and SKIPME."""
    if len(args) % 2:
        raise CommandError(SYNTAX)
    tests, skip_me = [], True
    for name, value in zip(args[::2], args[1::2]):
        name = name.upper()
        if name == b"ID":
            wanted = parse_int(value, "client-id should be greater than 0")
            if wanted <= 0:
                raise CommandError("client-id should be greater than 0")
            tests.append(lambda c, wanted=wanted: c.id == wanted)
        elif name == b"TYPE":
            if value.lower() not in CLIENT_TYPES:
                raise CommandError(f"Unknown client type '{value.decode(errors='replace')}'")
            is_normal = value.lower() == b"normal"
            tests.append(lambda c, is_normal=is_normal: is_normal)
        elif name in (b"ADDR", b"LADDR"):
            field, text = name.lower().decode(), value.decode(errors="replace")
            tests.append(lambda c, field=field, text=text: getattr(c, field) == text)
        elif name == b"USER":
            user = conn.server.users.get(acl.text(value))
            if user is None:
                raise CommandError(f"No such user '{value.decode(errors='replace')}'")
            tests.append(lambda c, user=user: c.user is user)
        elif name == b"SKIPME" and value.lower() in (b"yes", b"no"):
            skip_me = value.lower() == b"yes"
        else:
            raise CommandError(SYNTAX)
    return tests, skip_me


def _kill(conn, victims: list) -> None:
    for victim in victims:
        if victim is conn:
            conn.close_after_reply = True
        else:
            victim.close()


def client_kill(conn, args: list) -> bytes:
    """CLIENT KILL addr:port, or CLIENT KILL <filter> <value> ..."""
    clients = list(conn.server.clients.values())
    if len(args) == 3:
        text = args[2].decode(errors="replace")
        victims = [c for c in clients if c.addr == text]
        if not victims:
            raise CommandError("No such client")
        _kill(conn, victims[:1])
        return writer.OK
    tests, skip_me = _filters(conn, args[2:])
    victims = [c for c in clients if not (skip_me and c is conn) and all(t(c) for t in tests)]
    _kill(conn, victims)
    return writer.integer(len(victims))


def client_pause(conn, args: list) -> bytes:
    """CLIENT PAUSE timeout [WRITE|ALL] and CLIENT UNPAUSE (kvstore/net/client_pause.py)."""
    if args[1].lower() == b"unpause":
        pauses.unpause(conn.server)
        return writer.OK
    ms = parse_int(args[2], "timeout is not an integer or out of range")
    if ms < 0:
        raise CommandError("timeout is negative")
    if len(args) > 4:
        raise CommandError("unknown subcommand or wrong number of arguments for "
                           f"'{args[1][:128].decode(errors='replace')}'. Try CLIENT HELP.")
    mode = args[3].upper() if len(args) == 4 else b"ALL"
    if mode not in (b"WRITE", b"ALL"):
        raise CommandError("CLIENT PAUSE mode must be WRITE or ALL")
    pauses.pause(conn.server, ms, writes_only=mode == b"WRITE")
    return writer.OK


def command_getkeys(conn, args: list) -> bytes:
    """COMMAND GETKEYS command arg...: the key arguments, as the table locates them."""
    if len(args) < 4:       # as Redis 7.0: a command with no arguments is refused before it is looked up
        raise CommandError("wrong number of arguments for 'command|getkeys' command")
    cmd = conn.commands.lookup(args[2])
    if cmd is None:
        raise CommandError("Invalid command specified")
    target = args[2:]
    if not cmd.arity_ok(len(target)):
        raise CommandError("Invalid number of arguments specified for command")
    keys = cmd.keys_of(target)
    if cmd.name == "memory" and len(target) > 2 and target[1].lower() == b"usage":
        keys = [target[2]]          # MEMORY USAGE key: the key spec of the subcommand
    if not keys:
        raise CommandError("The command has no key arguments")
    return writer.bulk_array(keys)
