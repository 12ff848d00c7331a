"""Per-tenant quotas (kvstore/store/quotas.py) on a real `kvstore serve`, through redis-py.

A tenant is an ACL user given ``quota-dram=...``: a burst of another tenant cannot evict it
within its share, and a tenant over its share loses its own coldest values first (or gets
Redis's OOM error rather than cost anyone else a value). Quotas are ACL rules, so they are
refused like any bad rule (changing nothing) and persist through ACL SAVE and LOAD.
"""
from __future__ import annotations

import urllib.request

import pytest
import redis

from kvstore.store.entries import DRAM, OWNERS, TIERS
from kvstore.store.quotas import MAX_NAME_BYTES, MAX_TENANTS, SHARED, Quotas
from proto import wire
from tests.conftest import free_port, wait_until

KIB, MIB = 1 << 10, 1 << 20
OOM = "command not allowed when used memory > 'maxmemory'."


@pytest.fixture
def node(kvstore_factory, tmp_path):
    """A 16 MiB node with an ACL file and two tenants (no quota yet): alice on a:*, bob on b:*."""
    aclfile = tmp_path / "users.acl"
    aclfile.write_text("user default on nopass ~* &* +@all\n"
                       "user alice on >pa ~a:* +@all\nuser bob on >pb ~b:* +@all\n")
    daemon = kvstore_factory("--dram-size", "16mb", "--aclfile", str(aclfile))
    daemon.aclfile = aclfile
    return daemon


def connect(node, user: str | None = None) -> redis.Redis:
    password = {"alice": "pa", "bob": "pb"}.get(user)
    return redis.Redis(node.host, node.port, username=user, password=password, socket_timeout=60)


def write(client: redis.Redis, keys: list[bytes], size: int) -> None:
    pipe = client.pipeline(transaction=False)
    for n, key in enumerate(keys, 1):
        pipe.set(key, key[-8:].rjust(8, b".") * (size // 8))
        if n % 200 == 0:
            pipe.execute()
    pipe.execute()


def present(client: redis.Redis, keys: list[bytes]) -> list[bool]:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.exists(key)
    return [bool(x) for x in pipe.execute()]


def getuser(client: redis.Redis, name: str) -> dict:
    """ACL GETUSER's reply as sent (redis-py's parser keeps only the fields Redis has)."""
    raw = redis.Redis(connection_pool=client.connection_pool)
    raw.set_response_callback("ACL GETUSER", lambda reply, **options: reply)
    reply = raw.execute_command("ACL", "GETUSER", name)
    return reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2]))


def tenant_info(client: redis.Redis, name: str) -> dict:
    return client.info("tenants")[f"tenant_{name}"]


# ----------------------------------------------------------------- rules


def test_a_quota_is_an_acl_rule_shown_in_list_and_getuser(node):
    admin = connect(node)
    assert admin.execute_command("ACL", "SETUSER", "alice", "quota-dram=4mb") == b"OK"
    line = next(line for line in admin.execute_command("ACL", "LIST") if line.startswith(b"user alice "))
    assert line.endswith(b" quota-dram=4mb")
    assert getuser(admin, "alice")[b"quotas"] == b"quota-dram=4mb"
    assert tenant_info(admin, "alice") == {"used_dram": 0, "quota_dram": 4 * MIB, "used_ssd": 0, "quota_ssd": "none"}
    assert admin.execute_command("ACL", "SETUSER", "alice", "quota-dram=none") == b"OK"
    assert b"quotas" not in getuser(admin, "alice")
    assert tenant_info(admin, "alice")["quota_dram"] == "none"


def test_a_quota_for_a_name_longer_than_an_ssd_record_holds_is_refused(node):
    admin = connect(node)
    long_name = "u" * 256
    admin.execute_command("ACL", "SETUSER", long_name, "on", "nopass", "~u:*", "+@all")
    with pytest.raises(redis.ResponseError, match="name of at most 255 bytes"):
        admin.execute_command("ACL", "SETUSER", long_name, "quota-dram=1mb")
    admin.execute_command("ACL", "SETUSER", "u" * 255, "on", "nopass", "~u:*", "+@all")
    admin.execute_command("ACL", "SETUSER", "u" * 255, "quota-dram=1mb")
    assert tenant_info(admin, "u" * 255)["quota_dram"] == MIB


@pytest.mark.parametrize("rules, reason", [
    (["alice", "quota-dram=1gb"], "more than the node's DRAM"),
    (["alice", "quota-dram=-1"], "a quota is a size"),
    (["alice", "quota-dram=lots"], "a quota is a size"),
    (["alice", "quota-dram="], "a quota is a size"),
    (["alice", "quota-dram"], "a quota is a size"),
    (["alice", "quota-gpu=1mb"], "unknown quota"),
    (["alice", "quota-ssd=1mb"], "no SSD tier"),
    (["bob", "quota-dram=9mb"], "would add up to"),           # alice already has 8 MiB of 16
    (["carol", "on", "quota-dram=1mb"], "no user 'carol'"),
    (["default", "quota-dram=1mb"], "shared pool"),
    (["alice", "off", "quota-dram=99gb"], "more than the node's DRAM"),
])
def test_a_bad_quota_is_refused_and_changes_nothing(node, rules, reason):
    admin = connect(node)
    admin.execute_command("ACL", "SETUSER", "alice", "quota-dram=8mb")
    before = admin.execute_command("ACL", "LIST")
    tenants_before = admin.info("tenants")
    with pytest.raises(redis.ResponseError) as refused:
        admin.execute_command("ACL", "SETUSER", *rules)
    assert str(refused.value).startswith(f"Error in ACL SETUSER modifier '{rules[-1]}'")
    assert reason in str(refused.value)
    assert admin.execute_command("ACL", "LIST") == before
    assert admin.info("tenants") == tenants_before


def test_maxmemory_below_the_quotas_is_refused_and_a_quota_above_maxmemory_too(node):
    admin = connect(node)
    admin.execute_command("ACL", "SETUSER", "alice", "quota-dram=6mb")
    admin.execute_command("ACL", "SETUSER", "bob", "quota-dram=6mb")
    with pytest.raises(redis.ResponseError) as refused:
        admin.config_set("maxmemory", "10mb")
    assert "less than the tenants' DRAM quotas" in str(refused.value)
    assert admin.config_get("maxmemory")["maxmemory"] == str(16 * MIB)
    admin.config_set("maxmemory", "12mb")                # exactly the quotas' sum
    with pytest.raises(redis.ResponseError) as refused:
        admin.execute_command("ACL", "SETUSER", "alice", "quota-dram=7mb")
    assert "more than the node's DRAM" in str(refused.value)
    assert tenant_info(admin, "alice")["quota_dram"] == 6 * MIB


# ----------------------------------------------------------------- eviction


@pytest.mark.parametrize("size", [4000, 256 * KIB], ids=["small", "big"])
def test_a_burst_of_ten_shares_leaves_the_quiet_tenant_its_blocks(node, size):
    admin = connect(node)
    admin.execute_command("ACL", "SETUSER", "alice", "quota-dram=6mb")
    admin.execute_command("ACL", "SETUSER", "bob", "quota-dram=6mb")
    quiet, burst = connect(node, "alice"), connect(node, "bob")
    share = 6 * MIB // size
    quiet_keys = [b"a:%06d" % i for i in range(share * 9 // 10)]
    write(quiet, quiet_keys, size)
    write(burst, [b"b:%06d" % i for i in range(10 * share)], size)
    kept = sum(present(quiet, quiet_keys))
    assert kept >= 0.95 * len(quiet_keys), f"the quiet tenant kept {kept} of {len(quiet_keys)}"
    assert admin.info("stats")["evicted_keys"] > 0, "the burst had to evict"
    assert tenant_info(admin, "bob")["used_dram"] <= 16 * MIB - tenant_info(admin, "alice")["used_dram"]


def test_without_quotas_the_same_burst_evicts_the_quiet_tenant(node):
    """The reference for the test above: plain LRU gives the burst everything."""
    quiet, burst = connect(node, "alice"), connect(node, "bob")
    quiet_keys = [b"a:%06d" % i for i in range(1400)]
    write(quiet, quiet_keys, 4000)
    write(burst, [b"b:%06d" % i for i in range(15000)], 4000)
    assert sum(present(quiet, quiet_keys)) < 0.5 * len(quiet_keys)


def test_a_tenant_over_its_share_evicts_its_own_coldest_first(node):
    admin = connect(node)
    admin.execute_command("ACL", "SETUSER", "alice", "quota-dram=4mb")
    alice = connect(node, "alice")
    shared_keys = [b"s:%06d" % i for i in range(1500)]          # ~6 MiB, older than all of alice's
    write(admin, shared_keys, 4000)
    alice_keys = [b"a:%06d" % i for i in range(4000)]           # ~16 MiB: far over her share
    write(alice, alice_keys, 4000)
    assert all(present(admin, shared_keys)), "the shared pool's older values stay"
    kept = present(alice, alice_keys)
    count = sum(kept)
    assert count < len(alice_keys)
    assert sum(kept[-count:]) > 0.85 * count, "what she kept is (nearly) her newest: her coldest went first"
    used = tenant_info(admin, "alice")["used_dram"]
    assert 4 * MIB <= used <= 16 * MIB - 6 * MIB


def test_a_tenant_over_its_share_with_nothing_of_its_own_gets_oom(node):
    admin = connect(node)
    admin.execute_command("ACL", "SETUSER", "alice", "quota-dram=1mb")
    admin.execute_command("ACL", "SETUSER", "bob", "quota-dram=12mb")
    shared_keys = [b"s:%06d" % i for i in range(1200)]
    write(admin, shared_keys, 4000)
    bob_keys = [b"b:%06d" % i for i in range(2800)]
    write(connect(node, "bob"), bob_keys, 4000)                 # the arena is now full
    alice = connect(node, "alice")
    with pytest.raises(redis.ResponseError) as refused:
        alice.set(b"a:big", b"x" * (2 * MIB))                   # over her share, nothing of hers to evict
    assert str(refused.value) == OOM
    assert all(present(admin, shared_keys)) and all(present(admin, bob_keys))
    assert alice.get(b"a:big") is None


def test_chains_stay_prefixes_when_a_tenant_evicts_its_own(node):
    admin = connect(node)
    admin.execute_command("ACL", "SETUSER", "alice", "quota-dram=4mb")
    admin.execute_command("ACL", "SETUSER", "bob", "quota-dram=4mb")
    alice, bob = connect(node, "alice"), connect(node, "bob")
    bob_keys = [b"b:%06d" % i for i in range(900)]
    write(bob, bob_keys, 4000)
    chains = [[b"a:c%03d:%03d" % (c, i) for i in range(40)] for c in range(100)]   # ~16 MiB of chains
    pipe = alice.pipeline(transaction=False)
    for chain in chains:
        for i, key in enumerate(chain):
            pipe.execute_command(wire.KV_PUT, key, b"v" * 4000, *(["PARENT", chain[i - 1]] if i else []))
        pipe.execute()
    assert all(present(bob, bob_keys)), "bob is within his share"
    lost = 0
    for chain in chains:
        kept = present(alice, chain)
        n = sum(kept)
        assert kept == [True] * n + [False] * (len(chain) - n), "what stays of a chain is a prefix"
        lost += len(chain) - n
    assert lost > 0


# ----------------------------------------------------------------- reporting and persistence


def test_info_and_metrics_report_each_tenants_bytes_and_quota(kvstore_factory, tmp_path):
    aclfile = tmp_path / "users.acl"
    aclfile.write_text("user default on nopass ~* &* +@all\nuser alice on >pa ~a:* +@all quota-dram=2mb\n")
    port = free_port()
    node = kvstore_factory("--dram-size", "16mb", "--aclfile", str(aclfile), "--metrics-port", str(port))
    alice = connect(node, "alice")
    write(alice, [b"a:%03d" % i for i in range(100)], 1000)
    connect(node).set(b"shared", b"x" * 500)
    info = connect(node).info("tenants")
    assert info["tenant_alice"] == {"used_dram": 100 * 1000, "quota_dram": 2 * MIB, "used_ssd": 0,
                                    "quota_ssd": "none"}
    assert info["shared_pool"] == {"used_dram": 500, "used_ssd": 0}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    assert 'kvstore_tenant_used_bytes{tenant="alice",tier="dram"} 100000' in text
    assert f'kvstore_tenant_quota_bytes{{tenant="alice",tier="dram"}} {2 * MIB}' in text
    alice.delete(b"a:000")
    assert tenant_info(connect(node), "alice")["used_dram"] == 99 * 1000


def test_quotas_persist_through_acl_save_load_and_a_restart(node, kvstore_factory):
    admin = connect(node)
    admin.execute_command("ACL", "SETUSER", "alice", "quota-dram=3mb")
    assert admin.execute_command("ACL", "SAVE") == b"OK"
    assert "quota-dram=3mb" in node.aclfile.read_text()
    admin.execute_command("ACL", "SETUSER", "alice", "quota-dram=none")
    assert admin.execute_command("ACL", "LOAD") == b"OK"
    assert tenant_info(admin, "alice")["quota_dram"] == 3 * MIB
    node.stop()
    again = kvstore_factory("--dram-size", "16mb", "--aclfile", str(node.aclfile))
    assert tenant_info(connect(again), "alice")["quota_dram"] == 3 * MIB


def test_acl_load_of_quotas_too_big_changes_nothing(node):
    admin = connect(node)
    admin.execute_command("ACL", "SETUSER", "alice", "quota-dram=3mb")
    before = admin.execute_command("ACL", "LIST")
    node.aclfile.write_text("user default on nopass ~* &* +@all\n"
                            "user alice on >pa ~a:* +@all quota-dram=10mb\nuser bob on >pb ~b:* +@all quota-dram=10mb\n")
    with pytest.raises(redis.ResponseError) as refused:
        admin.execute_command("ACL", "LOAD")
    assert "would add up to" in str(refused.value)
    assert admin.execute_command("ACL", "LIST") == before
    assert tenant_info(admin, "alice")["quota_dram"] == 3 * MIB


def test_with_an_ssd_tier_the_burst_is_demoted_not_the_quiet_tenant(kvstore_factory, tmp_path):
    node = kvstore_factory("--dram-size", "16mb", "--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "256mb")
    admin = connect(node)
    for user in ("alice", "bob"):
        admin.execute_command("ACL", "SETUSER", user, "on", f">p{user[0]}", f"~{user[0]}:*", "+@all")
    with pytest.raises(redis.ResponseError, match="more than the node's SSD"):
        admin.execute_command("ACL", "SETUSER", "alice", "quota-ssd=1gb")
    admin.execute_command("ACL", "SETUSER", "alice", "quota-dram=6mb", "quota-ssd=64mb")
    admin.execute_command("ACL", "SETUSER", "bob", "quota-dram=6mb", "quota-ssd=64mb")
    quiet_keys = [b"a:%06d" % i for i in range(1300)]
    write(connect(node, "alice"), quiet_keys, 4000)
    write(connect(node, "bob"), [b"b:%06d" % i for i in range(15000)], 4000)
    assert tenant_info(admin, "alice")["used_dram"] >= 0.95 * len(quiet_keys) * 4000, "still in DRAM"
    bob = tenant_info(admin, "bob")
    assert bob["used_ssd"] > 0 and bob["used_dram"] + bob["used_ssd"] > 6 * MIB


def test_a_tenants_ssd_values_count_against_its_share_after_a_restart(kvstore_factory, tmp_path):
    """Each SSD record names its tenant: a warm restart counts alice's values as hers, before
    and after her quota is set again, and the shared pool's as the shared pool's."""
    aclfile = tmp_path / "users.acl"
    aclfile.write_text("user default on nopass ~* &* +@all\n"
                       "user alice on >pa ~a:* +@all quota-dram=6mb quota-ssd=64mb\n")
    args = ("--dram-size", "16mb", "--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "256mb", "--aclfile", str(aclfile))
    node = kvstore_factory(*args)
    alice_keys, shared_keys = [b"a:%05d" % i for i in range(3000)], [b"s:%05d" % i for i in range(3000)]
    write(connect(node, "alice"), alice_keys, 4000)
    write(connect(node), shared_keys, 4000)
    before = tenant_info(connect(node), "alice")
    assert before["used_ssd"] > 0, "some of alice's values went down to SSD"
    node.stop()
    aclfile.write_text("user default on nopass ~* &* +@all\nuser alice on >pa ~a:* +@all\n")   # no quota now
    again = kvstore_factory(*args)
    admin = connect(again)
    wait_until(lambda: not admin.info("ssd")["ssd_loading"], what="the SSD index to load")
    alice_left, shared_left = sum(present(admin, alice_keys)), sum(present(admin, shared_keys))
    assert alice_left > 0 and shared_left > 0
    info = admin.info("tenants")
    assert info["tenant_alice"] == {"used_dram": 0, "quota_dram": "none", "used_ssd": alice_left * 4000,
                                    "quota_ssd": "none"}
    assert info["shared_pool"] == {"used_dram": 0, "used_ssd": shared_left * 4000}
    admin.execute_command("ACL", "SETUSER", "alice", "quota-ssd=64mb")
    assert tenant_info(admin, "alice") == {"used_dram": 0, "quota_dram": "none", "used_ssd": alice_left * 4000,
                                           "quota_ssd": 64 * MIB}


def test_a_name_from_an_ssd_record_or_another_node_gets_its_tenant_id():
    """`Quotas.named`: an id by name (given at once when the name has none), the shared pool for no
    name, a name longer than a quota's user may have, or when every id is taken."""
    quotas = Quotas([[0] * OWNERS for _ in TIERS], [16 * MIB, 0, 0])
    quotas.apply({"alice": {DRAM: MIB}})
    alice = quotas.tenant("alice")
    assert quotas.named(b"alice") == alice and quotas.label(alice) == b"alice"
    bob = quotas.named(b"bob")
    assert bob not in (SHARED, alice) and quotas.tenant("bob") == bob and quotas.named(b"bob") == bob
    assert quotas.named(None) == SHARED and quotas.label(SHARED) is None
    assert quotas.named(b"x" * (MAX_NAME_BYTES + 1)) == SHARED
    for n in range(MAX_TENANTS - 2):
        quotas.named(b"t%d" % n)
    assert quotas.named(b"one too many") == SHARED
    quotas.apply({"alice": {DRAM: MIB}, "bob": {DRAM: MIB}})     # bob's quota comes later: same id
    assert quotas.tenant("bob") == bob
