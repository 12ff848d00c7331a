"""CONFIG SET and CONFIG GET on running nodes (kvstore/admin/live_config.py).

Real processes: `kvstore serve` daemons (some with an SSD tier in tmp_path)
and, as the reference for error texts and all-or-nothing behaviour, a real
redis-server. What is checked: a setting fixed at start-up is refused with
Redis's immutable-config error and left as it was; several settings in one
CONFIG SET are applied all or none, with Redis's error texts (compared byte
for byte on parameters both servers have); and each setting that CONFIG SET
accepts really changes what the node does (log level, watermarks, promotion
heat, SSD write policy), so CONFIG GET says what is in force.
"""
from __future__ import annotations

import time

import pytest

from conftest import wait_until
from test_redis_compat import RespConnection
from test_tiering import client, digest, on_ssd, spill, start_tiered, tiers, write_values

MIB = 1 << 20

FIXED = {"bind": "127.0.0.2", "port": "7777", "unixsocket": "/tmp/elsewhere.sock", "dram-size": "8mb",
         "ssd-dir": "/tmp/ssd", "ssd-size": "2gb", "ssd-compression": "off", "gpu-size": "1gb",
         "gpu-device": "1", "metrics-port": "9999", "appendonly": "yes"}


@pytest.fixture(scope="module")
def node(kvstore_module_factory):
    return kvstore_module_factory()


def config_get(conn: RespConnection, name: str) -> bytes:
    return conn.call("CONFIG", "GET", name)


def immutable(name: str) -> bytes:
    return b"-ERR CONFIG SET failed (possibly related to argument '%s') - can't set immutable config\r\n" \
        % name.encode()


@pytest.mark.parametrize("name", sorted(FIXED))
def test_settings_fixed_at_start_are_refused_as_immutable(node, name):
    with RespConnection(node) as conn:
        before = config_get(conn, name)
        assert conn.call("CONFIG", "SET", name, FIXED[name]) == immutable(name)
        assert config_get(conn, name) == before


def test_one_refused_setting_leaves_the_others_unchanged(node):
    with RespConnection(node) as conn:
        before = [config_get(conn, name) for name in ("maxclients", "high-watermark", "loglevel")]
        assert conn.call("CONFIG", "SET", "maxclients", "7", "high-watermark", "0.95", "gpu-size", "1gb") \
            == immutable("gpu-size")
        assert conn.call("CONFIG", "SET", "maxclients", "7", "loglevel", "info").startswith(
            b"-ERR CONFIG SET failed (possibly related to argument 'loglevel') - argument(s) must be one of")
        assert conn.call("CONFIG", "SET", "maxclients", "7", "high-watermark", "0.5").startswith(
            b"-ERR CONFIG SET failed (possibly related to argument 'high-watermark') - watermarks must satisfy")
        assert [config_get(conn, name) for name in ("maxclients", "high-watermark", "loglevel")] == before


def test_watermarks_set_together_are_checked_together(node):
    with RespConnection(node) as conn:
        assert conn.call("CONFIG", "SET", "low-watermark", "0.95", "high-watermark", "0.98") == b"+OK\r\n"
        assert config_get(conn, "*-watermark") == \
            b"*4\r\n$14\r\nhigh-watermark\r\n$4\r\n0.98\r\n$13\r\nlow-watermark\r\n$4\r\n0.95\r\n"
        assert conn.call("CONFIG", "SET", "high-watermark", "0.9", "low-watermark", "0.85") == b"+OK\r\n"


# Requests on parameters both servers have: the replies (and what CONFIG GET says after each) must match.
SAME_AS_REDIS = [
    ("CONFIG", "SET", "unixsocket", "/tmp/elsewhere.sock"),
    ("CONFIG", "SET", "UNIXSOCKET", "/tmp/elsewhere.sock"),
    ("CONFIG", "SET", "maxclients", "5", "unixsocket", "/tmp/elsewhere.sock"),
    ("CONFIG", "SET", "maxclients", "5", "maxmemory-policy", "bogus"),
    ("CONFIG", "SET", "maxclients", "5", "loglevel", "info"),
    ("CONFIG", "SET", "maxclients", "5", "maxmemory", "lots"),
    ("CONFIG", "SET", "maxclients", "100", "MAXCLIENTS", "2"),
    ("CONFIG", "SET", "maxclients", "5", "NOSUCH", "1"),
    ("CONFIG", "SET", "MAXCLIENTS", "abc"),
    ("CONFIG", "SET", "maxclients", "1.5"),
    ("CONFIG", "SET", "loglevel", "WARNING", "maxclients", "4000"),
    ("CONFIG", "SET", "loglevel", "notice", "maxclients", "10000"),
]


def test_errors_and_all_or_nothing_as_redis(redis_server, node):
    transcripts = []
    for daemon in (redis_server, node):
        with RespConnection(daemon) as conn:
            transcript = []
            for request in SAME_AS_REDIS:
                transcript.append(conn.call(*request))
                transcript.append(conn.call("CONFIG", "GET", "loglevel"))
            transcripts.append(transcript)
            maxclients = conn.call("CONFIG", "GET", "maxclients")
            assert maxclients.endswith(b"10000\r\n"), maxclients   # every refused request left it alone
    assert transcripts[1] == transcripts[0]


# ----------------------------------------------------------------- applied while running

def test_loglevel_changes_what_the_running_node_logs(kvstore_factory):
    quiet = kvstore_factory("--loglevel", "warning")
    with RespConnection(quiet) as conn:
        assert conn.call("CONFIG", "SET", "loglevel", "notice") == b"+OK\r\n"
        conn.send(b"SHUTDOWN\r\n")                # no reply: the node closes the connection
    assert quiet.proc.wait(10) == 0
    assert "shutting down" in quiet.log()
    chatty = kvstore_factory("--loglevel", "notice")
    with RespConnection(chatty) as conn:
        assert conn.call("CONFIG", "SET", "loglevel", "warning") == b"+OK\r\n"
        conn.send(b"SHUTDOWN\r\n")                # no reply: the node closes the connection
    assert chatty.proc.wait(10) == 0
    assert "Ready to accept connections" in chatty.log() and "shutting down" not in chatty.log()


def test_watermarks_set_at_run_time_drive_demotion(kvstore_factory):
    daemon = start_tiered(kvstore_factory)            # 8 MiB of DRAM, default watermarks 0.90 / 0.85
    r = client(daemon)
    written = write_values(r, range(20))          # 5 MiB: under the high watermark, all in DRAM
    assert set(tiers(r, list(written))) == {"dram"}
    assert r.execute_command("CONFIG", "SET", "high-watermark", 0.5, "low-watermark", 0.25) == b"OK"
    assert r.config_get("*-watermark") == {"high-watermark": "0.5", "low-watermark": "0.25"}
    wait_until(lambda: r.info("dram")["dram_used"] <= 2 * MIB, what="DRAM down to the low watermark")
    assert {k: digest(r.get(k)) for k in written} == written


def test_promote_hits_and_window_set_at_run_time(kvstore_factory):
    daemon = start_tiered(kvstore_factory)            # promote-hits 2 within 10 s by default
    r = client(daemon)
    written = spill(r)
    slow, hot = on_ssd(r, list(written))[:2]
    assert r.config_set("promote-window-ms", 1) is True
    for _ in range(2):
        assert digest(r.get(slow)) == written[slow]
        time.sleep(0.05)                          # further apart than the 1 ms window
    assert tiers(r, [slow]) == ["ssd"]
    assert r.config_set("promote-hits", 1) is True
    assert digest(r.get(hot)) == written[hot]
    assert tiers(r, [hot]) == ["dram"]
    assert r.config_get("promote-*") == {"promote-hits": "1", "promote-window-ms": "1"}


def test_ssd_write_policy_set_at_run_time(kvstore_factory):
    daemon = start_tiered(kvstore_factory, dram="64mb")       # write-back: nothing reaches SSD until demoted
    r = client(daemon)
    assert r.config_set("ssd-write-policy", "WRITE-THROUGH") is True
    assert r.config_get("ssd-write-policy") == {"ssd-write-policy": "write-through"}
    write_values(r, range(4))
    wait_until(lambda: r.info("ssd")["ssd_records"] == 4, what="4 records written through")
