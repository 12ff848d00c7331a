"""`kvstore cluster status` against a real etcd, and `kvstore cluster up` with real node processes."""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import redis
from redis.cluster import RedisCluster

from kvstore.cluster.membership import ClusterError
from kvstore.cluster.runner import ClusterURL

from tests.conftest import WAIT_S
from tests.test_cluster_etcd import member, wait_converged

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kvstore(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("text, expected", [
    ("etcd://127.0.0.1:2379/shop", ("127.0.0.1", 2379, "shop")),
    ("http://127.0.0.1:2379", ("127.0.0.1", 2379, "kvstore")),          # etcd's own form: the default name
    ("http://127.0.0.1:2379/shop", ("127.0.0.1", 2379, "shop")),
    ("etcd://[::1]:2379/shop/", ("::1", 2379, "shop")),
])
def test_a_cluster_url_is_taken_in_the_form_up_prints_and_in_etcds_own(text, expected):
    url = ClusterURL.parse(text)
    assert (url.host, url.port, url.name) == expected
    assert ClusterURL.parse(str(url)) == url


@pytest.mark.parametrize("text", ["etcd://x", "redis://127.0.0.1:1/a", "etcd://127.0.0.1:70000/a", "etcd://h:1/a b"])
def test_a_malformed_cluster_url_is_refused(text):
    with pytest.raises(ClusterError, match="want etcd://HOST:PORT/NAME"):
        ClusterURL.parse(text)


def test_status_shows_nodes_ranges_epoch_and_coverage(etcd):
    async def scenario():
        states = [member(etcd, f"127.0.0.1:{7001 + i}", name="shop") for i in range(2)]
        await asyncio.gather(*(s.start() for s in states))
        await wait_converged(states, WAIT_S)
        done = kvstore("cluster", "status", f"etcd://127.0.0.1:{etcd.client_port}/shop")
        for s in states:
            await s.stop()
        return states, done
    states, done = asyncio.run(scenario())
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "2 nodes" in out and f"epoch {states[0].map.epoch}:" in out and "16384/16384 slots assigned (ok)" in out
    for s in states:
        ranges = " ".join(f"{a}-{b}" for a, b in s.map.ranges_of(s.my_id))
        assert f"{s.my_id} {s.announce} slots={s.map.counts[s.my_id]} {ranges}" in out


def test_status_of_an_empty_cluster_and_of_an_unreachable_etcd(etcd):
    done = kvstore("cluster", "status", f"etcd://127.0.0.1:{etcd.client_port}/nothing")
    assert done.returncode == 0 and "0 nodes, leader (none)" in done.stdout and "no slot map yet" in done.stdout
    etcd.stop()
    done = kvstore("cluster", "status", f"etcd://127.0.0.1:{etcd.client_port}/nothing")
    assert done.returncode == 1 and done.stderr.startswith("error: ")
    bad = kvstore("cluster", "status", "redis://x/y")
    assert bad.returncode == 1 and "want etcd://HOST:PORT/NAME" in bad.stderr


def test_up_fails_clearly_when_a_node_cannot_start():
    done = kvstore("cluster", "up", "--nodes", "1", "--dram-size", "1kb")
    assert done.returncode == 1
    assert "error: node 127.0.0.1:" in done.stderr and "exited with" in done.stderr


def test_up_starts_a_cluster_redis_cluster_clients_use_and_stops_it_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "cluster", "up", "--nodes", "3", "--dram-size", "64mb"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(proc.stdout.readline())
        nodes = first["nodes"]
        assert len(nodes) == 3 and len({n["id"] for n in nodes}) == 3
        host, port = nodes[0]["addr"].split(":")
        client = RedisCluster(host=host, port=int(port))
        for i in range(200):
            client.set(f"key{i}", f"value{i}")
        assert all(client.get(f"key{i}") == f"value{i}".encode() for i in range(200))
        assert {n.name for n in client.get_nodes()} == {n["addr"] for n in nodes}
        assert re.fullmatch(r"etcd://127\.0\.0\.1:\d+/kvstore", first["etcd"]), first["etcd"]
        status = kvstore("cluster", "status", first["etcd"])        # what up printed is what status takes
        assert "16384/16384 slots assigned (ok)" in status.stdout
        etcd_only = first["etcd"].replace("etcd://", "http://").rsplit("/", 1)[0]
        assert "16384/16384 slots assigned (ok)" in kvstore("cluster", "status", etcd_only).stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        for node in nodes:
            with pytest.raises(redis.ConnectionError):
                redis.Redis(*node["addr"].split(":"), socket_connect_timeout=1).ping()
        assert all(not os.path.exists(f"/proc/{n['pid']}") or _zombie(n["pid"]) for n in nodes)
        log_dir = re.search(r"logs in (\S+)\)", proc.stderr.read()).group(1)
        assert not os.path.exists(os.path.join(log_dir, "etcd", "data"))      # its WAL alone is 64 MB
        assert len([name for name in os.listdir(log_dir) if name.startswith("node-")]) == 3
        shutil.rmtree(log_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _zombie(pid: int) -> bool:
    time.sleep(0.1)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except OSError:
        return True
