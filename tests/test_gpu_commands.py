"""KV.GPUARENA and KV.LEASEGPU (kvstore/commands/fastpath.py) against real `kvstore serve`
processes: one without a GPU tier, and one whose GPU tier runs on the fake cupy
(tests/fakecuda: its "device" memory is a memfd), so the node side of the CUDA IPC
path runs on any machine.

What is checked: the arena's description (PCI bus id, IPC handle, generation), the
generation refused when stale, DRAM leases through KV.LEASEGPU, a GPU value's lease
(its validity word and the value's first bytes, so no device read is needed) and its extent
held under it (a delete and a new value cannot reuse it mid-copy), and a
node asked for a device it does not have failing cleanly at start-up.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import redis

from conftest import free_port, wait_until
from gpu_fakes import NODE_BUS_ID, start_fake_gpu_node, use_fake_cupy_in_children

SIZE = 64 * 1024


@pytest.fixture
def plain_node(server):
    client = redis.Redis(server.host, server.port)
    yield client, client.execute_command("KV.ARENA")[4]
    client.close()


@pytest.fixture
def gpu_node(kvstore_factory, monkeypatch):
    daemon = start_fake_gpu_node(kvstore_factory, monkeypatch, "--promote-hits", "1")
    client = redis.Redis(daemon.host, daemon.port)
    yield client, client.execute_command("KV.ARENA")[4]
    client.close()


def lease_gpu(client: redis.Redis, token: bytes, generation: bytes, *keys: str):
    return client.execute_command("KV.LEASEGPU", token, generation, 5000, *keys)


def active_leases(client: redis.Redis) -> int:
    stats = client.execute_command("KV.LEASES")
    stats = dict(zip(stats[::2], stats[1::2])) if isinstance(stats, list) else stats
    return stats[b"leases_active"]


def on_gpu(client: redis.Redis, key: str) -> None:
    """Read ``key`` until the node has moved it to its GPU tier (promote-hits 1)."""
    def moved() -> bool:
        client.get(key)
        return client.execute_command("KV.LOCATE", key)[0][0] == b"gpu"
    wait_until(moved, what=f"{key} to move to the GPU tier")


def test_a_node_without_a_gpu_tier_has_no_gpu_arena(plain_node):
    client, _ = plain_node
    assert client.execute_command("KV.GPUARENA") is None


def test_leasegpu_leases_dram_values_on_a_node_without_a_gpu_tier(plain_node):
    client, token = plain_node
    client.set("k", b"v" * 1000)
    (lease_id, tier, offset, size, word, tag, header), absent = lease_gpu(client, token, b"", "k", "absent")
    assert (tier, size, header, absent) == (b"dram", 1000, b"", None) and offset > 0 and word >= 0 and tag > 0
    assert active_leases(client) == 1
    assert client.execute_command("KV.RELEASE", lease_id) == [1]
    assert active_leases(client) == 0


def test_a_generation_that_is_not_the_nodes_is_refused(plain_node):
    client, token = plain_node
    client.set("k", b"v")
    with pytest.raises(redis.ResponseError, match="^STALEGPU "):
        lease_gpu(client, token, b"an old generation", "k")
    with pytest.raises(redis.ResponseError, match="^STALEARENA "):
        lease_gpu(client, b"x" * 16, b"", "k")
    assert active_leases(client) == 0


def test_the_gpu_arena_names_its_device_by_pci_bus_id_and_has_a_generation(gpu_node):
    client, _ = gpu_node
    device, bus_id, handle, size, generation = client.execute_command("KV.GPUARENA")
    assert (device, bus_id, size) == (0, NODE_BUS_ID.encode(), 16 << 20)
    assert len(handle) == 64 and len(generation) == 16
    assert client.execute_command("KV.GPUARENA")[4] == generation


def test_a_stale_gpu_generation_is_refused_by_a_node_with_a_gpu_tier(gpu_node):
    client, token = gpu_node
    generation = client.execute_command("KV.GPUARENA")[4]
    client.set("k", b"v" * SIZE)
    for stale in (b"", b"g" * 16):
        with pytest.raises(redis.ResponseError, match="^STALEGPU "):
            lease_gpu(client, token, stale, "k")
    [(lease_id, tier, _, size, *_)] = lease_gpu(client, token, generation, "k")
    assert (tier, size) == (b"dram", SIZE)
    client.execute_command("KV.RELEASE", lease_id)
    assert active_leases(client) == 0


def test_a_leased_gpu_extent_is_not_reused_until_its_lease_ends(gpu_node):
    """Without the hold, a delete frees the extent and the next value promoted lands in
    it while the first reader still copies: a torn copy that a release would call valid
    if the new value took the same slot and offset."""
    client, token = gpu_node
    generation = client.execute_command("KV.GPUARENA")[4]
    client.set("a", b"1" * SIZE)
    on_gpu(client, "a")
    [(lease_id, tier, offset, size, word, tag, header)] = lease_gpu(client, token, generation, "a")
    assert (tier, size, header) == (b"gpu", SIZE, b"1" * 128) and word >= 0 and tag > 0
    client.delete("a")
    client.set("b", b"2" * SIZE)
    on_gpu(client, "b")
    [(other_id, _, other_offset, *_)] = lease_gpu(client, token, generation, "b")
    assert other_offset != offset, "the extent of a leased value was given to another one"
    assert client.execute_command("KV.RELEASE", lease_id, other_id) == [0, 1]    # "a" was deleted
    client.set("c", b"3" * SIZE)
    on_gpu(client, "c")
    [(last_id, _, last_offset, *_)] = lease_gpu(client, token, generation, "c")
    assert last_offset == offset, "the extent was not freed when its lease ended"
    client.execute_command("KV.RELEASE", last_id)


def test_a_device_the_node_does_not_have_fails_cleanly_at_start_up(tmp_path, monkeypatch):
    use_fake_cupy_in_children(monkeypatch)
    result = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--port", str(free_port()),
                             "--dram-size", "16mb", "--gpu-size", "16mb", "--gpu-device", "1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "no CUDA device 1 (this machine has 1)" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
