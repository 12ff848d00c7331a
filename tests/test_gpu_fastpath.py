"""The GPU fast path against a real `kvstore serve --gpu-size` process: CUDA tensors
read device to device from the node's GPU arena over CUDA IPC, and from DRAM with
one host-to-device copy, also after the node restarted under a live client. Skipped,
with the reason, on a machine without a GPU."""
from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from client import KVClient, TensorMismatch
from conftest import start_kvstore
from test_client_sync import restart
from kvstore.tiers.gpu import gpu_available

GPU_USABLE, GPU_REASON = gpu_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU_USABLE, reason=f"no usable GPU: {GPU_REASON}")]


@pytest.fixture
def gpu_node(tmp_path):
    daemon = start_kvstore(tmp_path, "--gpu-size", "64mb")
    yield daemon
    daemon.stop()


def promote_to_gpu(kv: KVClient, key: str) -> None:
    deadline = time.monotonic() + 10
    while kv.locate([key])[0].tier != "gpu":
        assert time.monotonic() < deadline, "the value never moved to the GPU tier"
        kv.get(key)
        time.sleep(0.05)


def test_cupy_reads_a_gpu_tier_value_device_to_device(gpu_node):
    import cupy
    with KVClient(unix_socket=gpu_node.unix_socket, fast_path="required") as kv:
        host = np.random.default_rng(0).random((64, 1024), dtype=np.float32)
        kv.put_tensor("t", host)
        promote_to_gpu(kv, "t")
        into = cupy.empty((64, 1024), cupy.float32)
        assert kv.get_tensor_into("t", into) is True
        assert np.array_equal(cupy.asnumpy(into), host)
        with pytest.raises(TensorMismatch):
            kv.get_tensor_into("t", cupy.empty((64, 1024), cupy.float16))


def test_torch_cuda_reads_dram_and_gpu_values(gpu_node):
    import torch
    with KVClient(unix_socket=gpu_node.unix_socket, fast_path="required") as kv:
        host = torch.randn(32, 256).to(torch.bfloat16)
        kv.put_tensor("dram", host)
        into = torch.empty((32, 256), dtype=torch.bfloat16, device="cuda")
        assert kv.get_tensor_into("dram", into) and torch.equal(into.cpu(), host)
        kv.put_tensor("gpu", host)
        promote_to_gpu(kv, "gpu")
        into.zero_()
        assert kv.get_tensor_into("gpu", into) and torch.equal(into.cpu(), host)
        assert kv.get_tensor_into("absent", into) is False


def test_a_node_restart_under_a_live_client_opens_the_new_nodes_gpu_arena(tmp_path):
    import cupy
    daemons = [start_kvstore(tmp_path, "--gpu-size", "64mb")]
    try:
        with KVClient(unix_socket=daemons[0].unix_socket, fast_path="required") as kv:
            host = np.random.default_rng(1).random((64, 1024), dtype=np.float32)
            kv.put_tensor("t", host)
            promote_to_gpu(kv, "t")
            into = cupy.empty((64, 1024), cupy.float32)
            assert kv.get_tensor_into("t", into) is True
            daemons.append(restart(daemons[0], signal.SIGKILL))
            assert kv.get_tensor_into("t", into) is False                  # the new node is empty
            assert kv.fast_path.stats.remaps == 1
            kv.put_tensor("t", host * 2)
            promote_to_gpu(kv, "t")
            into.fill(0)
            assert kv.get_tensor_into("t", into) is True
            assert np.array_equal(cupy.asnumpy(into), host * 2)
    finally:
        daemons[-1].stop()
