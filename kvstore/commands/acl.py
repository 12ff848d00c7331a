"""Users on the wire: AUTH and the ACL container (SETUSER, GETUSER, DELUSER, LIST,
USERS, WHOAMI, CAT, GENPASS, DRYRUN, LOAD, SAVE). A user's quota rules
(``quota-dram=64mb``: kvstore/admin/acl.py) travel in SETUSER and LIST like any
rule; GETUSER adds a ``quotas`` field for a user that has one.

The rules themselves live in `kvstore.admin.acl`; this module turns requests into
calls on the node's user table and replies as Redis 7 replies, error text for
error text. Deleting a user (ACL DELUSER, or ACL LOAD of a file without it)
disconnects the clients logged in as that user, as Redis does: a client must
never keep rights its user no longer has.
"""
from __future__ import annotations

import logging

from kvstore.admin import acl
from kvstore.commands.args import SYNTAX, parse_int
from kvstore.commands.table import CommandError, Family
from kvstore.net.protocol import writer

FAMILY = Family()

log = logging.getLogger("kvstore")

NO_ACL_FILE = ("This Redis instance is not configured to use an ACL file. You may want to specify users via "
               "the ACL SETUSER command and then issue a CONFIG REWRITE (assuming you have a Redis "
               "configuration file set) in order to store users in the Redis configuration.")
SAVE_FAILED = "There was an error trying to save the ACLs. Please check the server logs for more information"
GENPASS_RANGE = ("ACL GENPASS argument must be the number of bits for the output password, a positive number "
                 "up to 4096")


@FAMILY.command("AUTH", -2, "noscript loading stale fast no-auth", "connection", "Authenticates the connection.",
         keys=(0, 0, 0))
def auth(conn, args):
    if len(args) > 3:
        raise CommandError(SYNTAX)
    if len(args) == 2 and conn.server.users.default.nopass:
        raise CommandError("AUTH <password> called without any password configured for the default user. "
                           "Are you sure your configuration is correct?")
    user, password = (b"default", args[1]) if len(args) == 2 else (args[1], args[2])
    conn.log_in(acl.login(conn.server.users, user, password))
    return writer.OK


@FAMILY.command("ACL", -2, "noscript loading stale", "server", "A container for Access List Control commands.",
         keys=(0, 0, 0), subcommands={
             "cat": (-2, "Lists the ACL categories, or the commands inside a category."),
             "deluser": (-3, "Deletes ACL users, and terminates their connections."),
             "dryrun": (-4, "Simulates the execution of a command by a user, without executing the command."),
             "genpass": (-2, "Generates a pseudorandom, secure password that can be used to identify ACL users."),
             "getuser": (3, "Lists the ACL rules of a user."),
             "list": (2, "Dumps the effective rules in ACL file format."),
             "load": (2, "Reloads the rules from the configured ACL file."),
             "save": (2, "Saves the effective ACL rules in the configured ACL file."),
             "setuser": (-3, "Creates and modifies an ACL user and its rules."),
             "users": (2, "Lists all ACL users."),
             "whoami": (2, "Returns the authenticated username of the current connection.")})
def acl_(conn, args):
    return _SUBCOMMANDS[args[1].lower()](conn, args)


def _bulk(value: str) -> bytes:
    """A name, rule or line as the bytes it was given in (binary-safe)."""
    return writer.bulk(acl.raw(value))


def _bulks(values: list[str]) -> bytes:
    return writer.array([_bulk(v) for v in values])


def _setuser(conn, args):
    try:
        conn.server.users.setuser(acl.text(args[2]), [acl.text(a) for a in args[3:]])
    except acl.AclError as exc:
        raise CommandError(str(exc)) from None
    return writer.OK


def _getuser(conn, args):
    user = conn.server.users.get(acl.text(args[2]))
    if user is None:
        return conn.enc.null
    b = _bulk
    fields = [
        (b("flags"), _bulks(user.flags())), (b("passwords"), _bulks(user.passwords)),
        (b("commands"), b(user.describe_commands())), (b("keys"), b(user.describe_keys())),
        (b("channels"), b(user.describe_channels())), (b("selectors"), writer.EMPTY_ARRAY)]
    if user.quotas:         # ours: a user without a quota is shown exactly as Redis shows it
        fields.append((b("quotas"), b(user.describe_quotas())))
    return conn.enc.map(fields)


def _deluser(conn, args):
    try:
        removed = conn.server.users.delete([acl.text(a) for a in args[2:]])
    except acl.AclError as exc:
        raise CommandError(str(exc)) from None
    _disconnect_users(conn, removed)
    return writer.integer(len(removed))


def _disconnect_users(conn, removed: list) -> None:
    """Close the connections logged in as a user that no longer exists: at once when idle,
    after its reply for this one and for one whose command is waiting."""
    for client in list(conn.server.clients.values()):
        if any(client.user is user for user in removed):
            if client is conn or client.waiting is not None:
                client.close_after_reply = True
            else:
                client.close()


def _list(conn, args):
    return _bulks(conn.server.users.describe())


def _users(conn, args):
    return _bulks(conn.server.users.names())


def _whoami(conn, args):
    return _bulk(conn.user.name)


def _cat(conn, args):
    if len(args) > 3:
        raise CommandError("wrong number of arguments for 'acl|cat' command")
    if len(args) == 2:
        return writer.bulk_array(list(acl.CATEGORIES))
    category = acl.text(args[2]).lower()
    names = conn.server.users.catalog.by_category.get(category)
    if names is None:
        raise CommandError(f"Unknown category '{acl.text(args[2])}'")
    return writer.bulk_array(sorted(names))


def _genpass(conn, args):
    if len(args) > 3:
        raise CommandError("wrong number of arguments for 'acl|genpass' command")
    bits = parse_int(args[2]) if len(args) == 3 else 256
    if not 0 < bits <= 4096:
        raise CommandError(GENPASS_RANGE)
    return writer.bulk(acl.generate_password(bits))


def _dryrun(conn, args):
    user = conn.server.users.get(acl.text(args[2]))
    if user is None:
        raise CommandError(f"User '{acl.text(args[2])}' not found")
    cmd = conn.commands.lookup(args[3])
    if cmd is None:
        raise CommandError(f"Command '{acl.text(args[3])}' not found")
    request = args[3:]
    if not cmd.arity_ok(len(request)):
        raise CommandError(f"wrong number of arguments for '{cmd.name}' command")
    denied = acl.denial(user, cmd, request)
    if denied is None:
        return writer.OK
    if denied.command is not None:
        return _bulk(f"This user has no permissions to run the '{denied.command}' command")
    return _bulk(f"This user has no permissions to access the '{acl.text(denied.key)}' key")


def _acl_file(conn) -> str:
    path = conn.server.config.aclfile
    if not path:
        raise CommandError(NO_ACL_FILE)
    return path


def _load(conn, args):
    try:
        removed = conn.server.users.load(_acl_file(conn))
    except acl.AclFileError as exc:
        raise CommandError(str(exc)) from None
    _disconnect_users(conn, removed)
    return writer.OK


def _save(conn, args):
    path = _acl_file(conn)
    try:
        conn.server.users.save(path)
    except OSError as exc:
        log.warning("Saving the ACL file %s failed: %s", path, exc)
        raise CommandError(SAVE_FAILED) from None
    return writer.OK


_SUBCOMMANDS = {b"setuser": _setuser, b"getuser": _getuser, b"deluser": _deluser, b"list": _list,
                b"users": _users, b"whoami": _whoami, b"cat": _cat, b"genpass": _genpass, b"dryrun": _dryrun,
                b"load": _load, b"save": _save}
