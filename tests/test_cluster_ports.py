"""Port picking for launched processes (kvstore/cluster/ports.py), and the launchers that recover when a
picked port is taken before their process listens: a real etcd (ThrowawayEtcd) and real node processes
(`kvstore cluster up`'s LocalCluster), each told first to use a port a socket of this test holds."""
from __future__ import annotations

import argparse
import shutil
import socket
import threading

import pytest

from kvstore.cluster import etcd_server, subcommand
from kvstore.cluster.ports import free_ports, port_was_taken


def test_the_ports_of_one_call_are_distinct():
    ports = free_ports(64)
    assert len(set(ports)) == 64 and all(0 < p < 65536 for p in ports)


@pytest.mark.parametrize("count", [0, -1, 100_000])
def test_a_senseless_count_is_refused(count):
    with pytest.raises(ValueError, match="ask for 1 to"):
        free_ports(count)


def test_a_taken_port_is_read_from_the_logs_of_each_server_we_start():
    assert port_was_taken("Could not start: [Errno 98] Address already in use")                 # kvstore
    assert port_was_taken('"error":"listen tcp 127.0.0.1:4001: bind: address already in use"')  # etcd
    assert not port_was_taken("Could not start: the DRAM arena of 1 KiB is too small")


@pytest.fixture
def held_port():
    """A port a listening socket of this test holds, so a process told to use it cannot."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def first_call_gets(held: int):
    """A stand-in for free_ports whose first answer starts with ``held``; later calls are real."""
    calls = []

    def picked(count: int, host: str = "127.0.0.1") -> list[int]:
        calls.append(count)
        real = free_ports(count, host)
        return [held, *real[1:]] if len(calls) == 1 else real
    return picked


def test_etcd_whose_port_is_taken_starts_on_fresh_ones(tmp_path, held_port, monkeypatch):
    monkeypatch.setattr(etcd_server, "free_ports", first_call_gets(held_port))
    server = etcd_server.ThrowawayEtcd(str(tmp_path / "etcd")).start()
    try:
        assert server.client_port != held_port and server.proc.poll() is None
        assert server.url.endswith(f":{server.client_port}")
    finally:
        server.close()


def test_a_node_whose_port_is_taken_starts_again_on_a_fresh_one(held_port, monkeypatch):
    monkeypatch.setattr(subcommand, "free_ports", first_call_gets(held_port))
    args = argparse.Namespace(nodes=2, name="ports", etcd=None, netns=False, nic_rate=None, dram_size="16mb",
                              node_timeout=None, ssd_dir=None, serve_flags=[])
    cluster = subcommand.LocalCluster(args, threading.Event())
    try:
        cluster.start()
        nodes = cluster.wait_formed()
    finally:
        cluster.stop()
        shutil.rmtree(cluster.log_dir, ignore_errors=True)
    ports = [int(n["addr"].rpartition(":")[2]) for n in nodes]
    assert len(nodes) == 2 and held_port not in ports and len(set(ports)) == 2
    assert cluster.node_tries == [2, 1]
