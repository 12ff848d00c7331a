"""Access control as Redis 7 has it: users, passwords, command rules and key patterns.

Why this shape: clients, operators and tools already speak Redis's ACL
language (``ACL SETUSER alice on >pw ~tenantA:* +@kvcache``), so a user here is
what it is in Redis: on or off, a set of SHA-256 password hashes (or
``nopass``), the commands it may run (``+get``, ``-@dangerous``, ``+config|get``)
and the keys it may touch (``~pattern`` for read and write, ``%R~``/``%W~`` for
one of them). The ``default`` user is the one every connection starts as; it
is what ``--requirepass`` configures, exactly as before users existed.

A rule list is applied to a copy of the user and kept only when every rule
parsed, so a bad ``ACL SETUSER`` or ``ACL LOAD`` changes nothing. Command
rules are resolved at once into the set of full command names the user may run
(``get``, ``config|get``): checking a command is one set lookup, and a user
allowed everything (``unrestricted``) skips the check entirely, so the common
case costs dispatch one attribute read.

Keys: a command's keys come from its command table entry (first, last, step),
plus the few keys the table cannot describe (a ``PARENT`` option, ``MEMORY
USAGE key``). Read-only commands need read permission, writing commands need
write permission, and a command that writes and returns the old value needs
both. A key outside the user's patterns is refused before the command runs,
whether the key exists or not, so a refusal reveals nothing about other
tenants' keys. Commands that reach every key at once (KEYS, SCAN, FLUSHALL,
FLUSHDB, KV.HOTKEYS), the fast path's commands (which map the node's whole
arena, or act on lease and reservation ids that belong to nobody's key space),
the commands nodes send each other, and any command that writes without
naming its keys are for users allowed every key; anyone else uses the wire,
key by key.

Quotas (ours, not Redis's): ``quota-dram=64mb`` and ``quota-ssd=1gb`` give a
user a share of the node's DRAM or SSD (``quota-dram=none`` takes it away;
``reset`` too), enforced by the store (kvstore/store/quotas.py). They are ACL
rules rather than a separate map of user to bytes because a quota belongs to
the user it limits: it is set, shown (ACL LIST, GETUSER), saved and loaded
(ACL SAVE, LOAD, the ACL file) and deleted with that user, with no second
table to keep in step with the users. A quota is refused, changing nothing,
when it is not a size, when it or the sum of every user's quota of that tier
exceeds the node's DRAM or SSD, for the ``default`` user (the shared pool),
and in an ACL SETUSER that would create the user (a mistyped name must not
make a new user holding a share).

Not here, on purpose: selectors (``(...)``), pub/sub channels (there is no
pub/sub; ``&pattern`` rules are kept and shown so ACL files round-trip), first
arguments of non-container commands (``+select|0``) and the ACL LOG.
"""
from __future__ import annotations

import copy
import hashlib
import hmac
import ipaddress
import os
import secrets
from dataclasses import dataclass, field
from typing import Callable, Iterable

from kvstore.admin.config import ConfigError, parse_size
from kvstore.commands.glob import compile_pattern
from kvstore.commands.table import Command, CommandError
from kvstore.net.protocol.reader import ProtocolError, split_inline
from kvstore.store.quotas import QUOTA_TIERS, QuotaError, Quotas

READ, WRITE = 1, 2
READ_WRITE = READ | WRITE

# Redis 7's categories, in ACL CAT's order, then ours.
CATEGORIES = ("keyspace", "read", "write", "set", "sortedset", "list", "hash", "string", "bitmap",
              "hyperloglog", "geo", "stream", "pubsub", "admin", "fast", "slow", "blocking", "dangerous",
              "connection", "transaction", "scripting", "kvcache")
# Command table groups that are also categories (every KV.* command is @kvcache, whatever its group).
GROUP_CATEGORIES = {"keyspace": "keyspace", "string": "string", "connection": "connection",
                    "transactions": "transaction"}
_ADMIN = ("admin", "dangerous")
_CLUSTER_ADMIN = ("addslots", "addslotsrange", "bumpepoch", "count-failure-reports", "delslots",
                  "delslotsrange", "failover", "flushslots", "forget", "meet", "replicate", "replicas",
                  "reset", "saveconfig", "set-config-epoch", "setslot", "slaves")
_ACL_ADMIN = ("deluser", "dryrun", "getuser", "list", "load", "save", "setuser", "users")
_BETWEEN_NODES = ("kv.copy", "kv.uncopy", "kv.renew", "kv.import", "kv.migrated", "kv.drain")
# Categories Redis gives a command (or a subcommand) beyond those its flags imply.
EXTRA_CATEGORIES: dict[str, tuple[str, ...]] = {
    "dbsize": ("keyspace",), "flushdb": ("keyspace", "dangerous"), "flushall": ("keyspace", "dangerous"),
    "keys": ("dangerous",), "info": ("dangerous",), "command": ("connection",),
    "readonly": ("connection",), "readwrite": ("connection",), "asking": ("connection",),
    "client|list": _ADMIN, "client|kill": _ADMIN, "client|no-evict": _ADMIN, "client|pause": _ADMIN,
    "client|unpause": _ADMIN,
    **{f"object|{sub}": ("read",) for sub in ("encoding", "freq", "idletime", "refcount")},
    **{f"latency|{sub}": _ADMIN for sub in ("doctor", "graph", "history", "latest", "reset")},
    **{f"slowlog|{sub}": _ADMIN for sub in ("get", "len", "reset")},
    **{f"cluster|{sub}": _ADMIN for sub in _CLUSTER_ADMIN},
    **{f"acl|{sub}": _ADMIN for sub in _ACL_ADMIN},
    **{name: _ADMIN for name in _BETWEEN_NODES},
}
# Commands that reach every key at once, the whole arena, or keys their table entry does not
# locate: only for users allowed every key (so is any command that writes without naming its keys).
WHOLE_KEYSPACE = frozenset({"keys", "scan", "randomkey", "flushdb", "flushall", "kv.arena", "kv.gpuarena", "kv.lease",
                            "kv.leasegpu", "kv.leaselayers", "kv.layerdone", "kv.release", "kv.reserve",
                            "kv.publish", "kv.mpublish", "kv.unreserve", "kv.hotkeys", *_BETWEEN_NODES})
# Commands that write a key and return its old value, or move a value from one key to another:
# they need read and write permission on every key they name.
READS_AND_WRITES = frozenset({"getdel", "copy", "rename", "renamenx"})
# Keys the command table cannot locate: in options, or after a subcommand.
OPTION_KEYS = {"kv.put": 3, "kv.block": 3, "kv.publish": 3}        # PARENT <key> from this index on
OPTION_VALUES = {b"PARENT": 1, b"TIMEOUT": 1, b"TOKEN": 1}
SUBCOMMAND_KEYS = {"memory|usage": 2}        # the one key, after the subcommand

NOPERM_COMMAND = "this user has no permissions to run the '{}' command"
NOPERM_KEY = "this user has no permissions to access one of the keys used as arguments"
UNKNOWN_RULE = "Unknown command or category name in ACL"
ADD_AFTER_ALLKEYS = ("Adding a pattern after the * pattern (or the 'allkeys' flag) is not valid and does not "
                     "have any effect. Try 'resetkeys' to start with an empty list of patterns")
BAD_HASH = "The password hash must be exactly 64 characters and contain only lowercase hexadecimal characters"
NO_SUCH_PASSWORD = "The password you are trying to remove from the user does not exist"
SYNTAX = "Syntax error"
QUOTA_RULE = "quota-"
BAD_QUOTA = "a quota is a size in bytes (such as 1048576, 64mb or 4gb) or 'none'"
UNKNOWN_QUOTA = "unknown quota (quota-dram or quota-ssd)"


def raw(text: str) -> bytes:
    """The bytes a rule or name arrived as (they are decoded with surrogateescape: binary-safe)."""
    return text.encode(errors="surrogateescape")


def text(data: bytes) -> str:
    return data.decode(errors="surrogateescape")


def printable(name: str) -> str:
    """A name for text output (CLIENT LIST, logs): bytes that are not UTF-8 shown as U+FFFD."""
    return raw(name).decode(errors="replace")


class AclError(ValueError):
    """A rule that cannot be applied; the message is Redis's reason."""


class RuleError(AclError):
    """ACL SETUSER's error: the offending rule and Redis's reason for refusing it."""

    def __init__(self, rule: str, reason: str):
        super().__init__(f"Error in ACL SETUSER modifier '{rule}': {reason}")
        self.rule, self.reason = rule, reason


# ------------------------------------------------------------------ the catalog


@dataclass(frozen=True)
class Catalog:
    """Every full command name and the categories each belongs to."""

    names: frozenset[str]
    by_category: dict[str, frozenset[str]]
    subcommands: dict[str, frozenset[str]]      # container -> its full subcommand names

    @classmethod
    def of(cls, commands: Iterable[Command]) -> Catalog:
        """The catalog of a command table's commands (`CommandTable.all_commands`)."""
        names, by_category, subs = set(), {c: set() for c in CATEGORIES}, {}
        for cmd in commands:
            entries = [(cmd.name, None)] + [(f"{cmd.name}|{s}", s) for s in cmd.subcommands]
            subs[cmd.name] = frozenset(full for full, _ in entries[1:])
            for full, sub in entries:
                names.add(full)
                for cat in command_categories(cmd, sub):
                    by_category[cat].add(full)
        return cls(frozenset(names), {c: frozenset(v) for c, v in by_category.items()}, subs)


def command_categories(cmd: Command, sub: str | None = None) -> list[str]:
    """The ACL categories of a command or of one of its subcommands, as Redis lists them.

    Flags imply @write, @read, @admin/@dangerous and @fast or @slow; the group adds
    its category (@string, @kvcache...); a few commands carry extra ones. A container
    itself is only @slow (plus its extras): its subcommands carry the rest.
    """
    name = cmd.name if sub is None else f"{cmd.name}|{sub}"
    if cmd.subcommands and sub is None:
        cats = ["slow"]
    else:
        cats = [c for flag, c in (("write", "write"), ("readonly", "read")) if flag in cmd.flags]
        if "admin" in cmd.flags:
            cats += _ADMIN
        cats.append("fast" if "fast" in cmd.flags else "slow")
        if cmd.group in GROUP_CATEGORIES:
            cats.append(GROUP_CATEGORIES[cmd.group])
        if cmd.name.startswith("kv."):
            cats.append("kvcache")
    for extra in EXTRA_CATEGORIES.get(cmd.name, ()) + (EXTRA_CATEGORIES.get(name, ()) if sub else ()):
        if extra not in cats:
            cats.append(extra)
    return sorted(cats, key=CATEGORIES.index)


def full_name(cmd: Command, args: list) -> str:
    """``config|get`` for a container's subcommand, else the command's name."""
    if cmd.subcommands and len(args) > 1:
        return f"{cmd.name}|{args[1].lower().decode(errors='replace')}"
    return cmd.name


# ------------------------------------------------------------------ key patterns


@dataclass
class KeyPattern:
    """``~pattern`` (read and write), ``%R~pattern`` or ``%W~pattern``."""

    pattern: bytes
    perms: int

    def __post_init__(self) -> None:
        body = self.pattern[:-1]
        plain_prefix = self.pattern.endswith(b"*") and not any(c in body for c in b"*?[\\")
        self._prefix = body if plain_prefix else None

    def matches(self, key: bytes) -> bool:
        if self._prefix is not None:              # the usual tenant pattern: a literal prefix
            return key.startswith(self._prefix)
        return compile_pattern(self.pattern).fullmatch(key) is not None

    def describe(self) -> str:
        flags = {READ_WRITE: "", READ: "%R", WRITE: "%W"}[self.perms]
        return f"{flags}~{text(self.pattern)}"


def _parse_key_rule(op: str) -> KeyPattern:
    """``~p``, ``%R~p``, ``%W~p``, ``%RW~p`` (flags in either case and order)."""
    if op.startswith("~"):
        return KeyPattern(raw(op[1:]), READ_WRITE)
    flags, sep, pattern = op[1:].partition("~")
    perms = 0
    for flag in flags.upper():
        if flag not in "RW":
            raise AclError(SYNTAX)
        perms |= READ if flag == "R" else WRITE
    if not sep or not perms:
        raise AclError(SYNTAX)
    return KeyPattern(raw(pattern), perms)


# ------------------------------------------------------------------ users


@dataclass(eq=False)
class User:
    """One ACL user; connections hold a reference, so rule changes apply to them at once."""

    name: str
    enabled: bool = False
    nopass: bool = False
    passwords: list[str] = field(default_factory=list)         # SHA-256 hex digests
    payload_flag: str | None = None                            # "sanitize-payload" or "skip-..."
    all_commands: bool = False                                 # the base rule: +@all or -@all
    command_rules: list[str] = field(default_factory=list)     # rules since the base, in order
    allowed: set[str] = field(default_factory=set)             # full command names it may run
    all_keys: bool = False
    patterns: list[KeyPattern] = field(default_factory=list)
    all_channels: bool = False
    channels: list[str] = field(default_factory=list)
    unrestricted: bool = False                                 # every command and every key
    quotas: dict[str, int] = field(default_factory=dict)       # "dram"/"ssd" -> bytes
    tenant: int = 0                                            # its id in the store's quotas (0: shared)

    def apply(self, rules: list[str], catalog: Catalog, check: Callable[[User], None] | None = None) -> None:
        """Apply ``rules`` in order, all or none: Redis's error for the first bad one;
        ``catalog`` resolves command rules into command names; ``check(draft)`` may still
        refuse the result (raising RuleError) before it is kept."""
        draft = copy.deepcopy(self)
        for rule in rules:
            try:
                draft._apply_one(rule, catalog)
            except AclError as exc:
                raise RuleError(rule, str(exc)) from None
        if check is not None:
            check(draft)
        self.__dict__.update(draft.__dict__)

    def _apply_one(self, op: str, catalog: Catalog) -> None:
        if not op:
            raise AclError(SYNTAX)
        lowered = op.lower()
        simple = _SIMPLE_RULES.get(lowered)
        if simple is not None:
            simple(self, catalog)
        elif op[0] in "><#!":
            self._password_rule(op)
        elif op[0] in "~%":
            self._add_pattern(_parse_key_rule(op))
        elif op == "&*":
            _SIMPLE_RULES["allchannels"](self, catalog)
        elif op[0] == "&":
            if not self.all_channels and op[1:] not in self.channels:
                self.channels.append(op[1:])
        elif op[0] in "+-" and len(op) > 1:
            self._command_rule(lowered[1:], op[0] == "+", catalog)
        elif lowered.startswith(QUOTA_RULE):
            self._quota_rule(lowered)
        else:
            raise AclError(SYNTAX)
        self.unrestricted = self.all_keys and self.allowed == catalog.names

    # -- passwords

    def _password_rule(self, op: str) -> None:
        kind, given = op[0], op[1:]
        digest = hashlib.sha256(raw(given)).hexdigest() if kind in "><" else given
        if kind in "#!" and (len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)):
            raise AclError(BAD_HASH)
        if kind in ">#":
            self.nopass = False
            if digest not in self.passwords:
                self.passwords.append(digest)
        elif digest in self.passwords:
            self.passwords.remove(digest)
        else:
            raise AclError(NO_SUCH_PASSWORD)

    def check_password(self, password: bytes) -> bool:
        """Whether this user may log in with ``password`` (any, when it is nopass)."""
        if not self.enabled:
            return False
        if self.nopass:
            return True
        digest = hashlib.sha256(password).hexdigest()
        return any(hmac.compare_digest(digest, stored) for stored in self.passwords)

    # -- keys

    def _add_pattern(self, added: KeyPattern) -> None:
        if self.all_keys:
            raise AclError(ADD_AFTER_ALLKEYS)
        if added.pattern == b"*" and added.perms == READ_WRITE:
            self.all_keys, self.patterns = True, []
            return
        for existing in self.patterns:
            if existing.pattern == added.pattern:
                existing.perms |= added.perms
                return
        self.patterns.append(added)

    def may_access(self, key: bytes, need: int) -> bool:
        """Whether one pattern grants every permission in ``need`` on ``key``."""
        if self.all_keys:
            return True
        return any(p.perms & need == need and p.matches(key) for p in self.patterns)

    # -- commands

    def _command_rule(self, target: str, allow: bool, catalog: Catalog) -> None:
        names = _names_of(target, catalog)
        if target == "@all":
            self.all_commands, self.command_rules = allow, []
            self.allowed = set(names) if allow else set()
            return
        if allow:
            self.allowed |= names
        else:
            self.allowed -= names
        self.command_rules = [r for r in self.command_rules if r[1:] != target]
        self.command_rules.append(("+" if allow else "-") + target)

    def may_run(self, name: str) -> bool:
        return name in self.allowed

    # -- quotas

    def _quota_rule(self, op: str) -> None:
        """``quota-<tier>=<size>`` or ``quota-<tier>=none``."""
        tier, sep, value = op[len(QUOTA_RULE):].partition("=")
        if tier not in QUOTA_TIERS or not sep:
            raise AclError(UNKNOWN_QUOTA if tier not in QUOTA_TIERS else BAD_QUOTA)
        if value == "none":
            self.quotas.pop(tier, None)
            return
        try:
            self.quotas[tier] = parse_size(value)
        except ConfigError:
            raise AclError(BAD_QUOTA) from None

    def describe_quotas(self) -> str:
        return " ".join(f"{QUOTA_RULE}{tier}={_size_text(size)}" for tier, size in sorted(self.quotas.items()))

    # -- how Redis shows a user

    def flags(self) -> list[str]:
        flags = ["on" if self.enabled else "off"]
        if self.nopass:
            flags.append("nopass")
        if self.payload_flag:
            flags.append(self.payload_flag)
        return flags

    def describe_commands(self) -> str:
        return " ".join(["+@all" if self.all_commands else "-@all", *self.command_rules])

    def describe_keys(self) -> str:
        return "~*" if self.all_keys else " ".join(p.describe() for p in self.patterns)

    def describe_channels(self) -> str:
        return "&*" if self.all_channels else " ".join(f"&{c}" for c in self.channels)

    def describe(self) -> str:
        """The ACL LIST line (also the ACL file's line for this user)."""
        parts = ["user", self.name, *self.flags(), *(f"#{h}" for h in self.passwords)]
        if self.describe_keys():
            parts.append(self.describe_keys())
        parts.append("&*" if self.all_channels else "resetchannels")
        if not self.all_channels:
            parts += [f"&{c}" for c in self.channels]
        parts.append(self.describe_commands())
        if self.quotas:
            parts.append(self.describe_quotas())
        return " ".join(parts)


def _size_text(size: int) -> str:
    """A quota as the largest unit that divides it exactly (``64mb``), for ACL LIST and files."""
    for unit, factor in (("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10)):
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def _names_of(target: str, cat: Catalog) -> frozenset[str]:
    """The full command names a rule target covers: ``@cat``, ``cmd`` (with its
    subcommands) or ``cmd|sub``."""
    if target.startswith("@"):
        if target == "@all":
            return cat.names
        if target[1:] not in cat.by_category:
            raise AclError(UNKNOWN_RULE)
        return cat.by_category[target[1:]]
    if target not in cat.names:
        raise AclError(UNKNOWN_RULE)
    return frozenset({target}) | cat.subcommands.get(target, frozenset())


def _reset_keys(user: User, catalog: Catalog) -> None:
    user.all_keys, user.patterns = False, []


def _reset_pass(user: User, catalog: Catalog) -> None:
    user.nopass, user.passwords = False, []


def _reset_channels(user: User, catalog: Catalog) -> None:
    user.all_channels, user.channels = False, []


def _reset(user: User, catalog: Catalog) -> None:
    _reset_pass(user, catalog)
    _reset_keys(user, catalog)
    _reset_channels(user, catalog)
    user.enabled = False
    user.quotas = {}
    user.payload_flag = "sanitize-payload"
    user._command_rule("@all", False, catalog)


def _set(**values):
    """A rule that sets fields (a fresh copy of each list for each user)."""
    def rule(user: User, catalog: Catalog) -> None:
        user.__dict__.update({name: copy.copy(value) for name, value in values.items()})
    return rule


# Rules without an argument: fn(user, catalog); the catalog resolves the command rules among them.
_SIMPLE_RULES = {
    "on": _set(enabled=True), "off": _set(enabled=False),
    "nopass": _set(nopass=True, passwords=[]), "resetpass": _reset_pass,
    "allkeys": lambda u, _: u._add_pattern(KeyPattern(b"*", READ_WRITE)), "resetkeys": _reset_keys,
    "allchannels": _set(all_channels=True, channels=[]), "resetchannels": _reset_channels,
    "allcommands": lambda u, catalog: u._command_rule("@all", True, catalog),
    "nocommands": lambda u, catalog: u._command_rule("@all", False, catalog),
    "sanitize-payload": _set(payload_flag="sanitize-payload"),
    "skip-sanitize-payload": _set(payload_flag="skip-sanitize-payload"),
    "clearselectors": lambda u, _: None, "reset": _reset,
}


# ------------------------------------------------------------------ checking a command


@dataclass(frozen=True)
class Denial:
    """Why a user may not run a command: the command itself, or one of its keys."""

    command: str | None = None
    key: bytes | None = None

    def error(self) -> CommandError:
        if self.command is not None:
            return CommandError(NOPERM_COMMAND.format(self.command), "NOPERM")
        return CommandError(NOPERM_KEY, "NOPERM")


def check_command(user: User, cmd: Command, args: list) -> None:
    """Raise Redis's NOPERM error when ``user`` may not run this request."""
    denied = denial(user, cmd, args)
    if denied is not None:
        raise denied.error()


def denial(user: User, cmd: Command, args: list) -> Denial | None:
    """What refuses this request to ``user``, or None when it may run."""
    if user.unrestricted or "no-auth" in cmd.flags:
        return None            # AUTH, HELLO and QUIT stay open to everyone, as in Redis
    name = full_name(cmd, args)
    if not user.may_run(name):
        return Denial(command=name)
    if user.all_keys:
        return None
    if cmd.name in WHOLE_KEYSPACE or ("write" in cmd.flags and cmd.first_key <= 0):
        return Denial(key=b"*")
    need = READ_WRITE if cmd.name in READS_AND_WRITES or _set_with_get(cmd, args) else \
        WRITE if "write" in cmd.flags else READ
    for key in command_keys(cmd, args, name):
        if not user.may_access(key, need):
            return Denial(key=key)
    return None


def _set_with_get(cmd: Command, args: list) -> bool:
    return cmd.name == "set" and any(a.upper() == b"GET" for a in args[3:])


def command_keys(cmd: Command, args: list, name: str | None = None) -> list[bytes]:
    """The key arguments of a request: the table's positions, then those it cannot describe."""
    position = SUBCOMMAND_KEYS.get(name or full_name(cmd, args))
    keys = cmd.keys_of(args) if position is None else args[position:position + 1]
    start = OPTION_KEYS.get(cmd.name)
    if start is not None:
        keys = keys + _parent_keys(args, start)
    return keys


def _parent_keys(args: list, start: int) -> list[bytes]:
    """Keys named by ``PARENT key`` among trailing options."""
    keys, i = [], start
    while i < len(args):
        word = args[i].upper() if isinstance(args[i], bytes) else b""
        if word == b"PARENT" and i + 1 < len(args):
            keys.append(args[i + 1])
        i += 1 + OPTION_VALUES.get(word, 0)
    return keys


# ------------------------------------------------------------------ the user table


class Users:
    """Every user of a node, by name; ``default`` always exists. ``catalog`` is the node's
    command table as ACL rules name it (`Catalog.of`); ``quotas`` the store's tenant quotas
    that the users' quota rules set (without it they are kept and shown, not enforced)."""

    def __init__(self, catalog: Catalog, requirepass: str | None = None, quotas: Quotas | None = None):
        self.catalog = catalog
        self.requirepass = requirepass
        self.quotas = quotas
        self.by_name: dict[str, User] = {"default": self._fresh_default()}

    @property
    def default(self) -> User:
        return self.by_name["default"]

    def _fresh_default(self) -> User:
        user = User("default")
        user.apply(["on", "allkeys", "allchannels", "allcommands",
                    *(["nopass"] if self.requirepass is None else [f">{self.requirepass}"])], self.catalog)
        return user

    def use_requirepass(self, password: str | None) -> None:
        """CONFIG SET requirepass: the default user's password, as Redis sets it."""
        self.requirepass = password
        self.default.apply(["resetpass", "nopass" if password is None else f">{password}"], self.catalog)

    def get(self, name: str) -> User | None:
        return self.by_name.get(name)

    def setuser(self, name: str, rules: list[str]) -> User:
        """ACL SETUSER: create the user if new, then apply the rules (all or none)."""
        if any(c.isspace() or c == "\0" for c in name):
            raise AclError("Usernames can't contain spaces or null characters")
        user = self.by_name.get(name)
        quota_rules = [rule for rule in rules if rule.lower().startswith(QUOTA_RULE)]
        if quota_rules and user is None:
            raise RuleError(quota_rules[0], f"no user '{name}' to give a quota to (create the user first)")
        user = user or User(name)
        user.apply(rules, self.catalog, self._quota_check(quota_rules[-1]) if quota_rules else None)
        self.by_name.setdefault(name, user)
        self._sync_quotas()         # a quota rule, or ``reset``, may have changed its quotas
        return user

    def _quota_check(self, rule: str) -> Callable[[User], None]:
        """The check of ACL SETUSER's result: its quotas, with everyone else's, must fit the node
        (an error names ``rule``, the last quota rule given)."""
        def check(draft: User) -> None:
            try:
                self._check_quotas({**self.by_name, draft.name: draft})
            except QuotaError as exc:
                raise RuleError(rule, str(exc)) from None
        return check

    def _check_quotas(self, users: dict[str, User]) -> None:
        default = users.get("default")
        if default is not None and default.quotas:
            raise QuotaError("the default user writes to the shared pool and takes no quota")
        if self.quotas is not None:
            self.quotas.check(_quota_map(users))

    def _sync_quotas(self) -> None:
        """Hand the users' quotas to the store; each user learns its tenant id."""
        if self.quotas is None:
            return
        self.quotas.apply(_quota_map(self.by_name))
        for user in self.by_name.values():
            user.tenant = self.quotas.tenant(user.name)

    def delete(self, names: list[str]) -> list[User]:
        """ACL DELUSER: the users removed (their connections must go; their quotas end, their
        values stay)."""
        if "default" in names:
            raise AclError("The 'default' user cannot be removed")
        removed = [self.by_name.pop(name) for name in dict.fromkeys(names) if name in self.by_name]
        self._sync_quotas()
        return removed

    def authenticate(self, name: str, password: bytes) -> User | None:
        user = self.by_name.get(name)
        return user if user is not None and user.check_password(password) else None

    def names(self) -> list[str]:
        return sorted(self.by_name)

    def describe(self) -> list[str]:
        return [self.by_name[name].describe() for name in self.names()]

    # -- the ACL file

    def load(self, path: str) -> list[User]:
        """ACL LOAD: replace every user with the file's, or change nothing.

        Users that exist before and after keep their identity (their connections
        see the new rules); the users returned are gone. A file that does not
        name ``default`` leaves it as ``--requirepass`` makes it.
        """
        loaded = parse_acl_file(path, self.catalog)
        loaded.setdefault("default", self._fresh_default())
        try:
            self._check_quotas(loaded)
        except QuotaError as exc:
            raise AclFileError(f"Error in quotas: {exc}. WARNING: ACL errors detected, no change to the "
                               "previously active ACL rules was performed") from None
        removed = [user for name, user in self.by_name.items() if name not in loaded]
        for name, user in loaded.items():
            if name in self.by_name:
                self.by_name[name].__dict__.update(user.__dict__)
            else:
                self.by_name[name] = user
        for user in removed:
            del self.by_name[user.name]
        self._sync_quotas()
        return removed

    def save(self, path: str) -> None:
        """ACL SAVE: every user's line, written whole (a temporary file, then a rename)."""
        temp = f"{path}.tmp-{os.getpid()}"
        with open(temp, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write("".join(line + "\n" for line in self.describe()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)


def _quota_map(users: dict[str, User]) -> dict[str, dict[int, int]]:
    """Name -> tier -> bytes, for every user with a quota (as `Quotas` takes them)."""
    return {name: {QUOTA_TIERS[word]: size for word, size in user.quotas.items()}
            for name, user in users.items() if user.quotas}


class AclFileError(Exception):
    """An ACL file that cannot be loaded: Redis's text, every problem listed."""


def parse_acl_file(path: str, catalog: Catalog) -> dict[str, User]:
    """The users an ACL file defines; AclFileError lists every problem found."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().split("\n")
    except OSError as exc:
        raise AclFileError(f"Error loading ACLs, opening file '{path}': {exc.strerror}") from None
    users: dict[str, User] = {}
    errors = []
    for number, line in enumerate(lines, 1):
        line = line.strip(" \t\r\n")
        if not line:
            continue
        try:
            words = [text(w) for w in split_inline(raw(line))]
        except ProtocolError:
            errors.append(f"{path}:{number}: Syntax error. ")
            continue
        if len(words) < 2 or words[0] != "user":
            errors.append(f"{path}:{number} should start with user keyword followed by the username. ")
            continue
        name = words[1]
        if any(c.isspace() or c == "\0" for c in name):
            errors.append(f"{path}:{number}: username '{name}' contains invalid characters. ")
            continue
        if name in users:
            errors.append(f"WARNING: Duplicate user '{name}' found on line {number}. ")
            continue
        user = User(name)
        for rule in words[2:]:
            try:
                user.apply([rule], catalog)
            except RuleError as exc:
                errors.append(f"{path}:{number}: {exc.reason}. " if exc.reason == SYNTAX else
                              f"{path}:{number}: Error in applying operation '{rule}': {exc.reason}. ")
        users[name] = user
    if errors:
        raise AclFileError("".join(errors) + "WARNING: ACL errors detected, no change to the previously "
                           "active ACL rules was performed")
    return users


def login(users: Users, name: bytes, password: bytes) -> User:
    """The user ``AUTH name password`` logs in as, or Redis's WRONGPASS error."""
    user = users.authenticate(text(name), password)
    if user is None:
        raise CommandError("invalid username-password pair or user is disabled.", "WRONGPASS")
    return user


# Redis's own words (and name): clients and operators search for this text.
DENIED = (b"-DENIED Redis is running in protected mode because protected mode is enabled and no password is "
          b"set for the default user. In this mode connections are only accepted from the loopback interface. "
          b"If you want to connect from external computers to Redis you may adopt one of the following "
          b"solutions: 1) Just disable protected mode sending the command 'CONFIG SET protected-mode no' from "
          b"the loopback interface by connecting to Redis from the same host the server is running, however "
          b"MAKE SURE Redis is not publicly accessible from internet if you do so. Use CONFIG REWRITE to make "
          b"this change permanent. 2) Alternatively you can just disable the protected mode by editing the "
          b"Redis configuration file, and setting the protected mode option to 'no', and then restarting the "
          b"server. 3) If you started the server manually just for testing, restart it with the "
          b"'--protected-mode no' option. 4) Setup a an authentication password for the default user. NOTE: "
          b"You only need to do one of the above things in order for the server to start accepting "
          b"connections from the outside.\r\n")


def protected_mode_refuses(default: User, peer_host: str | None) -> bool:
    """Protected mode's rule, as Redis's: while the default user needs no password,
    only clients on this host (``peer_host`` None for the Unix socket, or a
    loopback address) may connect.

    Users with passwords do not lift it: a remote client that never
    authenticates would still be the password-less default user.
    """
    return default.nopass and not is_local(peer_host)


def is_local(peer_host: str | None) -> bool:
    """The Unix socket (None), or a loopback address (IPv4-mapped ones included)."""
    if peer_host is None:
        return True
    address = ipaddress.ip_address(peer_host.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def generate_password(bits: int = 256) -> str:
    """ACL GENPASS: ``bits`` of randomness as hex (rounded up to whole hex digits)."""
    return secrets.token_hex((bits + 7) // 8)[:(bits + 3) // 4]
