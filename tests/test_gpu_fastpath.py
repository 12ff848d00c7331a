"""The GPU fast path on a real GPU, against real `kvstore serve --gpu-size` processes:
CUDA tensors read device to device from the node's GPU arena over CUDA IPC (the
client's stats prove the IPC path ran, not the host fallback), and from DRAM with one
host-to-device copy. Skipped, with the reason, on a machine without a GPU;
loadtest/gpu_check.sh runs them on a GPU host and fails if any is skipped.

What is checked: reads at offset 0 and beyond, cupy and torch destinations; a reader
looping over a 256 MiB value while another client deletes, overwrites and promotes it
again (every result one whole version); a destination used on a non-default torch
stream right after the call (the copy is ordered after the work already queued there);
the same from the asyncio client; a node restart under a live client; a node asked for
a device this host does not have failing cleanly; and the benchmark running to its end.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from client import AsyncKVClient, KVClient, TensorMismatch
from conftest import free_port
from kvstore.tiers.gpu import gpu_available
from proto import fastpath as fp

GPU_USABLE, GPU_REASON = gpu_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU_USABLE, reason=f"no usable GPU: {GPU_REASON}")]
MIB = 1 << 20


@pytest.fixture
def gpu_node(kvstore_factory):
    return kvstore_factory("--gpu-size", "64mb", "--promote-hits", "1")


def promote_to_gpu(kv: KVClient, key: str) -> None:
    deadline = time.monotonic() + 30
    while kv.locate([key])[0].tier != "gpu":
        assert time.monotonic() < deadline, "the value never moved to the GPU tier"
        kv.get(key)
        time.sleep(0.02)


def assert_read_over_ipc(kv: KVClient, reads: int) -> None:
    stats = kv.fast_path.stats
    assert (stats.gpu_ipc_reads, stats.gpu_fallbacks) == (reads, 0), stats


def test_cupy_reads_a_gpu_tier_value_device_to_device(gpu_node):
    import cupy
    with KVClient(unix_socket=gpu_node.unix_socket, fast_path="required") as kv:
        host = np.random.default_rng(0).random((64, 1024), dtype=np.float32)
        kv.put_tensor("t", host)
        promote_to_gpu(kv, "t")
        into = cupy.empty((64, 1024), cupy.float32)
        assert kv.get_tensor_into("t", into) is True
        assert np.array_equal(cupy.asnumpy(into), host)
        assert_read_over_ipc(kv, 1)
        with pytest.raises(TensorMismatch):
            kv.get_tensor_into("t", cupy.empty((64, 1024), cupy.float16))


def test_torch_cuda_reads_dram_and_gpu_values(gpu_node):
    import torch
    with KVClient(unix_socket=gpu_node.unix_socket, fast_path="required") as kv:
        host = torch.randn(32, 256).to(torch.bfloat16)
        kv.put_tensor("dram", host)
        into = torch.empty((32, 256), dtype=torch.bfloat16, device="cuda")
        assert kv.get_tensor_into("dram", into) and torch.equal(into.cpu(), host)
        assert_read_over_ipc(kv, 0)                                    # DRAM: host to device
        kv.put_tensor("gpu", host)
        promote_to_gpu(kv, "gpu")
        into.zero_()
        assert kv.get_tensor_into("gpu", into) and torch.equal(into.cpu(), host)
        assert_read_over_ipc(kv, 1)
        assert kv.get_tensor_into("absent", into) is False


def test_a_value_at_a_nonzero_arena_offset(gpu_node):
    import torch
    with KVClient(unix_socket=gpu_node.unix_socket, fast_path="required") as kv:
        values = {key: torch.randn(256, 1024) for key in ("first", "second", "third")}
        for key, value in values.items():
            kv.put_tensor(key, value)
            promote_to_gpu(kv, key)
        into = torch.empty(256, 1024, device="cuda")
        assert kv.get_tensor_into("first", into)
        path, token = kv.fast_path.gpu, kv.fast_path.mapping.token
        [(lease_id, tier, offset, _)] = kv.execute(fp.KV_LEASEGPU, token, path.generation, 5000, "third")
        kv.execute(fp.KV_RELEASE, lease_id)
        assert bytes(tier) == b"gpu" and offset > 0
        for key in ("third", "second"):
            into.zero_()
            assert kv.get_tensor_into(key, into) and torch.equal(into.cpu(), values[key])
        assert_read_over_ipc(kv, 3)


def test_a_reader_racing_deletes_overwrites_and_promotions_of_a_256_mib_value(kvstore_factory):
    """Each version is a constant fill: a torn copy would mix two versions (or the -1 the
    destination holds before each read)."""
    import torch
    daemon = kvstore_factory("--dram-size", "1536mb", "--gpu-size", "1gb", "--promote-hits", "1")
    elements, versions = (256 * MIB - fp.HEADER_SIZE) // 4, 6
    with KVClient(unix_socket=daemon.unix_socket, fast_path="required", timeout=60) as kv:
        kv.put_tensor("t", torch.full((elements,), 1, dtype=torch.int32))
        promote_to_gpu(kv, "t")
        done, seen = threading.Event(), set()

        def rewrite() -> None:
            with KVClient(unix_socket=daemon.unix_socket, timeout=60) as writer:
                for version in range(2, versions + 1):
                    writer.delete("t")
                    writer.put_tensor("t", torch.full((elements,), version, dtype=torch.int32))
                    promote_to_gpu(writer, "t")
            done.set()

        writer = threading.Thread(target=rewrite)
        writer.start()
        into = torch.empty(elements, dtype=torch.int32, device="cuda")
        deadline = time.monotonic() + 240
        while not done.is_set() and time.monotonic() < deadline:
            into.fill_(-1)
            if kv.get_tensor_into("t", into):
                low, high = int(into.min()), int(into.max())
                assert low == high and 1 <= low <= versions, f"a torn read: {low}..{high}"
                seen.add(low)
        writer.join(60)
        assert done.is_set() and len(seen) > 1, seen
        assert kv.fast_path.stats.gpu_ipc_reads > 0 and kv.fast_path.stats.gpu_fallbacks == 0


def test_a_destination_on_a_side_stream_is_ready_there_right_after_the_call(gpu_node):
    """The side stream is kept busy, then the destination is zeroed on it: a copy issued
    anywhere but after that zeroing would be overwritten by it."""
    import torch
    with KVClient(unix_socket=gpu_node.unix_socket, fast_path="required") as kv:
        host = torch.randn(512, 1024)
        kv.put_tensor("t", host)
        promote_to_gpu(kv, "t")
        into = torch.empty(512, 1024, device="cuda")
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)                 # about 0.1 s of work queued ahead
            into.zero_()
            assert kv.get_tensor_into("t", into)
            doubled = into * 2                             # on the side stream, right after
        side.synchronize()
        assert torch.equal(doubled.cpu(), host * 2)
        assert_read_over_ipc(kv, 1)


def test_the_asyncio_client_copies_on_the_callers_stream_too(gpu_node):
    import torch

    async def scenario() -> None:
        async with AsyncKVClient(unix_socket=gpu_node.unix_socket, fast_path="required") as kv:
            host = torch.randn(512, 1024)
            await kv.put_tensor("t", host)
            while (await kv.locate(["t"]))[0].tier != "gpu":
                await kv.get("t")
                await asyncio.sleep(0.02)
            into = torch.empty(512, 1024, device="cuda")
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000_000)
                into.zero_()
                assert await kv.get_tensor_into("t", into)
                doubled = into * 2
            side.synchronize()
            assert torch.equal(doubled.cpu(), host * 2)
            assert kv.fast_path.stats.gpu_ipc_reads == 1

    asyncio.run(scenario())


def test_a_node_restart_under_a_live_client_opens_the_new_nodes_gpu_arena(kvstore_factory):
    import cupy
    daemon = kvstore_factory("--gpu-size", "64mb", "--promote-hits", "1")
    with KVClient(unix_socket=daemon.unix_socket, fast_path="required") as kv:
        host = np.random.default_rng(1).random((64, 1024), dtype=np.float32)
        kv.put_tensor("t", host)
        promote_to_gpu(kv, "t")
        into = cupy.empty((64, 1024), cupy.float32)
        assert kv.get_tensor_into("t", into) is True
        kvstore_factory.restart(daemon, signal.SIGKILL)
        assert kv.get_tensor_into("t", into) is False                  # the new node is empty
        assert kv.fast_path.stats.remaps == 1
        kv.put_tensor("t", host * 2)
        promote_to_gpu(kv, "t")
        into.fill(0)
        assert kv.get_tensor_into("t", into) is True
        assert np.array_equal(cupy.asnumpy(into), host * 2)
        assert_read_over_ipc(kv, 2)


def test_a_device_this_host_does_not_have_fails_cleanly():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}                       # one GPU, whatever the host has
    result = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--port", str(free_port()),
                             "--dram-size", "64mb", "--gpu-size", "64mb", "--gpu-device", "1"],
                            capture_output=True, text=True, timeout=120, env=env)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "no CUDA device 1 (this machine has 1)" in output, output
    assert "Traceback" not in output


def test_the_benchmark_runs_to_its_verdict(capsys):
    from loadtest import bench_gpu
    assert bench_gpu.main(["--sizes", "4mb", "--runs", "1", "--repeats", "3"]) == 0
    assert "goal at 4 MiB" in capsys.readouterr().out
