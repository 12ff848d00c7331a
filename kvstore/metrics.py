"""A Prometheus /metrics endpoint with the same counters as INFO.

Why derive from INFO: one source of truth. Every numeric INFO field becomes
``kvstore_<field>`` (tier sections keep their prefix, e.g.
``kvstore_ssd_checksum_failures``); non-numeric fields are left out. The
endpoint is a minimal HTTP/1.0 responder on the node's event loop: scrapes
are rare and small, so it needs no web framework.
"""
from __future__ import annotations

import asyncio
import logging

from kvstore import info

log = logging.getLogger("kvstore")

SKIP = {"process_id", "tcp_port", "arch_bits"}


def render(server) -> str:
    lines = []
    for section, fields in info.collect(server).items():
        for name, value in fields.items():
            number = _number(value)
            if number is None or name in SKIP:
                continue
            metric = "kvstore_" + name.replace("-", "_")
            lines.append(f"# TYPE {metric} gauge")
            lines.append(f"{metric} {number}")
    return "\n".join(lines) + "\n"


def _number(value) -> float | int | None:
    if isinstance(value, (int, float)):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


async def serve_metrics(server, host: str, port: int) -> asyncio.AbstractServer:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            path = request.split()[1] if len(request.split()) > 1 else b""
            if path == b"/metrics":
                body, status = render(server).encode(), b"200 OK"
            else:
                body, status = b"not found\n", b"404 Not Found"
            writer.write(b"HTTP/1.0 " + status + b"\r\nContent-Type: text/plain; version=0.0.4\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, host, port)
    log.info("Metrics on http://%s:%d/metrics", host, port)
    return srv
