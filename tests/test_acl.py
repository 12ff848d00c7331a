"""kvstore/admin/acl.py alone: rules, how users are shown, permission checks, the ACL file
(protected mode's decision is in test_protected_mode.py). The expected lines and error texts were read from
redis-server 7.0 (the wire suite, test_acl_commands.py, compares with a live one)."""
from __future__ import annotations

import hashlib

import pytest

from kvstore.admin import acl
from kvstore.commands.families import build_table
from kvstore.commands.table import CommandError

COMMANDS = build_table()
CATALOG = acl.Catalog.of(COMMANDS.all_commands())

PW_HASH = hashlib.sha256(b"pw").hexdigest()


def user(*rules: str) -> acl.User:
    return acl.Users(CATALOG).setuser("u", list(rules))


def denial(u: acl.User, *request) -> acl.Denial | None:
    args = [a if isinstance(a, bytes) else str(a).encode() for a in request]
    return acl.denial(u, COMMANDS.lookup(args[0]), args)


# ------------------------------------------------------------------ rules and their description

@pytest.mark.parametrize("rules, line", [
    ((), "user u off resetchannels -@all"),
    (("on", ">pw", "~tenantA:*", "+@all"), f"user u on #{PW_HASH} ~tenantA:* resetchannels +@all"),
    (("on", ">pw", "~tenantB:*", "-@all", "+get", "+set", "%R~ro:*", "%W~wo:*"),
     f"user u on #{PW_HASH} ~tenantB:* %R~ro:* %W~wo:* resetchannels -@all +get +set"),
    (("~a", "~b", "resetkeys", "~c", "+@read", "-get", "+@write"),
     "user u off ~c resetchannels -@all +@read -get +@write"),
    (("reset",), "user u off sanitize-payload resetchannels -@all"),
    (("on", "allkeys", "allcommands", "nopass"), "user u on nopass ~* resetchannels +@all"),
    (("on", "nopass", ">pw"), f"user u on #{PW_HASH} resetchannels -@all"),
    ((">a", ">b", "<a"), f"user u off #{hashlib.sha256(b'b').hexdigest()} resetchannels -@all"),
    (("~x", "%R~y", "%RW~z", "%W~w"), "user u off ~x %R~y ~z %W~w resetchannels -@all"),
    (("~a", "%R~a"), "user u off ~a resetchannels -@all"),
    (("~a", "~*"), "user u off ~* resetchannels -@all"),
    (("%R~*", "~x"), "user u off %R~* ~x resetchannels -@all"),
    (("allcommands", "nocommands"), "user u off resetchannels -@all"),
    (("+GET", "+Set", "-config|get"), "user u off resetchannels -@all +get +set -config|get"),
    (("~*", "&x", "allchannels"), "user u off ~* &* -@all"),
    (("+@kvcache", "-kv.arena"), "user u off resetchannels -@all +@kvcache -kv.arena"),
])
def test_rules_are_shown_as_redis_shows_them(rules, line):
    assert user(*rules).describe() == line


@pytest.mark.parametrize("rule, reason", [
    ("bogus", "Syntax error"), ("", "Syntax error"), ("%X~a", "Syntax error"), ("%~a", "Syntax error"),
    ("+nosuch", acl.UNKNOWN_RULE), ("+@nosuch", acl.UNKNOWN_RULE), ("+get|x", acl.UNKNOWN_RULE),
    ("#abc", acl.BAD_HASH), ("#" + "A" * 64, acl.BAD_HASH), ("<nopw", acl.NO_SUCH_PASSWORD),
    ("!" + "a" * 64, acl.NO_SUCH_PASSWORD), ("(~x +get)", "Syntax error"),
])
def test_a_bad_rule_is_refused_with_redis_reason(rule, reason):
    with pytest.raises(acl.RuleError) as refused:
        user(rule)
    assert str(refused.value) == f"Error in ACL SETUSER modifier '{rule}': {reason}"


def test_a_pattern_after_allkeys_is_refused():
    with pytest.raises(acl.RuleError, match="Adding a pattern after the \\* pattern"):
        user("allkeys", "~x")


def test_a_refused_rule_list_changes_nothing():
    users = acl.Users(CATALOG)
    alice = users.setuser("alice", ["on", ">pw", "~a:*", "+get"])
    before = alice.describe()
    with pytest.raises(acl.RuleError):
        users.setuser("alice", ["off", "~b:*", "+nosuch"])
    assert alice.describe() == before and alice.enabled
    with pytest.raises(acl.RuleError):
        users.setuser("bob", ["on", "bogus"])
    assert users.get("bob") is None


def test_passwords_and_disabled_users():
    users = acl.Users(CATALOG)
    users.setuser("alice", ["on", ">secret", "#" + PW_HASH])
    assert users.authenticate("alice", b"secret") is users.get("alice")
    assert users.authenticate("alice", b"pw") is users.get("alice")
    assert users.authenticate("alice", b"wrong") is None
    assert users.authenticate("nobody", b"secret") is None
    users.setuser("alice", ["off"])
    assert users.authenticate("alice", b"secret") is None
    users.setuser("carol", ["on", "nopass"])
    assert users.authenticate("carol", b"anything") is not None
    with pytest.raises(CommandError) as refused:
        acl.login(users, b"alice", b"secret")
    assert refused.value.code == "WRONGPASS"


def test_requirepass_is_the_default_users_password():
    users = acl.Users(CATALOG, "sekrit")
    assert users.describe() == [f"user default on #{hashlib.sha256(b'sekrit').hexdigest()} ~* &* +@all"]
    assert users.authenticate("default", b"sekrit") and not users.authenticate("default", b"x")
    users.use_requirepass(None)
    assert users.describe() == ["user default on nopass ~* &* +@all"]
    assert users.default.unrestricted


def test_default_user_cannot_be_deleted_and_deleting_returns_the_users():
    users = acl.Users(CATALOG)
    alice = users.setuser("alice", ["on"])
    with pytest.raises(acl.AclError, match="The 'default' user cannot be removed"):
        users.delete(["alice", "default"])
    assert users.delete(["alice", "nosuch", "alice"]) == [alice]
    assert users.names() == ["default"]


# ------------------------------------------------------------------ categories

def test_kvcache_category_holds_every_kv_command():
    kv_names = {name for name in CATALOG.names if name.startswith("kv.")}
    assert kv_names and CATALOG.by_category["kvcache"] == kv_names


@pytest.mark.parametrize("name, expected", [
    ("get", ["read", "string", "fast"]), ("del", ["keyspace", "write", "slow"]),
    ("flushall", ["keyspace", "write", "slow", "dangerous"]), ("info", ["slow", "dangerous"]),
    ("config", ["slow"]), ("kv.match", ["read", "fast", "kvcache"]), ("kv.put", ["write", "slow", "kvcache"]),
])
def test_categories_follow_flags_group_and_redis_extras(name, expected):
    assert acl.command_categories(COMMANDS.lookup(name.encode())) == expected


def test_subcommands_carry_their_own_categories():
    assert acl.command_categories(COMMANDS.lookup(b"config"), "get") == ["admin", "slow", "dangerous"]
    assert acl.command_categories(COMMANDS.lookup(b"client"), "id") == ["slow", "connection"]
    assert acl.command_categories(COMMANDS.lookup(b"client"), "list") == ["admin", "slow", "dangerous", "connection"]
    assert acl.command_categories(COMMANDS.lookup(b"acl"), "whoami") == ["slow"]


def test_a_container_rule_covers_its_subcommands():
    u = user("on", "nopass", "allkeys", "+config", "-config|set")
    assert u.may_run("config|get") and u.may_run("config|resetstat") and not u.may_run("config|set")
    assert denial(u, "CONFIG", "SET", "a", "b") == acl.Denial(command="config|set")


# ------------------------------------------------------------------ checking requests

TENANT = ("on", "nopass", "~tenantA:*", "+@all")


def test_unrestricted_user_skips_every_check():
    default = acl.Users(CATALOG).default
    assert default.unrestricted
    assert denial(default, "FLUSHALL") is None and denial(default, "KV.ARENA") is None
    assert not user(*TENANT).unrestricted


def test_command_denial_comes_before_key_denial():
    u = user("on", "nopass", "~tenantB:*", "-@all", "+get")
    assert denial(u, "DEL", "x") == acl.Denial(command="del")
    assert denial(u, "GET", "x") == acl.Denial(key=b"x")
    assert denial(u, "GET", "tenantB:1") is None
    error = acl.Denial(command="del").error()
    assert (error.code, str(error)) == ("NOPERM", "this user has no permissions to run the 'del' command")
    assert str(acl.Denial(key=b"x").error()) == acl.NOPERM_KEY


def test_no_auth_commands_are_never_denied():
    u = user("on", "nopass", "-@all")
    assert denial(u, "AUTH", "alice", "pw") is None and denial(u, "HELLO", "3") is None
    assert denial(u, "QUIT") is None and denial(u, "PING") == acl.Denial(command="ping")


@pytest.mark.parametrize("request_, allowed", [
    (("GET", "tenantA:1"), True), (("GET", "tenantB:1"), False),
    (("MGET", "tenantA:1", "tenantA:2", "tenantB:1"), False), (("MSET", "tenantA:1", "v", "tenantB:x", "v"), False),
    (("MSET", "tenantA:1", "tenantB:x", "tenantA:2", "v"), True),           # values are not keys
    (("KV.MATCH", "tenantA:1", "tenantA:2"), True), (("KV.MATCH", "tenantA:1", "tenantB:2"), False),
    (("KV.LOCATE", "tenantB:1"), False), (("KV.PIN", "tenantB:1"), False), (("KV.UNPIN", "tenantB:1"), False),
    (("KV.PUT", "tenantA:2", "v", "PARENT", "tenantA:1"), True),
    (("KV.PUT", "tenantA:2", "v", "PARENT", "tenantB:1"), False),
    (("KV.PUT", "tenantA:2", "v", "NX", "PARENT", "tenantB:1", "PIN"), False),
    (("KV.BLOCK", "tenantA:2", "h", "TIMEOUT", "PARENT", "PARENT", "tenantB:1"), False),
    (("KV.GETLAYERS", "tenantB:1", "0", "-1"), False), (("KV.PUTLAYER", "tenantB:1", "0", "x"), False),
    (("MEMORY", "USAGE", "tenantB:1"), False), (("MEMORY", "USAGE", "tenantA:1"), True),
    (("KEYS", "tenantA:*"), False), (("SCAN", "0"), False), (("FLUSHALL",), False), (("FLUSHDB",), False),
    (("KV.ARENA",), False), (("KV.GPUARENA",), False), (("KV.LEASE", "t", "100", "tenantA:1"), False),
    (("KV.RESERVE", "t", "100", "10"), False), (("KV.PUBLISH", "1", "tenantA:1"), False),
    (("KV.MPUBLISH", "NX", "1", "tenantA:1", ""), False),
    (("KV.RELEASE", "1"), False), (("KV.UNRESERVE", "1"), False), (("KV.STATS",), True), (("DBSIZE",), True),
    (("KV.HOTKEYS",), False), (("KV.IMPORT", "1", "tenantA:1", "", "", "v"), False), (("KV.UNCOPY", "tenantA:1"), False),
    (("KV.TOUCH", "tenantA:1"), True), (("KV.TOUCH", "tenantB:1"), False), (("RANDOMKEY",), False),
    (("OBJECT", "ENCODING", "tenantB:1"), False), (("OBJECT", "ENCODING", "tenantA:1"), True),
    (("COPY", "tenantB:1", "tenantA:1"), False), (("RENAME", "tenantA:1", "tenantB:1"), False),
])
def test_tenant_keys(request_, allowed):
    assert (denial(user(*TENANT), *request_) is None) == allowed


def test_a_write_that_names_no_keys_needs_every_key():
    """A command that writes without key positions cannot be checked key by key: refused."""
    keyless_writes = [c.name for c in COMMANDS.all_commands() if "write" in c.flags and c.first_key <= 0]
    assert keyless_writes
    for name in keyless_writes:
        assert denial(user(*TENANT), name, "x", "y", "z") is not None, name


def test_read_and_write_patterns():
    u = user("on", "nopass", "+@all", "%R~ro:*", "%W~wo:*", "~rw:*")
    assert denial(u, "GET", "ro:1") is None and denial(u, "SET", "ro:1", "v") is not None
    assert denial(u, "SET", "wo:1", "v") is None and denial(u, "GET", "wo:1") is not None
    assert denial(u, "GETDEL", "wo:1") is not None and denial(u, "GETDEL", "rw:1") is None
    assert denial(u, "SET", "wo:1", "v", "GET") is not None and denial(u, "SET", "rw:1", "v", "GET") is None
    assert denial(u, "COPY", "wo:1", "rw:2") is not None      # a write-only key is not read by copying it
    assert denial(u, "COPY", "rw:1", "rw:2") is None


def test_patterns_match_as_redis_globs():
    u = user("on", "nopass", "+@all", "~t?n[ab]:*", "~exact")
    assert denial(u, "GET", "tena:1") is None and denial(u, "GET", "tunb:x") is None
    assert denial(u, "GET", "tenc:1") is not None and denial(u, "GET", "exact") is None
    assert denial(u, "GET", "exact2") is not None
    binary = user("on", "nopass", "+@all", "~bin:*")
    assert denial(binary, "GET", b"bin:\x00\xff\r\n") is None and denial(binary, "GET", b"\x00bin:") is not None


# ------------------------------------------------------------------ the ACL file

def test_acl_file_round_trip_keeps_users_identity(tmp_path):
    path = str(tmp_path / "users.acl")
    users = acl.Users(CATALOG)
    alice = users.setuser("alice", ["on", ">pw", "~a:*", "+@kvcache"])
    users.setuser("bob", ["on", "nopass", "~b:*", "+get"])
    users.save(path)
    assert open(path).read().splitlines() == users.describe()
    users.setuser("alice", ["resetkeys", "~z:*"])
    users.setuser("carol", ["on"])
    removed = users.load(path)
    assert [u.name for u in removed] == ["carol"]
    assert users.get("alice") is alice and alice.describe_keys() == "~a:*"
    assert users.names() == ["alice", "bob", "default"]


def test_acl_file_without_default_keeps_requirepass(tmp_path):
    path = tmp_path / "users.acl"
    path.write_text("user alice on nopass ~* +@all\n")
    users = acl.Users(CATALOG, "sekrit")
    users.load(str(path))
    assert not users.default.nopass and users.authenticate("default", b"sekrit")


def test_acl_file_errors_are_all_listed_and_nothing_changes(tmp_path):
    path = tmp_path / "users.acl"
    path.write_text('user alice on >pw ~a:* +@all bogus\nuser bob +nosuch\n\n# a comment\n'
                    'user alice on\nuser "un closed\nuser "a b" on\n')
    users = acl.Users(CATALOG)
    with pytest.raises(acl.AclFileError) as refused:
        users.load(str(path))
    p = str(path)
    assert str(refused.value) == (
        f"{p}:1: Syntax error. {p}:2: Error in applying operation '+nosuch': Unknown command or category "
        f"name in ACL. {p}:4 should start with user keyword followed by the username. WARNING: Duplicate "
        f"user 'alice' found on line 5. {p}:6: Syntax error. "
        f"{p}:7: username 'a b' contains invalid characters. "
        "WARNING: ACL errors detected, no change to the previously active ACL rules was performed")
    assert users.names() == ["default"]


def test_missing_acl_file(tmp_path):
    path = str(tmp_path / "none.acl")
    with pytest.raises(acl.AclFileError, match=f"Error loading ACLs, opening file '{path}': No such file"):
        acl.Users(CATALOG).load(path)


def test_genpass_lengths():
    assert len(acl.generate_password()) == 64
    assert len(acl.generate_password(5)) == 2 and len(acl.generate_password(4096)) == 1024
    assert acl.generate_password() != acl.generate_password()
