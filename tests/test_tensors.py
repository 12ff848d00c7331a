"""The tensor API against a real `kvstore serve` process, through the fast path and
over the wire: dtype and shape travel with the value, mismatches are refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_fastpath_faults import counters

from client import KVClient, ResponseError, TensorMismatch

PATHS = ["auto", "off"]


@pytest.fixture(scope="module")
def node(kvstore_module_factory):
    return kvstore_module_factory()


@pytest.fixture(params=PATHS)
def kv(request, node):
    with KVClient(unix_socket=node.unix_socket, fast_path=request.param) as client:
        yield client
        client.execute("FLUSHALL")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8, np.int64, np.bool_])
def test_numpy_round_trip_keeps_dtype_and_shape(kv, dtype):
    array = (np.random.default_rng(0).random((3, 5, 7)) * 100).astype(dtype)
    assert kv.put_tensor("t", array) is True
    assert kv.put_tensor("t", array) is False
    got = kv.get_tensor("t")
    assert got.dtype == array.dtype and got.shape == array.shape and np.array_equal(got, array)
    into = np.empty_like(array)
    assert kv.get_tensor_into("t", into) is True
    assert np.array_equal(into, array)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_round_trip_including_bf16(kv, dtype):
    tensor = torch.randn(4, 64, 32).to(dtype)
    kv.put_tensor("t", tensor)
    got = kv.get_tensor("t", framework="torch")
    assert got.dtype == dtype and got.shape == tensor.shape and torch.equal(got, tensor)
    into = torch.empty_like(tensor)
    assert kv.get_tensor_into("t", into) and torch.equal(into, tensor)


def test_mismatches_are_clear_errors_and_copy_nothing(kv):
    kv.put_tensor("t", torch.ones(4, 8, dtype=torch.bfloat16))
    into = torch.zeros(4, 8, dtype=torch.float16)
    with pytest.raises(TensorMismatch, match=r"bfloat16\[4, 8\].*float16\[4, 8\]"):
        kv.get_tensor_into("t", into)
    assert not into.any()
    with pytest.raises(TensorMismatch, match="shape|8"):
        kv.get_tensor_into("t", torch.zeros(8, 4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16"):
        kv.get_tensor("t")                           # numpy has no bfloat16
    with pytest.raises(TypeError, match="contiguous"):
        kv.put_tensor("u", torch.zeros(4, 8).t())
    kv.execute("SET", "plain", b"not a tensor" * 20)
    with pytest.raises(ResponseError, match="not a tensor"):
        kv.get_tensor("plain")


def test_missing_tensor_and_tensor_read_as_plain_bytes(kv):
    assert kv.get_tensor("absent") is None
    assert kv.get_tensor_into("absent", np.zeros(3)) is False
    array = np.arange(10, dtype=np.int32)
    kv.put_tensor("t", array)
    raw = kv.get("t")
    assert len(raw) == 128 + array.nbytes and bytes(raw[128:]) == array.tobytes()


def test_a_mismatch_leaves_no_lease_held_and_the_connection_open(kv):
    kv.put_tensor("t", torch.ones(4, 8, dtype=torch.bfloat16))
    before = counters(kv)
    for _ in range(3):
        with pytest.raises(TensorMismatch):
            kv.get_tensor_into("t", torch.zeros(4, 8, dtype=torch.float16))
        with pytest.raises(TensorMismatch):
            kv.get_layers("t", into=torch.zeros(8, 4, dtype=torch.bfloat16))
    after = counters(kv)
    assert after["leases_active"] == 0
    assert after["connections"] == before["connections"]          # the pooled connection was kept
    into = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert kv.get_tensor_into("t", into) and torch.equal(into, torch.ones(4, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("destination", [
    lambda: torch.zeros(8, 4).t(),                          # a transposed view: (4, 8), strided
    lambda: np.zeros((4, 16), np.float32)[:, ::2],          # every other column: (4, 8), strided
], ids=["torch-transposed", "numpy-strided"])
def test_a_non_contiguous_destination_is_refused_before_anything_is_sent(kv, destination):
    kv.put_tensor("t", np.ones((4, 8), np.float32))
    into = destination()
    before = counters(kv)
    with pytest.raises(TypeError, match="destination tensor must be contiguous"):
        kv.get_tensor_into("t", into)
    with pytest.raises(TypeError, match="destination tensor must be contiguous"):
        kv.get_layers("t", into=into)
    with pytest.raises(TypeError, match="destination tensor must be contiguous"):
        kv.batch_get_tensors_into(["t"], [into])
    assert not into.any()
    after = counters(kv)
    assert after["leases_active"] == 0 and after["connections"] == before["connections"]


def test_tensor_batches(kv):
    arrays = {f"t{i}": np.full((16, 64), i, np.float32) for i in range(3)}
    assert kv.batch_put_tensors(arrays, parents=[None, "t0", "t1"]) == [True, True, True]
    assert kv.batch_put_tensors(list(arrays.items())[:1]) == [False]
    assert kv.match_prefix(list(arrays)) == 3
    into = np.zeros((4, 16, 64), np.float32)
    assert kv.batch_get_tensors_into([*arrays, "absent"], list(into)) == [True, True, True, False]
    assert all((into[i] == i).all() for i in range(3)) and not into[3].any()
    with pytest.raises(ValueError, match="parents"):
        kv.batch_put_tensors(arrays, parents=[None])
    with pytest.raises(ValueError, match="tensors"):
        kv.batch_get_tensors_into(["t0", "t1"], [into[0]])
