"""The Prometheus endpoint (kvstore/admin/metrics.py) of a real `kvstore serve --metrics-port`.

What is checked: the exposition follows the text format (one TYPE line per
metric, then its one sample; no name twice); fields that only grow are
counters named ``*_total`` and agree with INFO, the rest are gauges; and a
scraper that sends headers without end still gets its answer.
"""
from __future__ import annotations

import socket
import urllib.request

import pytest
import redis

from conftest import free_port


@pytest.fixture(scope="module")
def node(kvstore_module_factory):
    port = free_port()
    return kvstore_module_factory("--metrics-port", str(port)), port


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def families(text: str) -> dict[str, tuple[str, float]]:
    """metric -> (type, value), checking that each TYPE line is followed by its one sample."""
    lines = text.splitlines()
    assert len(lines) % 2 == 0
    found: dict[str, tuple[str, float]] = {}
    for type_line, sample in zip(lines[::2], lines[1::2]):
        _, keyword, name, kind = type_line.split(" ")
        assert keyword == "TYPE" and kind in ("counter", "gauge"), type_line
        assert sample.split(" ")[0] == name and name not in found, sample
        found[name] = (kind, float(sample.split(" ")[1]))
    return found


def test_counters_are_counters_named_total_and_gauges_are_not(node):
    daemon, port = node
    client = redis.Redis(daemon.host, daemon.port, socket_timeout=10)
    client.set("k", "v")
    client.get("k")
    client.get("absent")
    metrics = families(scrape_text(port))
    stats = client.info("stats")
    for field, metric in [("keyspace_hits", "kvstore_keyspace_hits_total"),
                          ("keyspace_misses", "kvstore_keyspace_misses_total"),
                          ("total_connections_received", "kvstore_connections_received_total"),
                          ("evicted_keys", "kvstore_evicted_keys_total")]:
        assert metrics[metric] == ("counter", float(stats[field])), metric
    assert metrics["kvstore_commands_processed_total"][0] == "counter"
    assert metrics["kvstore_dram_hits_total"] == ("counter", 1.0)
    for gauge in ("kvstore_used_memory", "kvstore_connected_clients", "kvstore_dram_capacity",
                  "kvstore_dram_largest_free_extent", "kvstore_uptime_in_seconds"):
        assert metrics[gauge][0] == "gauge", gauge
    for name, (kind, _) in metrics.items():
        assert name.endswith("_total") == (kind == "counter"), name


def test_endless_headers_still_get_an_answer(node):
    _, port = node
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\r\n" + b"X-Filler: 1\r\n" * 1000)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.0 200 OK\r\n")


def test_fragmentation_and_evictions_by_cause_are_in_info_and_exported(kvstore_factory):
    port = free_port()
    daemon = kvstore_factory("--dram-size", "4mb", "--metrics-port", str(port))
    client = redis.Redis(daemon.host, daemon.port, socket_timeout=10)
    pipe = client.pipeline(transaction=False)
    for i in range(4000):
        pipe.set(b"s%d" % i, b"x" * 100)
    pipe.execute()
    for i in range(8):
        client.set(b"big%d" % i, b"y" * (1 << 20))
    memory = client.info("memory")
    assert memory["mem_allocator"] == "slabs+buddy" and memory["mem_largest_class"] == 1 << 20
    assert memory["evicted_keys_for_big"] > 0 and memory["eviction_regions"] > 0
    assert memory["mem_fragmented_bytes"] >= memory["mem_slab_slack_bytes"] >= 0
    assert float(memory["eviction_seconds"]) > 0 and float(memory["eviction_turn_budget_ms"]) == 2.0
    metrics = families(scrape_text(port))
    assert metrics["kvstore_evicted_keys_for_big_total"] == ("counter", float(memory["evicted_keys_for_big"]))
    assert metrics["kvstore_eviction_seconds_total"][0] == "counter"
    for gauge in ("kvstore_mem_fragmented_bytes", "kvstore_mem_largest_free_extent",
                  "kvstore_eviction_max_turn_ms"):
        assert metrics[gauge][0] == "gauge", gauge
