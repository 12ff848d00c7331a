"""A Prometheus /metrics endpoint with the same counters as INFO.

Why derive from INFO: one source of truth. Every numeric INFO field becomes
``kvstore_<field>`` (tier sections keep their prefix, e.g.
``kvstore_ssd_used``); non-numeric fields are left out. Fields that only
grow (hits, commands, evictions, ...) are Prometheus counters, named as the
text format expects (``kvstore_keyspace_hits_total``, Redis's ``total_``
prefix moved to the end, as redis_exporter names them), so ``rate()`` works
on them; everything else is a gauge. A field INFO shows in two sections (the
kvcache section repeats some DRAM figures) is exported once, as its tier
section says it. INFO's tenants section packs several figures in one field, so it is
exported from the quotas themselves, one series per tenant and tier
(``kvstore_tenant_used_bytes{tenant="alice",tier="dram"}``, and
``kvstore_tenant_quota_bytes`` where the tenant has a quota). The endpoint is a minimal HTTP/1.0 responder on the node's
event loop: scrapes are rare and small, so it needs no web framework.
"""
from __future__ import annotations

import asyncio
import logging

from kvstore.admin import info
from kvstore.store.quotas import NO_QUOTA, QUOTA_TIERS

log = logging.getLogger("kvstore")

REQUEST_SECONDS = 5         # a scrape's whole request must arrive within this
MAX_HEADER_LINES = 100
SKIP = {"process_id", "tcp_port", "arch_bits"}
COUNTERS = frozenset({"total_connections_received", "total_commands_processed", "rejected_connections",
                      "expired_keys", "evicted_keys", "keyspace_hits", "keyspace_misses", "oom_rejections",
                      "kv_hits", "kv_misses", "evicted_keys_for_small", "evicted_keys_for_big",
                      "evicted_keys_beyond_region", "evicted_keys_other", "evicted_keys_companion", "eviction_seconds",
                      "eviction_deferrals",
                      "eviction_regions"})
TIER_SECTIONS = ("gpu", "dram", "ssd")
TIER_COUNTERS = frozenset({"hits", "misses", "promotions", "demotions", "evictions", "checksum_failures",
                           "errors", "write_stalls"})


def render(server) -> str:
    metrics: dict[str, tuple[str, float | int]] = {}
    for section, fields in info.collect(server).items():
        for name, value in fields.items():
            number = _number(value)
            if number is None or name in SKIP:
                continue
            metric, kind = metric_of(section, name)
            metrics[metric] = (kind, number)
    lines = []
    for metric, (kind, number) in metrics.items():
        lines.append(f"# TYPE {metric} {kind}")
        lines.append(f"{metric} {number}")
    lines += tenant_lines(server)
    return "\n".join(lines) + "\n"


def tenant_lines(server) -> list[str]:
    """Per tenant and tier: the value bytes it holds and its quota (none without tenants)."""
    report = server.engine.quotas.report()[1:]
    if not report:
        return []
    used = ["# TYPE kvstore_tenant_used_bytes gauge"]
    quotas = ["# TYPE kvstore_tenant_quota_bytes gauge"]
    for name, held, quota in report:
        for word, tier in QUOTA_TIERS.items():
            labels = f'{{tenant="{_label(name)}",tier="{word}"}}'
            used.append(f"kvstore_tenant_used_bytes{labels} {held[tier]}")
            if quota[tier] != NO_QUOTA:
                quotas.append(f"kvstore_tenant_quota_bytes{labels} {quota[tier]}")
    return used + quotas


def _label(value: str) -> str:
    """A label value as the text format escapes it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metric_of(section: str, field: str) -> tuple[str, str]:
    """The metric name and type of INFO's ``field`` in ``section``."""
    field = field.replace("-", "_")
    tier_field = field.split("_", 1)[-1]
    if field in COUNTERS or (section in TIER_SECTIONS and tier_field in TIER_COUNTERS):
        return f"kvstore_{field.removeprefix('total_')}_total", "counter"
    return f"kvstore_{field}", "gauge"


def _number(value) -> float | int | None:
    if isinstance(value, (int, float)):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


async def _request_path(reader: asyncio.StreamReader) -> bytes:
    """The path of an HTTP request; its headers (at most MAX_HEADER_LINES) are read and dropped."""
    request = await reader.readline()
    for _ in range(MAX_HEADER_LINES):
        if await reader.readline() in (b"\r\n", b"\n", b""):
            break
    parts = request.split()
    return parts[1] if len(parts) > 1 else b""


async def serve_metrics(server, host: str, port: int) -> asyncio.AbstractServer:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            path = await asyncio.wait_for(_request_path(reader), REQUEST_SECONDS)
            if path == b"/metrics":
                body, status = render(server).encode(), b"200 OK"
            else:
                body, status = b"not found\n", b"404 Not Found"
            writer.write(b"HTTP/1.0 " + status + b"\r\nContent-Type: text/plain; version=0.0.4\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, ValueError):   # ValueError: a line over 64 KiB
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, host, port)
    log.info("Metrics on http://%s:%d/metrics", host, port)
    return srv
