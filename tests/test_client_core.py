"""client/core.py and the procedures it runs, against a scripted node (no daemon, no GPU):
the transport's connections are replaced by one that answers from a script and the
arena mapping by real memfd mappings, so the paths a CPU host cannot reach run here:
the GPU path after a node restart, a mismatch on the GPU path, a value the node cannot
serve from its arena, and destinations refused before anything is sent."""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from client import KVClient, TensorMismatch, fastpath, gpu
from client.arena import Arena
from client.errors import error_from_reply
from client.shared_index import SharedIndexView
from client.pool import ConnectionPool
from client.tensors import TensorSpec
from proto import fastpath as fp

ARENA_BYTES = 1 << 20
WORDS = 16
INDEX_BUCKETS = 64               # an empty shared index: every get asks the scripted node


def memfd(size: int) -> int:
    fd = os.memfd_create("test-arena")
    os.ftruncate(fd, size)
    return fd


def mapped_arena(token: bytes) -> Arena:
    fds = memfd(ARENA_BYTES), memfd(WORDS * 8), memfd(INDEX_BUCKETS * fp.INDEX_BUCKET_BYTES)
    watch = SimpleNamespace(peer=SimpleNamespace(closed=lambda: False), close=lambda: None)
    try:
        return Arena(fds[0], ARENA_BYTES, token, fds[1], WORDS, SharedIndexView(fds[2], INDEX_BUCKETS), watch)
    finally:
        for fd in fds:
            os.close(fd)


class ScriptedNode:
    """A node's answers to the fast-path commands, one arena token per incarnation."""

    def __init__(self, header: bytes):
        self.token = b"A" * 16
        self.header = header
        self.sent: list[tuple] = []
        self.closed = 0

    def restart(self) -> None:
        self.token = b"B" * 16

    def answer(self, request: tuple):
        self.sent.append(request)
        name = request[0]
        if name == fp.KV_GPUARENA:
            return [0, b"handle", ARENA_BYTES]
        if name in (fp.KV_LEASEGPU, fp.KV_LEASE) and request[1] != self.token:
            return error_from_reply("STALEARENA the client's arena mapping is not this node's arena")
        if name == fp.KV_LEASEGPU:
            return [[7, b"gpu", 4096, fp.HEADER_SIZE + 4 * 8 * 4, -1, 0, self.header]]
        if name == fp.KV_LEASE:
            return error_from_reply("NOTINARENA a value is staged outside the shared arena")
        if name == fp.KV_RELEASE:
            return [1] * (len(request) - 1)
        if name == "GET":
            return bytearray(b"over the wire")
        raise AssertionError(f"unexpected request {request!r}")

    def commands(self) -> list[str]:
        return [request[0] for request in self.sent]


class ScriptedConnection:
    def __init__(self, node: ScriptedNode):
        self.node = node

    def round_trip(self, requests, sinks=None):
        return [self.node.answer(tuple(request)) for request in requests]

    def is_stale(self) -> bool:
        return False

    peer = SimpleNamespace(closed=lambda: False)

    def close(self) -> None:
        self.node.closed += 1


class FakeDevicePath:
    """A GPUPath whose "device" is host memory; it records what it did."""

    opened: list[FakeDevicePath] = []
    generation = b"G"

    def __init__(self):
        self.closed = False
        FakeDevicePath.opened.append(self)

    def serves(self, tensor) -> bool:
        return True

    def stream_of(self, tensor) -> int:
        return 0

    def copy(self, tier, offset, size, arena, tensor, stream) -> None:
        tensor.host[...] = 3.0

    def close(self) -> None:
        self.closed = True


class FakeCudaArray:
    """Looks like a cupy array to the SDK (module, dtype, shape, flags); lives in host memory."""

    def __init__(self, host: np.ndarray):
        self.host = host
        self.dtype = host.dtype
        self.shape = host.shape
        self.flags = SimpleNamespace(c_contiguous=host.flags.c_contiguous)


FakeCudaArray.__module__ = "cupy._fake"


def header_of(dtype: str, shape: tuple[int, ...]) -> bytes:
    return TensorSpec(dtype, shape).header()


@pytest.fixture
def scripted(monkeypatch):
    """A KVClient whose node is scripted; the node's stored tensor is float32 (4, 8)."""
    node = ScriptedNode(header_of("float32", (4, 8)))
    monkeypatch.setattr(fastpath, "attach", lambda *args: mapped_arena(node.token))
    monkeypatch.setattr(gpu, "_usable_cupy", lambda: SimpleNamespace())
    monkeypatch.setattr(gpu.GPUPath, "open", classmethod(lambda cls, cupy, reply: FakeDevicePath()))
    FakeDevicePath.opened = []
    kv = KVClient(unix_socket="/nonexistent", fast_path="required")
    kv._transport._pool = ConnectionPool(lambda: ScriptedConnection(node), 1, 1.0)
    yield kv, node
    kv.close()


def test_the_gpu_path_opens_the_new_nodes_arenas_after_a_restart(scripted):
    kv, node = scripted
    into = FakeCudaArray(np.zeros((4, 8), np.float32))
    assert kv.get_tensor_into("t", into) is True and (into.host == 3).all()
    first_mapping = kv.fast_path.mapping
    node.restart()
    into.host[...] = 0
    assert kv.get_tensor_into("t", into) is True and (into.host == 3).all()
    assert kv.fast_path.stats.remaps == 1 and kv.fast_path.mapping is not first_mapping
    assert len(FakeDevicePath.opened) == 2 and FakeDevicePath.opened[0].closed
    assert node.commands().count(fp.KV_GPUARENA) == 2
    leases = [request for request in node.sent if request[0] == fp.KV_LEASEGPU]
    assert [request[1] for request in leases] == [b"A" * 16, b"A" * 16, b"B" * 16]


def test_a_mismatch_on_the_gpu_path_releases_its_lease(scripted):
    kv, node = scripted
    with pytest.raises(TensorMismatch):
        kv.get_tensor_into("t", FakeCudaArray(np.zeros((4, 8), np.float16)))
    assert node.commands()[-2:] == [fp.KV_LEASEGPU, fp.KV_RELEASE]
    assert node.sent[-1] == (fp.KV_RELEASE, 7)
    assert node.closed == 0                                  # the connection stays in its pool


def test_a_non_contiguous_cuda_destination_is_refused_before_anything_is_sent(scripted):
    kv, node = scripted
    strided = FakeCudaArray(np.zeros((4, 16), np.float32)[:, ::2])
    with pytest.raises(TypeError, match="destination tensor must be contiguous"):
        kv.get_tensor_into("t", strided)
    with pytest.raises(TypeError, match="destination tensor must be contiguous"):
        kv.get_layers("t", into=strided)
    assert node.sent == [] and kv.fast_path.mapping is None


def test_a_value_the_node_cannot_serve_from_its_arena_goes_over_the_wire(scripted):
    kv, node = scripted
    assert kv.get("k") == b"over the wire"
    assert node.commands() == [fp.KV_LEASE, "GET"]
    assert kv.fast_path.stats.wire_calls == 1 and kv.fast_path.mapping is not None

