"""Unit tests of the node configuration (kvstore.admin.config): sizes, TOML files, validation.

Sizes follow Redis's units (k = 1000, kb = 1024, ...). A TOML file uses the
same keys as the command-line flags; a bad key or value is a ConfigError
whose message names the setting.
"""
from __future__ import annotations

from dataclasses import fields

import pytest

from kvstore.admin.config import EVICTION_POLICIES, LOG_LEVELS, Config, ConfigError, parse_size
from proto.wire import DEFAULT_HOST, DEFAULT_PORT

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize("text, size", [
    ("0", 0), ("1024", 1024), ("1b", 1), ("1k", 1000), ("1kb", KiB), ("2m", 2_000_000),
    ("256mb", 256 * MiB), ("3g", 3_000_000_000), ("4gb", 4 * GiB), ("1t", 10**12), ("1tb", 1 << 40),
    ("4GB", 4 * GiB), ("64Mb", 64 * MiB), (" 8mb ", 8 * MiB), (512, 512),
])
def test_parse_size_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "gb", "abc", "1.5gb", "-1", "10xb", "1 2mb", "mb4", "0x10"])
def test_parse_size_errors_name_the_input(text):
    with pytest.raises(ConfigError) as raised:
        parse_size(text)
    assert str(raised.value) == f"invalid size '{text}' (use e.g. 1024, 64kb, 256mb, 4gb)"


def test_defaults():
    cfg = Config()
    assert (cfg.bind, cfg.port, cfg.unixsocket) == (DEFAULT_HOST, DEFAULT_PORT, None)
    assert cfg.dram_size == 1 * GiB and cfg.maxmemory_policy == "allkeys-lru"
    assert cfg.requirepass is None and cfg.proto_max_bulk_len == 512 * MiB
    assert cfg.maxclients == 10000 and EVICTION_POLICIES == ("allkeys-lru", "noeviction")


def test_names_are_dashed():
    names = Config.names()
    for name in ("bind", "port", "unixsocket", "dram-size", "maxmemory-policy", "requirepass",
                 "proto-max-bulk-len", "maxclients"):
        assert name in names


def test_set_converts_by_kind():
    cfg = Config()
    cfg.set("dram-size", "64mb")
    cfg.set("proto_max_bulk_len", "2mb")
    cfg.set("PORT", "7000")
    cfg.set("maxmemory-policy", "NoEviction")
    assert (cfg.dram_size, cfg.proto_max_bulk_len, cfg.port) == (64 * MiB, 2 * MiB, 7000)
    assert cfg.maxmemory_policy == "noeviction"
    assert cfg.get("dram-size") == str(64 * MiB) and cfg.get("unixsocket") == ""


# ----------------------------------------------------------------- TOML

def write_toml(tmp_path, text: str) -> str:
    path = tmp_path / "kvstore.toml"
    path.write_text(text)
    return str(path)


def test_toml_with_every_flag_of_the_issue(tmp_path):
    cfg = Config.from_toml(write_toml(tmp_path, """
bind = "127.0.0.1 ::1"
port = 7001
unixsocket = "/tmp/kv.sock"
dram-size = "64mb"
maxmemory-policy = "noeviction"
requirepass = "secret"
proto-max-bulk-len = "2mb"
maxclients = 3
"""))
    assert cfg == Config(bind="127.0.0.1 ::1", port=7001, unixsocket="/tmp/kv.sock", dram_size=64 * MiB,
                         maxmemory_policy="noeviction", requirepass="secret",
                         proto_max_bulk_len=2 * MiB, maxclients=3)


def test_toml_accepts_every_setting_by_its_dashed_name(tmp_path):
    """Each setting written with its default value reads back as the defaults."""
    defaults = Config()
    lines = []
    for f in fields(Config):
        value = getattr(defaults, f.name)
        if value is not None:
            lines.append(f"{f.name.replace('_', '-')} = {value!r}".replace("'", '"'))
    assert Config.from_toml(write_toml(tmp_path, "\n".join(lines))) == defaults


def test_toml_sizes_as_integers_and_underscored_keys(tmp_path):
    cfg = Config.from_toml(write_toml(tmp_path, "dram_size = 2097152\nport = 0\n"))
    assert cfg.dram_size == 2 * MiB and cfg.port == 0


def test_toml_unknown_key(tmp_path):
    with pytest.raises(ConfigError, match="^unknown setting 'dram'$"):
        Config.from_toml(write_toml(tmp_path, 'dram = "1gb"\n'))


def test_toml_table_is_not_a_setting(tmp_path):
    with pytest.raises(ConfigError, match="^unknown setting 'server'$"):
        Config.from_toml(write_toml(tmp_path, "[server]\nport = 1\n"))


@pytest.mark.parametrize("text, message", [
    ('dram-size = "lots"', "invalid size 'lots'"),
    ('port = "abc"', "^port must be an integer$"),
    ("maxclients = [1]", "^maxclients must be an integer$"),
    ('maxmemory-policy = "volatile-lru"', "^maxmemory-policy must be one of allkeys-lru, noeviction$"),
    ("port = 70000", "^port 70000 out of range$"),
    ('dram-size = "512kb"', "^dram-size must be at least 1mb$"),
    ("maxclients = 0", "^maxclients must be at least 1$"),
    ('loglevel = "info"', "^loglevel must be one of debug, verbose, notice, warning$"),
    # Values of the wrong kind are refused, not coerced.
    ("port = true", "^port must be an integer$"),
    ("high-watermark = true", "^high-watermark must be a number$"),
    ("dram-size = false", "^dram-size: invalid size 'False'"),
    ("bind = 5", "^bind must be a string$"),
    ('requirepass = ["a"]', "^requirepass must be a string$"),
])
def test_toml_bad_values(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_toml(write_toml(tmp_path, text + "\n"))


def test_toml_fractional_port_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="^port must be an integer$"):
        Config.from_toml(write_toml(tmp_path, "port = 7001.5\n"))


def test_toml_syntax_error_names_the_file(tmp_path):
    path = write_toml(tmp_path, "port = = 1\n")
    with pytest.raises(ConfigError, match=f"^config file {path}: "):
        Config.from_toml(path)


def test_missing_toml_file(tmp_path):
    path = str(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match=f"^cannot read config file {path}: No such file or directory$"):
        Config.from_toml(path)


# ----------------------------------------------------------------- validation

@pytest.mark.parametrize("settings, message", [
    ({"maxmemory_policy": "allkeys-lfu"}, "maxmemory-policy must be one of allkeys-lru, noeviction"),
    ({"port": -1}, "port -1 out of range"),
    ({"port": 65536}, "port 65536 out of range"),
    ({"dram_size": MiB - 1}, "dram-size must be at least 1mb"),
    ({"proto_max_bulk_len": 1000}, "proto-max-bulk-len must be at least 1mb and below 4gb"),
    ({"proto_max_bulk_len": 4 * 1024**3}, "proto-max-bulk-len must be at least 1mb and below 4gb"),
    ({"maxclients": 0}, "maxclients must be at least 1"),
])
def test_validation_messages(settings, message):
    with pytest.raises(ConfigError) as raised:
        Config(**settings)
    assert str(raised.value) == message


def test_validation_accepts_the_edges():
    Config(port=0, dram_size=MiB, proto_max_bulk_len=MiB, maxclients=1)
    Config(port=65535)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ----------------------------------------------------------------- kinds and levels

@pytest.mark.parametrize("level", sorted(LOG_LEVELS) + ["WARNING"])
def test_every_log_level_is_accepted(tmp_path, level):
    cfg = Config.from_toml(write_toml(tmp_path, f'loglevel = "{level}"\n'))
    assert cfg.loglevel == level.lower()


def test_an_error_names_its_settings_and_says_why_as_redis_would():
    cfg = Config()
    with pytest.raises(ConfigError) as raised:
        cfg.set("maxclients", "abc")
    assert raised.value.settings == ("maxclients",)
    assert raised.value.reason == "argument couldn't be parsed into an integer"
    with pytest.raises(ConfigError) as raised:
        Config(loglevel="info")
    assert raised.value.reason == "argument(s) must be one of the following: debug, verbose, notice, warning"
    with pytest.raises(ConfigError) as raised:
        Config(high_watermark=0.5)
    assert raised.value.settings == ("low-watermark", "high-watermark")
