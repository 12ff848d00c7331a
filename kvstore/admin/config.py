"""The node's configuration: one dataclass, filled from flags or a TOML file.

Every setting has one name used everywhere: the dataclass field, the TOML key
and (with dashes) the command-line flag and the CONFIG GET/SET parameter, as
in redis.conf. Sizes accept Redis's units (``256mb``, ``4gb``, ``1024``).
"""
from __future__ import annotations

import logging
import os
import re
import tomllib
from dataclasses import dataclass, fields

from kvstore.store import companions
from proto.wire import DEFAULT_HOST, DEFAULT_PORT

EVICTION_POLICIES = ("allkeys-lru", "noeviction")
SSD_WRITE_POLICIES = ("write-back", "write-through")
SSD_COMPRESSIONS = ("auto", "off")
YES_NO = ("yes", "no")
TLS_AUTH_CLIENTS = ("yes", "no", "optional")
# Redis's client classes for client-output-buffer-limit; only "normal" clients exist here,
# the others are kept so the setting reads and writes as in Redis.
BUFFER_LIMIT_CLASSES = {"normal": "normal", "slave": "slave", "replica": "slave", "pubsub": "pubsub"}
DEFAULT_OUTPUT_BUFFER_LIMIT = "normal 0 0 0 slave 268435456 67108864 60 pubsub 33554432 8388608 60"
LOG_LEVELS = {"debug": logging.DEBUG, "verbose": logging.DEBUG, "notice": logging.INFO,
              "warning": logging.WARNING}
# CONFIG SET answers a bad policy with Redis's own list, word for word, as clients expect.
REDIS_POLICIES = ("volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl", "allkeys-lru",
                  "allkeys-lfu", "allkeys-random", "noeviction")

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2,
          "g": 1000**3, "gb": 1024**3, "t": 1000**4, "tb": 1024**4}
_SIZE = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$")


class ConfigError(ValueError):
    """A setting with a bad name or value; the message names it.

    ``settings`` are the dashed names the complaint is about, and ``reason``
    says it without the name, in Redis's words where Redis has them, for
    CONFIG SET's "possibly related to argument" error.
    """

    def __init__(self, message: str, settings: tuple[str, ...] = (), reason: str | None = None):
        super().__init__(message)
        self.settings = settings
        self.reason = reason or message


def parse_size(text: str | int) -> int:
    """``'256mb'`` -> 268435456, with Redis's units (k=1000, kb=1024)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = _SIZE.match(str(text).lower())
    if not m or m.group(2) not in _UNITS:
        raise ConfigError(f"invalid size '{text}' (use e.g. 1024, 64kb, 256mb, 4gb)",
                          reason="argument must be a memory value")
    return int(m.group(1)) * _UNITS[m.group(2)]


def physical_memory() -> int:
    """Bytes of RAM in this machine: the DRAM arena is faulted in whole, so it must fit."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check(ok: bool, setting: str, message: str, reason: str | None = None) -> None:
    if not ok:
        raise ConfigError(message, (setting,), reason)


def _one_of(setting: str, value: str, choices, listed=None) -> None:
    listed = ", ".join(listed or choices)
    _check(value in choices, setting, f"{setting} must be one of {', '.join(choices)}",
           f"argument(s) must be one of the following: {listed}")


@dataclass
class Config:
    bind: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    unixsocket: str | None = None
    dram_size: int = 1024**3
    maxmemory_policy: str = "allkeys-lru"
    requirepass: str | None = None
    proto_max_bulk_len: int = 512 * 1024**2
    maxclients: int = 10000
    loglevel: str = "notice"
    ssd_dir: str | None = None
    ssd_size: int = 64 * 1024**3
    ssd_write_policy: str = "write-back"
    ssd_compression: str = "auto"
    gpu_size: int = 0                 # 0: no GPU tier
    gpu_device: int = 0
    high_watermark: float = 0.90
    low_watermark: float = 0.85
    promote_hits: int = 2
    promote_window_ms: int = 10000
    metrics_port: int = 0             # 0: no /metrics endpoint
    cluster: str | None = None        # etcd://HOST:PORT/NAME: join that cluster
    announce: str | None = None       # host:port other nodes and clients reach this node at
    cluster_node_timeout: float = 5.0  # seconds without a keep-alive before a node is gone
    cluster_move_budget: float = 5.0   # seconds a clean join or leave spends moving values (0: none move)
    cluster_nic_gbps: float = 100.0   # this node's NIC: a clean move may push 1.5 x DRAM / NIC seconds
    hot_reads: float = 100.0          # reads per second above which a block is copied to other nodes (0: never)
    hot_replicas: int = 2             # nodes a hot block is copied to at least (more as its load needs)
    aclfile: str | None = None        # users, one "user NAME rules..." line each (ACL LOAD/SAVE)
    protected_mode: str = "yes"       # refuse remote clients while the default user has no password
    tls_port: int = 0                 # 0: no TLS listener
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_cert_file: str | None = None
    tls_auth_clients: str = "yes"     # yes: clients need a certificate the CA signed; optional; no
    tls_cluster: str = "no"           # yes: announce the TLS port; nodes talk to each other over TLS
    client_output_buffer_limit: str = DEFAULT_OUTPUT_BUFFER_LIMIT   # class hard soft soft-seconds
    client_query_buffer_limit: int = 1024**3
    slowlog_log_slower_than: int = 10000   # microseconds; 0 logs every command, -1 none
    slowlog_max_len: int = 128
    evict_companions: str = "kv_bytes metadata"     # suffix pairs evicted together (kvstore/store/companions.py)

    SIZE_FIELDS = ("dram_size", "proto_max_bulk_len", "ssd_size", "gpu_size", "client_query_buffer_limit")
    INT_FIELDS = ("port", "maxclients", "gpu_device", "promote_hits", "promote_window_ms", "metrics_port",
                  "tls_port", "hot_replicas", "slowlog_log_slower_than", "slowlog_max_len")
    FLOAT_FIELDS = ("high_watermark", "low_watermark", "cluster_node_timeout", "cluster_move_budget", "cluster_nic_gbps",
                    "hot_reads")
    LOWERCASE_FIELDS = ("maxmemory_policy", "ssd_write_policy", "ssd_compression", "loglevel", "protected_mode",
                        "tls_auth_clients", "tls_cluster")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of bounds (or a pair that disagrees)."""
        _one_of("maxmemory-policy", self.maxmemory_policy, EVICTION_POLICIES, REDIS_POLICIES)
        _check(bool(self.bind.split()), "bind", "bind must name at least one address")
        _check(0 <= self.port < 65536, "port", f"port {self.port} out of range")
        _check(self.dram_size >= 1024 * 1024, "dram-size", "dram-size must be at least 1mb")
        _check(self.dram_size <= physical_memory(), "dram-size",
               f"dram-size ({self.dram_size} bytes) is more than this machine's memory "
               f"({physical_memory()} bytes)")
        _check(1024 * 1024 <= self.proto_max_bulk_len < 4 * 1024**3, "proto-max-bulk-len",
               "proto-max-bulk-len must be at least 1mb and below 4gb")
        _check(self.maxclients >= 1, "maxclients", "maxclients must be at least 1")
        _check(self.slowlog_log_slower_than >= -1, "slowlog-log-slower-than",
               "slowlog-log-slower-than must be -1 (log nothing) or more",
               "argument must be between -1 and 9223372036854775807 inclusive")
        _check(self.slowlog_max_len >= 0, "slowlog-max-len", "slowlog-max-len must be 0 or more",
               "argument must be between 0 and 9223372036854775807 inclusive")
        _one_of("loglevel", self.loglevel, tuple(LOG_LEVELS))
        _one_of("ssd-write-policy", self.ssd_write_policy, SSD_WRITE_POLICIES)
        _one_of("ssd-compression", self.ssd_compression, SSD_COMPRESSIONS)
        _check(self.ssd_size >= 1024 * 1024, "ssd-size", "ssd-size must be at least 1mb")
        _check(self.gpu_size >= 0, "gpu-size", "gpu-size must be 0 (no GPU tier) or more")
        _check(self.gpu_device >= 0, "gpu-device", "gpu-device must be 0 or more")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ConfigError("watermarks must satisfy 0 < low-watermark < high-watermark <= 1",
                              ("low-watermark", "high-watermark"))
        _check(self.promote_hits >= 1, "promote-hits", "promote-hits must be at least 1")
        _check(self.promote_window_ms >= 1, "promote-window-ms", "promote-window-ms must be at least 1")
        _check(0 <= self.metrics_port < 65536, "metrics-port", f"metrics-port {self.metrics_port} out of range")
        _check(0.5 <= self.cluster_node_timeout <= 3600, "cluster-node-timeout",
               "cluster-node-timeout must be between 0.5 and 3600 seconds")
        _check(0 <= self.cluster_move_budget <= 600, "cluster-move-budget",
               "cluster-move-budget must be between 0 and 600 seconds")
        _check(0.1 <= self.cluster_nic_gbps <= 10000, "cluster-nic-gbps",
               "cluster-nic-gbps must be between 0.1 and 10000 Gbit/s")
        _check(self.hot_reads >= 0, "hot-reads", "hot-reads must be 0 (no copies) or more")
        _check(0 <= self.hot_replicas <= 16, "hot-replicas", "hot-replicas must be between 0 and 16")
        _one_of("protected-mode", self.protected_mode, YES_NO)
        self._validate_tls()
        _check(self.client_query_buffer_limit >= 1024 * 1024, "client-query-buffer-limit",
               "client-query-buffer-limit must be at least 1mb",
               "argument must be between 1048576 and 9223372036854775807 inclusive")
        merge_output_buffer_limits(DEFAULT_OUTPUT_BUFFER_LIMIT, self.client_output_buffer_limit)
        refused = companions.check(self.evict_companions)
        _check(refused is None, "evict-companions", refused or "")

    def _validate_tls(self) -> None:
        _check(0 <= self.tls_port < 65536, "tls-port", f"tls-port {self.tls_port} out of range")
        _one_of("tls-auth-clients", self.tls_auth_clients, TLS_AUTH_CLIENTS)
        _one_of("tls-cluster", self.tls_cluster, YES_NO)
        _check(self.tls_cluster == "no" or bool(self.tls_port), "tls-cluster", "tls-cluster yes needs tls-port")
        if not self.tls_port:
            return
        _check(bool(self.tls_cert_file and self.tls_key_file), "tls-port",
               "tls-port needs tls-cert-file and tls-key-file")
        _check(self.tls_auth_clients == "no" or bool(self.tls_ca_cert_file), "tls-auth-clients",
               "tls-ca-cert-file must be given when tls-auth-clients is yes or optional")

    def output_buffer_limit(self) -> tuple[int, int, int]:
        """(hard, soft, soft seconds) for normal clients; 0 turns a limit off."""
        values = self.client_output_buffer_limit.split()
        return tuple(int(v) for v in values[1:4]) if values[0] == "normal" else (0, 0, 0)

    @classmethod
    def names(cls) -> list[str]:
        """Setting names as operators spell them (``dram-size``)."""
        return [f.name.replace("_", "-") for f in fields(cls)]

    def set(self, name: str, value) -> None:
        """Set one setting by its dashed or underscored name, converting the value.

        Values come as text (flags, CONFIG SET) or typed (TOML); a typed value
        of the wrong kind (``port = true``, ``bind = 5``) is refused, not coerced.
        """
        attr = name.replace("-", "_").lower()
        if attr not in {f.name for f in fields(self)}:
            raise ConfigError(f"unknown setting '{name}'")
        value = self._convert(attr, value)
        if attr == "client_output_buffer_limit":         # the classes not named keep their limits
            value = merge_output_buffer_limits(self.client_output_buffer_limit, value)
        setattr(self, attr, value)

    def _convert(self, attr: str, value):
        setting = attr.replace("_", "-")
        if attr in self.SIZE_FIELDS:
            try:
                return parse_size(value)
            except ConfigError as e:
                raise ConfigError(f"{setting}: {e}", (setting,), e.reason) from None
        if attr in self.INT_FIELDS:
            return _integer(setting, value)
        if attr in self.FLOAT_FIELDS:
            return _number(setting, value)
        if value is None:
            return None
        if not isinstance(value, str):
            raise ConfigError(f"{setting} must be a string", (setting,))
        return value.lower() if attr in self.LOWERCASE_FIELDS else value

    def get(self, name: str) -> str:
        value = getattr(self, name.replace("-", "_").lower())
        return "" if value is None else str(value)

    @classmethod
    def from_toml(cls, path: str) -> "Config":
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path}: {e}") from None
        cfg = cls()
        for key, value in data.items():
            cfg.set(key, value)
        cfg.validate()
        return cfg


def merge_output_buffer_limits(current: str, text: str) -> str:
    """client-output-buffer-limit as Redis reads it: ``class hard soft seconds`` groups
    (sizes with units) override those classes in ``current``; the result lists every class."""
    words = text.lower().split()
    setting = "client-output-buffer-limit"
    if not words or len(words) % 4:
        raise ConfigError(f"{setting}: expected groups of class, hard, soft and soft-seconds", (setting,),
                          "Wrong number of arguments in buffer limit configuration.")
    known = current.split()
    limits = {known[i]: known[i + 1:i + 4] for i in range(0, len(known), 4)}
    bad_values = ConfigError(f"{setting}: hard and soft must be sizes, soft-seconds an integer", (setting,),
                             "Error in hard, soft or soft_seconds setting in buffer limit configuration.")
    for i in range(0, len(words), 4):
        cls = BUFFER_LIMIT_CLASSES.get(words[i])
        if cls is None:
            raise ConfigError(f"{setting}: unknown client class '{words[i]}'", (setting,),
                              "Invalid client class specified in buffer limit configuration.")
        try:
            hard, soft = parse_size(words[i + 1]), parse_size(words[i + 2])
        except ConfigError:
            raise bad_values from None
        if not words[i + 3].isdigit():
            raise bad_values
        limits[cls] = [str(hard), str(soft), str(int(words[i + 3]))]
    return " ".join(f"{cls} {' '.join(limits[cls])}" for cls in ("normal", "slave", "pubsub"))


def _integer(setting: str, value) -> int:
    if not isinstance(value, (bool, float)):
        try:
            return int(value)
        except (TypeError, ValueError):
            pass
    raise ConfigError(f"{setting} must be an integer", (setting,), "argument couldn't be parsed into an integer")


def _number(setting: str, value) -> float:
    if not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise ConfigError(f"{setting} must be a number", (setting,), "argument couldn't be parsed into a number")
