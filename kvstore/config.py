"""The node's configuration: one dataclass, filled from flags or a TOML file.

Every setting has one name used everywhere: the dataclass field, the TOML key
and (with dashes) the command-line flag and the CONFIG GET/SET parameter, as
in redis.conf. Sizes accept Redis's units (``256mb``, ``4gb``, ``1024``).
"""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, fields

from proto.wire import DEFAULT_HOST, DEFAULT_PORT

EVICTION_POLICIES = ("allkeys-lru", "noeviction")
SSD_WRITE_POLICIES = ("write-back", "write-through")

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2,
          "g": 1000**3, "gb": 1024**3, "t": 1000**4, "tb": 1024**4}
_SIZE = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$")


class ConfigError(ValueError):
    """A setting with a bad name or value; the message names it."""


def parse_size(text: str | int) -> int:
    """``'256mb'`` -> 268435456, with Redis's units (k=1000, kb=1024)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text).lower())
    if not m or m.group(2) not in _UNITS:
        raise ConfigError(f"invalid size '{text}' (use e.g. 1024, 64kb, 256mb, 4gb)")
    return int(m.group(1)) * _UNITS[m.group(2)]


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

    SIZE_FIELDS = ("dram_size", "proto_max_bulk_len", "ssd_size", "gpu_size")
    INT_FIELDS = ("port", "maxclients", "gpu_device", "promote_hits", "promote_window_ms", "metrics_port")
    FLOAT_FIELDS = ("high_watermark", "low_watermark")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.maxmemory_policy not in EVICTION_POLICIES:
            raise ConfigError(f"maxmemory-policy must be one of {', '.join(EVICTION_POLICIES)}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port {self.port} out of range")
        if self.dram_size < 1024 * 1024:
            raise ConfigError("dram-size must be at least 1mb")
        if not 1024 * 1024 <= self.proto_max_bulk_len < 4 * 1024**3:
            raise ConfigError("proto-max-bulk-len must be at least 1mb and below 4gb")
        if self.maxclients < 1:
            raise ConfigError("maxclients must be at least 1")
        if self.ssd_write_policy not in SSD_WRITE_POLICIES:
            raise ConfigError(f"ssd-write-policy must be one of {', '.join(SSD_WRITE_POLICIES)}")
        if self.ssd_compression not in ("auto", "off"):
            raise ConfigError("ssd-compression must be auto or off")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ConfigError("watermarks must satisfy 0 < low-watermark < high-watermark <= 1")
        if self.promote_hits < 1:
            raise ConfigError("promote-hits must be at least 1")
        if self.ssd_size < 1024 * 1024:
            raise ConfigError("ssd-size must be at least 1mb")

    @classmethod
    def names(cls) -> list[str]:
        """Setting names as operators spell them (``dram-size``)."""
        return [f.name.replace("_", "-") for f in fields(cls)]

    def set(self, name: str, value) -> None:
        """Set one setting by its dashed or underscored name, converting the value."""
        attr = name.replace("-", "_").lower()
        if attr not in {f.name for f in fields(self)}:
            raise ConfigError(f"unknown setting '{name}'")
        if attr in self.SIZE_FIELDS:
            value = parse_size(value)
        elif attr in self.INT_FIELDS:
            if isinstance(value, float):
                raise ConfigError(f"{name} must be an integer")
            try:
                value = int(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{name} must be an integer") from None
        elif attr in self.FLOAT_FIELDS:
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{name} must be a number") from None
        elif attr in ("maxmemory_policy", "ssd_write_policy"):
            value = str(value).lower()
        elif value is not None:
            value = str(value)
        setattr(self, attr, value)

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
