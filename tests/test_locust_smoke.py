"""The locust users in short headless runs (`locust` as a subprocess) against a real `kvstore serve`
and a real 2-node cluster: every operation runs with no failure, and a value that does not verify
makes the run fail (exit code 1 with --exit-code-on-error 1), for the SDK user and the Redis user.
No figure is asserted: this proves the load test works, not how fast the store is.
"""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

from client import KVClient
from loadtest.cluster_up import ClusterUp
from loadtest.kv_workload import FIXTURE_TRACE, KVCacheEngine, load_trace
from loadtest.sealed import PayloadPool

ROOT = Path(__file__).resolve().parent.parent
KV_OPS = {("kv", "match_prefix"), ("kv", "batch_get"), ("kv", "batch_put")}
REDIS_OPS = {("redis", "GET"), ("redis", "SET")}


def run_locust(tmp_path: Path, *args: str, seconds: int = 4, users: int = 6) -> tuple[int, dict, str]:
    """Run locust headless; its exit code, {(type, name): (requests, failures)} and its output."""
    prefix = str(tmp_path / "run")
    done = subprocess.run([sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless",
                           "-u", str(users), "-r", str(users), "-t", f"{seconds}s", "--exit-code-on-error", "1",
                           "--csv", prefix, "--kv-trace", str(FIXTURE_TRACE), "--kv-block-bytes", "8192",
                           "--redis-max-bytes", str(256 << 10), "--redis-keys", "32", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=seconds + 60)
    with open(prefix + "_stats.csv", newline="") as f:
        counts = {(row["Type"], row["Name"]): (int(row["Request Count"]), int(row["Failure Count"]))
                  for row in csv.DictReader(f) if row["Name"] != "Aggregated"}
    return done.returncode, counts, done.stdout + done.stderr


def test_both_users_run_every_operation_without_failure(kvstore_factory, tmp_path):
    node = kvstore_factory()
    code, counts, output = run_locust(tmp_path, "--host", f"{node.host}:{node.port}")
    assert code == 0, output
    assert set(counts) == KV_OPS | REDIS_OPS, output
    assert all(requests > 0 and failures == 0 for requests, failures in counts.values()), counts
    assert "p50/p99 per operation" in output and "| kv batch_get |" in output


def test_a_value_that_does_not_verify_fails_the_kv_user(kvstore_factory, tmp_path):
    node = kvstore_factory()
    engine = KVCacheEngine(None, PayloadPool(16), 16)
    with KVClient(node.host, node.port) as kv:
        for hash_ids in load_trace(FIXTURE_TRACE):
            kv.batch_put([(key, b"not sealed by the load test") for key in engine.keys(hash_ids)],
                         overwrite=True)
    code, counts, output = run_locust(tmp_path, "--host", f"{node.host}:{node.port}", "KVCacheUser",
                                      seconds=2, users=2)
    assert code == 1, output
    assert counts[("kv", "batch_get")][1] > 0
    assert "failed verification" in output


def test_a_value_that_does_not_verify_fails_the_redis_user(kvstore_factory, tmp_path):
    node = kvstore_factory()
    with KVClient(node.host, node.port) as kv:
        kv.batch_put([(b"locust:redis:%d" % i, b"x" * 100) for i in range(32)], overwrite=True)
    code, counts, output = run_locust(tmp_path, "--host", f"{node.host}:{node.port}", "RedisUser",
                                      "--redis-get-share", "1", seconds=2, users=2)
    assert code == 1, output
    assert counts[("redis", "GET")][1] > 0


def test_the_kv_user_loads_a_cluster_named_by_its_etcd(tmp_path):
    with ClusterUp(nodes=2) as up:
        code, counts, output = run_locust(tmp_path, "--cluster", up.etcd_url, "KVCacheUser")
    assert code == 0, output
    assert set(counts) == KV_OPS, output
    assert all(requests > 0 and failures == 0 for requests, failures in counts.values()), counts
