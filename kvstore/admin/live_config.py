"""CONFIG GET and CONFIG SET on a running node.

Why a module of its own: a setting changed at run time must reach the part
that uses it (the engine's limit and policy, each connection's reader, the
tier manager's watermarks and heat window, the log level, the default
user's password, the clients' output buffer limit), or CONFIG SET
would answer OK for a change that never happens. Settings that shape what
was built at start-up (the listening sockets, the DRAM arena, the SSD and GPU
tiers, the metrics endpoint) cannot change without a restart: CONFIG SET
refuses them as Redis refuses an immutable parameter.

As in Redis, several settings in one CONFIG SET are checked together and
applied all or none: names first (unknown, immutable, repeated), then the
values, then the whole new configuration; only then does anything change.
"""
from __future__ import annotations

import dataclasses
import logging
import os

from kvstore.admin.config import LOG_LEVELS, Config, ConfigError, parse_size
from kvstore.admin.redis_params import PARAMS
from kvstore.store.companions import Companions
from kvstore.store.entries import DRAM

log = logging.getLogger("kvstore")

FIXED_AT_START = frozenset({"bind", "port", "unixsocket", "dram-size", "ssd-dir", "ssd-size", "ssd-compression",
                            "gpu-size", "gpu-device", "metrics-port", "appendonly",
                            "cluster", "announce", "cluster-node-timeout", "aclfile", "tls-port", "tls-cert-file",
                            "tls-key-file", "tls-ca-cert-file", "tls-auth-clients", "tls-cluster"})
# The node keeps no append-only file: appendonly stays "no" (refused as immutable, unlike the
# other Redis parameters, so that no one believes writes are logged). It persists nothing but its
# SSD tier, so ``save`` reads "" until CONFIG SET stores another value, which changes nothing.
REDIS_ONLY = {"appendonly": "no"}
# Redis's own parameters (kvstore/admin/redis_params.py), by name and by alias: stored, never used.
REDIS_NAME = {alias: name for name, alias, _, _ in PARAMS if alias} | {name: name for name, *_ in PARAMS}
REDIS_DEFAULT = {name: default for name, _, default, _ in PARAMS}
REDIS_IMMUTABLE = frozenset(name for name, _, _, kind in PARAMS if kind == "i")
HIDDEN = frozenset(n for name, alias, _, kind in PARAMS if kind == "h" for n in (name, alias) if n)


class UnknownSetting(Exception):
    """CONFIG SET named a parameter this node does not have."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class SettingRefused(Exception):
    """CONFIG SET of ``name`` failed for ``reason`` (Redis's wording); nothing was changed."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


def current(server) -> dict[str, str]:
    """Every parameter CONFIG GET knows, with the value in force."""
    cfg = server.config
    values = {name: cfg.get(name) for name in cfg.names()}
    values["maxmemory"] = str(server.engine.limit)
    values.update(REDIS_ONLY)
    stored = redis_values(server)
    for name, canonical in REDIS_NAME.items():
        if name not in values:
            values[name] = stored.get(canonical, REDIS_DEFAULT[canonical])
    return values


def redis_values(server) -> dict[str, str]:
    """The values CONFIG SET gave Redis parameters kvstore does not use (``dir``: the working directory)."""
    stored = getattr(server, "redis_params", None)
    if stored is None:
        stored = server.redis_params = {"dir": os.getcwd(), "save": ""}
    return stored


def apply(server, changes: list[tuple[str, str]]) -> None:
    """Apply (name, value) pairs, all or none; errors name a parameter as Redis does."""
    known, seen = current(server), set()
    for name, _ in changes:                 # as typed in these three errors, as in Redis
        canonical = name.lower()
        if canonical not in known:
            raise UnknownSetting(name)
        if canonical in FIXED_AT_START or (canonical not in server.config.names()
                                           and REDIS_NAME.get(canonical) in REDIS_IMMUTABLE):
            raise SettingRefused(name, "can't set immutable config")
        if canonical in seen:
            raise SettingRefused(name, "duplicate parameter")
        seen.add(canonical)
    own = set(server.config.names()) | {"maxmemory"}
    lowered = [(name.lower(), value) for name, value in changes if name.lower() in own]
    unused = [(REDIS_NAME[name.lower()], name, value) for name, value in changes if name.lower() not in own]
    for canonical, name, value in unused:
        if REDIS_DEFAULT[canonical] in ("yes", "no") and value.lower() not in ("yes", "no"):
            raise SettingRefused(name, "argument must be 'yes' or 'no'")
    server.config, server.engine.limit = _checked(server, lowered)
    server.engine.quotas.capacity[DRAM] = server.engine.limit
    stored = redis_values(server)
    for canonical, name, value in unused:
        if canonical not in stored:
            log.warning("CONFIG SET %s: a Redis parameter kvstore does not use; the value is kept for "
                        "CONFIG GET and otherwise ignored", canonical)
        stored[canonical] = value.lower() if REDIS_DEFAULT[canonical] in ("yes", "no") else value
    if "requirepass" in seen:
        server.users.use_requirepass(server.config.requirepass)
    push_to_running(server)


def _checked(server, changes: list[tuple[str, str]]) -> tuple[Config, int]:
    """The configuration and memory limit ``changes`` make, checked whole; the server is left alone."""
    updated, limit = dataclasses.replace(server.config), server.engine.limit
    for name, value in changes:
        try:
            if name == "maxmemory":
                limit = _memory_limit(value, updated.dram_size)
                quotas = server.engine.quotas.total(DRAM)
                if limit < quotas:
                    raise SettingRefused(name, f"{limit} bytes is less than the tenants' DRAM quotas "
                                               f"({quotas} bytes): lower a quota first (ACL SETUSER)")
            else:
                updated.set(name, value or None if name == "requirepass" else value)
        except ConfigError as e:
            raise SettingRefused(name, e.reason) from None
    try:
        updated.validate()
    except ConfigError as e:
        related = [name for name, _ in changes if name in e.settings] or [changes[0][0]]
        raise SettingRefused(related[0], e.reason) from None
    return updated, limit


def _memory_limit(value: str, dram_size: int) -> int:
    """maxmemory as the engine takes it: 0 (or more than the arena) means the whole arena."""
    limit = parse_size(value)
    return min(limit, dram_size) if limit else dram_size


def push_to_running(server) -> None:
    """Make every run-time setting of ``server.config`` the one in force."""
    cfg, engine = server.config, server.engine
    engine.policy = cfg.maxmemory_policy
    engine.companions = Companions(cfg.evict_companions)
    server.output_limit = cfg.output_buffer_limit()
    server.slowlog.configure(cfg.slowlog_log_slower_than, cfg.slowlog_max_len)
    for conn in server.clients.values():
        conn.reader.max_bulk_len = cfg.proto_max_bulk_len
    tiers = server.tiers
    if tiers is not None:
        tiers.cfg.high_watermark, tiers.cfg.low_watermark = cfg.high_watermark, cfg.low_watermark
        tiers.cfg.promote_hits, tiers.cfg.promote_window_s = cfg.promote_hits, cfg.promote_window_ms / 1000
        tiers.cfg.write_through = cfg.ssd_write_policy == "write-through"
    logging.getLogger().setLevel(LOG_LEVELS[cfg.loglevel])
