"""Connection and server commands: PING, ECHO, SELECT, HELLO, CLIENT,
TIME, CONFIG, INFO, COMMAND, MEMORY, QUIT, SHUTDOWN.

These are what clients send on connect (redis-py: HELLO, CLIENT SETINFO;
redis-cli: COMMAND DOCS) and what operators use, so their error texts are
Redis 7's, word for word.
"""
from __future__ import annotations

import time

from kvstore.admin import acl, info, live_config
from kvstore.commands.args import SYNTAX, parse_int
from kvstore.commands.client_kill import CLIENT_TYPES, client_kill, client_pause, command_getkeys
from kvstore.commands.glob import matches
from kvstore.commands.table import CommandError, Family
from kvstore.net.protocol import writer

FAMILY = Family()

COMPAT_VERSION = "7.0.0"


@FAMILY.command("PING", -1, "fast loading stale", "connection", "Returns the server's liveliness response.", keys=(0, 0, 0))
def ping(conn, args):
    if len(args) > 2:
        raise CommandError("wrong number of arguments for 'ping' command")
    return writer.PONG if len(args) == 1 else writer.bulk(args[1])


@FAMILY.command("ECHO", 2, "fast loading stale", "connection", "Returns the given string.", keys=(0, 0, 0))
def echo(conn, args):
    return writer.bulk(args[1])


@FAMILY.command("SELECT", 2, "loading stale fast", "connection", "Changes the selected database.", keys=(0, 0, 0))
def select(conn, args):
    db = parse_int(args[1], "value is not an integer or out of range")
    if db != 0:
        raise CommandError("SELECT is not allowed in cluster mode")
    return writer.OK


@FAMILY.command("HELLO", -1, "noscript loading stale fast no-auth", "connection", "Handshakes with the server.",
         keys=(0, 0, 0))
def hello(conn, args):
    protocol = conn.enc.protocol
    if len(args) > 1:
        protocol = parse_int(args[1], "Protocol version is not an integer or out of range")
        if protocol not in (2, 3):
            raise CommandError("unsupported protocol version", "NOPROTO")
    i, name = 2, None
    while i < len(args):
        opt = args[i].upper()
        if opt == b"AUTH" and i + 2 < len(args):
            conn.log_in(acl.login(conn.server.users, args[i + 1], args[i + 2]))
            i += 3
        elif opt == b"SETNAME" and i + 1 < len(args):
            name = args[i + 1]
            i += 2
        else:
            raise CommandError(f"Syntax error in HELLO option '{args[i].decode(errors='replace')}'")
    if not conn.authenticated:
        raise CommandError("HELLO must be called with the client already authenticated, otherwise the "
                           "HELLO AUTH <user> <pass> option can be used to authenticate the client "
                           "and select the RESP protocol version at the same time", "NOAUTH")
    if name is not None:
        conn.client_info.set_name(name)
    conn.enc.protocol = protocol
    b = writer.bulk
    return conn.enc.map([
        (b("server"), b("redis")), (b("version"), b(COMPAT_VERSION)), (b("proto"), writer.integer(protocol)),
        (b("id"), writer.integer(conn.id)), (b("mode"), b("standalone" if conn.server.cluster is None else "cluster")), (b("role"), b("master")),
        (b("modules"), writer.EMPTY_ARRAY)])


@FAMILY.command("CLIENT", -2, "noscript loading stale", "connection", "A container for client connection commands.",
         keys=(0, 0, 0), subcommands={"setname": (3, "Sets the connection name."),
                                      "getname": (2, "Returns the name of the connection."),
                                      "id": (2, "Returns the unique client ID of the connection."),
                                      "list": (-2, "Lists open connections."),
                                      "info": (2, "Returns information about the connection."),
                                      "setinfo": (4, "Sets information specific to the client or connection."),
                                      "kill": (-3, "Terminates open connections."),
                                      "no-evict": (3, "Sets the client eviction mode of the connection."),
                                      "reply": (3, "Instructs the server whether to reply to commands."),
                                      "pause": (-3, "Suspends commands processing."),
                                      "unpause": (2, "Resumes processing commands from paused clients.")})
def client(conn, args):
    sub = args[1].lower()
    if sub in (b"pause", b"unpause"):
        return client_pause(conn, args)
    if sub == b"kill":
        return client_kill(conn, args)
    if sub == b"no-evict":      # kvstore never evicts clients: the mode is accepted, as Redis does
        if args[2].lower() not in (b"on", b"off"):
            raise CommandError(SYNTAX)
        return writer.OK
    if sub == b"setname":
        conn.client_info.set_name(args[2])
        return writer.OK
    if sub == b"getname":
        return conn.enc.null if not conn.client_info.name else writer.bulk(conn.client_info.name)
    if sub == b"id":
        return writer.integer(conn.id)
    if sub == b"list":
        return conn.enc.verbatim("".join(c.describe(args if c is conn else None) + "\n"
                                         for c in _listed(conn, args[2:])))
    if sub == b"info":
        return conn.enc.verbatim(conn.describe(args) + "\n")
    if sub == b"reply":
        return _client_reply(conn, args[2].lower())
    conn.client_info.set_lib_info(args[2], args[3])
    return writer.OK


def _listed(conn, options: list) -> list:
    """The connections CLIENT LIST [TYPE type] [ID id ...] names (all normal clients here)."""
    clients = conn.server.clients
    if not options:
        return list(clients.values())
    opt = options[0].lower()
    if opt == b"type" and len(options) == 2:
        kind = options[1].lower()
        if kind not in CLIENT_TYPES:
            raise CommandError(f"Unknown client type '{options[1].decode(errors='replace')}'")
        return list(clients.values()) if kind == b"normal" else []
    if opt == b"id" and len(options) >= 2:
        ids = [parse_int(value, "Invalid client ID") for value in options[1:]]
        return [clients[i] for i in ids if i in clients]
    raise CommandError(SYNTAX)


def _client_reply(conn, mode: bytes):
    """CLIENT REPLY ON|OFF|SKIP: OFF and SKIP answer nothing themselves (kvstore/commands/dispatch.py mutes)."""
    reply_mode = conn.reply_mode
    if mode == b"on":
        reply_mode.set(off=False, skip=False)
        return writer.OK
    if mode == b"off":
        reply_mode.set(off=True, skip=False)
        return None
    if mode == b"skip":
        if not reply_mode.off:
            reply_mode.set(off=False, skip=True)
        return None
    raise CommandError(SYNTAX)


@FAMILY.command("TIME", 1, "loading stale fast", "server", "Returns the server time.", keys=(0, 0, 0))
def time_(conn, args):
    now = time.time_ns() // 1000
    return writer.bulk_array([str(now // 1_000_000).encode(), str(now % 1_000_000).encode()])


@FAMILY.command("CONFIG", -2, "admin noscript loading stale", "server", "A container for server configuration commands.",
         keys=(0, 0, 0), subcommands={"get": (-3, "Returns the effective values of configuration parameters."),
                                      "set": (-4, "Sets configuration parameters in-flight."),
                                      "resetstat": (2, "Resets the server's statistics.")})
def config(conn, args):
    sub = args[1].lower()
    if sub == b"get":
        return _config_get(conn, args[2:])
    if sub == b"set":
        if len(args) % 2:
            raise CommandError("wrong number of arguments for 'config|set' command")
        return _config_set(conn, args[2:])
    conn.server.reset_stats()
    return writer.OK


def _config_get(conn, patterns: list[bytes]) -> bytes:
    values = live_config.current(conn.server)
    found: dict[bytes, str] = {}
    for pattern in patterns:
        if not any(c in pattern for c in b"*?["):    # a plain name echoes as typed, as Redis 7.0
            value = values.get(pattern.decode(errors="replace").lower())
            if value is not None:
                found.setdefault(pattern, value)
            continue
        for name, value in values.items():
            if name not in live_config.HIDDEN and matches(pattern.lower(), name.encode()):
                found.setdefault(name.encode(), value)
    return conn.enc.map([(writer.bulk(k), writer.bulk(v)) for k, v in found.items()])


def _config_set(conn, pairs: list[bytes]) -> bytes:
    text = [p.decode(errors="replace") for p in pairs]
    try:
        live_config.apply(conn.server, list(zip(text[::2], text[1::2])))
    except live_config.UnknownSetting as e:
        raise CommandError(f"Unknown option or number of arguments for CONFIG SET - '{e.name}'") from None
    except live_config.SettingRefused as e:
        raise CommandError(f"CONFIG SET failed (possibly related to argument '{e.name}') - {e.reason}") from None
    return writer.OK


@FAMILY.command("INFO", -1, "loading stale", "server", "Returns information and statistics about the server.",
         keys=(0, 0, 0))
def info_(conn, args):
    sections = [a.decode(errors="replace").lower() for a in args[1:]]
    return conn.enc.verbatim(info.render(conn.server, sections))


def _command_info(cmd) -> bytes:
    flags = [writer.simple(f) for f in cmd.flags]
    return writer.array([writer.bulk(cmd.name), writer.integer(cmd.arity), writer.array(flags),
                         writer.integer(cmd.first_key), writer.integer(cmd.last_key), writer.integer(cmd.step),
                         writer.array([writer.simple("@" + c) for c in acl.command_categories(cmd)]),
                         writer.EMPTY_ARRAY,
                         writer.EMPTY_ARRAY, writer.EMPTY_ARRAY])


def _command_docs(conn, cmd) -> bytes:
    b = writer.bulk
    fields = [(b("summary"), b(cmd.summary)), (b("since"), b("1.0.0")), (b("group"), b(cmd.group))]
    if cmd.subcommands:
        subs = [(b(f"{cmd.name}|{name}"), conn.enc.map([(b("summary"), b(text)), (b("since"), b("1.0.0")),
                                                          (b("group"), b(cmd.group))]))
                for name, (_, text) in cmd.subcommands.items()]
        fields.append((b("subcommands"), conn.enc.map(subs)))
    return conn.enc.map(fields)


@FAMILY.command("COMMAND", -1, "loading stale", "server", "Returns detailed information about all commands.",
         keys=(0, 0, 0), subcommands={"count": (2, "Returns a count of commands."),
                                      "docs": (-2, "Returns documentary information about one, multiple or all commands."),
                                      "info": (-2, "Returns information about one, multiple or all commands."),
                                      "list": (-2, "Returns a list of command names."),
                                      "getkeys": (-3, "Extracts the key names from an arbitrary command.")})
def command_(conn, args):
    commands = sorted(conn.commands.all_commands(), key=lambda c: c.name)
    if len(args) == 1:
        return writer.array([_command_info(c) for c in commands])
    sub = args[1].lower()
    if sub == b"getkeys":
        return command_getkeys(conn, args)
    if sub == b"count":
        return writer.integer(len(commands))
    if sub == b"list":
        return writer.bulk_array(_command_list(commands, args[2:]))
    wanted = [conn.commands.lookup(a) for a in args[2:]] if len(args) > 2 else commands
    if sub == b"info":
        return writer.array([conn.enc.null if c is None else _command_info(c) for c in wanted])
    return conn.enc.map([(writer.bulk(c.name), _command_docs(conn, c)) for c in wanted if c is not None])


def _command_list(commands: list, options: list) -> list[str]:
    """COMMAND LIST [FILTERBY MODULE name | ACLCAT category | PATTERN pattern]: command and
    subcommand names (``config|get``)."""
    names = [(c, None, c.name) for c in commands]
    names += [(c, sub, f"{c.name}|{sub}") for c in commands for sub in c.subcommands]
    if not options:
        return [n for _, _, n in names]
    if len(options) != 3 or options[0].lower() != b"filterby":
        raise CommandError(SYNTAX)
    kind, value = options[1].lower(), options[2]
    if kind == b"module":
        return []
    if kind == b"aclcat":
        category = value.lower().decode(errors="replace")
        return [n for c, sub, n in names if category in acl.command_categories(c, sub)]
    if kind == b"pattern":
        return [n for _, _, n in names if matches(value.lower(), n.encode())]
    raise CommandError(SYNTAX)


@FAMILY.command("MEMORY", -2, "readonly", "server", "A container for memory diagnostics commands.",
         keys=(0, 0, 0), subcommands={"usage": (-3, "Estimates the memory usage of a key.")})
def memory(conn, args):
    if len(args) not in (3, 5) or (len(args) == 5 and args[3].upper() != b"SAMPLES"):
        raise CommandError(SYNTAX)
    if len(args) == 5:
        parse_int(args[4])
    entry = conn.engine.lookup(args[2])
    if entry is None:
        return conn.enc.null
    return writer.integer(conn.engine.memory_usage(args[2], entry))


@FAMILY.command("QUIT", -1, "noscript loading stale fast no-auth", "connection", "Closes the connection.", keys=(0, 0, 0))
def quit_(conn, args):
    conn.close_after_reply = True
    return writer.OK


@FAMILY.command("SHUTDOWN", -1, "admin noscript loading stale no_multi", "server", "Synchronously saves the database(s) to disk "
         "and shuts down the Redis server.", keys=(0, 0, 0))
def shutdown(conn, args):
    for opt in args[1:]:
        if opt.upper() not in (b"NOSAVE", b"SAVE", b"NOW", b"FORCE", b"ABORT"):
            raise CommandError(SYNTAX)
    if any(a.upper() == b"ABORT" for a in args[1:]):
        raise CommandError("No shutdown in progress.")
    conn.server.request_shutdown(f"SHUTDOWN from client id={conn.id}")
    conn.close_after_reply = True
