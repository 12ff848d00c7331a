"""The SDK's CUDA IPC path (client/gpu.py) on any machine: a real `kvstore serve` whose GPU
tier runs on the fake cupy (tests/fakecuda), and a client whose cupy is the same fake,
so the client opens the node's "device" arena from its IPC handle (a memfd mapped
through /proc) and copies out of it as it would on a GPU host. The fake's copies land
only when their stream is waited for, and it logs every call with the device current
then, so these tests see what a GPU test could not: which stream a copy ran on, that the
release came after the wait, which device the handle was opened on.

What is checked: reads device to device (the IPC path in use, at offset 0 and beyond),
the copy's order (copy, event record, event wait, then KV.RELEASE) on the caller's
stream (the asyncio client's too, though it copies on a worker thread), the handle opened on the client's device of the node's PCI bus id, an open
failure falling back to host staging once, a stale GPU generation re-opened, a close
during a copy waiting for it, one mapping shared by the clients of a process, a
mismatch or a CUDA error releasing its lease, a node restart under a live client, and a
reader racing deletes, overwrites and promotions getting one whole version every time.
"""
from __future__ import annotations

import asyncio
import signal
import threading
import time

import numpy as np
import pytest

from client import AsyncKVClient, KVClient, TensorMismatch, connection
from conftest import wait_until
from gpu_fakes import NODE_BUS_ID, fake_cupy, start_fake_gpu_node  # noqa: F401  (a fixture)
from proto import fastpath as fp

SHAPE = (64, 256)


@pytest.fixture
def node(kvstore_factory, monkeypatch):
    return start_fake_gpu_node(kvstore_factory, monkeypatch, "--promote-hits", "1")


@pytest.fixture
def kv(node, fake_cupy):
    with KVClient(unix_socket=node.unix_socket, fast_path="required") as client:
        yield client


@pytest.fixture
def releases_logged(monkeypatch, fake_cupy):
    """Each KV.RELEASE the clients send is appended to the fake's call log as it leaves."""
    send = connection.Connection.round_trip

    def logged(self, requests, sinks=None):
        fake_cupy.calls.extend((request[0],) for request in requests if request[0] == fp.KV_RELEASE)
        return send(self, requests, sinks)

    monkeypatch.setattr(connection.Connection, "round_trip", logged)


def tensor_of(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(SHAPE, dtype=np.float32)


def put_on_gpu(kv: KVClient, key: str, value: np.ndarray, *, overwrite: bool = False) -> None:
    if overwrite:
        kv.delete(key)
    kv.put_tensor(key, value)

    def moved() -> bool:
        kv.get(key)
        return kv.locate([key])[0].tier == "gpu"
    wait_until(moved, what=f"{key} to move to the GPU tier")


def calls_named(fake, *names: str) -> list[tuple]:
    return [call for call in fake.calls if call[0] in names]


def test_gpu_values_are_read_device_to_device_at_any_offset(kv, fake_cupy):
    put_on_gpu(kv, "first", tensor_of(1))
    put_on_gpu(kv, "second", tensor_of(2))              # after the first in the arena: offset > 0
    for key, seed in (("second", 2), ("first", 1)):
        into = fake_cupy.zeros(SHAPE, np.float32)
        assert kv.get_tensor_into(key, into) is True
        assert np.array_equal(fake_cupy.asnumpy(into), tensor_of(seed))
    assert kv.fast_path.stats.gpu_ipc_reads == 2 and kv.fast_path.stats.gpu_fallbacks == 0
    assert len(calls_named(fake_cupy, "ipcOpenMemHandle")) == 1
    assert kv.get_tensor_into("absent", into) is False


def test_the_copy_runs_on_the_callers_stream_and_is_waited_for_before_the_release(
        kv, fake_cupy, releases_logged):
    """The lease is released with the next request (its validity word proved the copy whole),
    never before the wait for the copy's event."""
    put_on_gpu(kv, "t", tensor_of(3))
    into = fake_cupy.zeros(SHAPE, np.float32)
    with fake_cupy.cuda.Stream(non_blocking=True) as stream:
        del fake_cupy.calls[:]
        assert kv.get_tensor_into("t", into) is True
        assert np.array_equal(fake_cupy.asnumpy(into), tensor_of(3))
        assert kv.get_tensor_into("t", into) is True
    order = calls_named(fake_cupy, "memcpyAsync", "eventRecord", "eventSynchronize", fp.KV_RELEASE)
    copy = [("memcpyAsync", fake_cupy.runtime.memcpyDeviceToDevice, stream.ptr, 0),
            ("eventRecord", stream.ptr, 0), ("eventSynchronize", 0)]
    assert order == [*copy, (fp.KV_RELEASE,), *copy]
    assert kv.fast_path.stats.gpu_ipc_reads == 2


def test_the_asyncio_client_copies_on_the_stream_current_where_it_was_called(node, fake_cupy):
    """Its copies run on a worker thread, whose own current stream is the default one."""
    async def scenario() -> None:
        async with AsyncKVClient(unix_socket=node.unix_socket, fast_path="required") as kv:
            await kv.put_tensor("t", tensor_of(13))
            while (await kv.locate(["t"]))[0].tier != "gpu":
                await kv.get("t")
                await asyncio.sleep(0.02)
            into = fake_cupy.zeros(SHAPE, np.float32)
            with fake_cupy.cuda.Stream() as stream:
                assert await kv.get_tensor_into("t", into) is True
            assert calls_named(fake_cupy, "memcpyAsync")[-1][2] == stream.ptr
            assert np.array_equal(fake_cupy.asnumpy(into), tensor_of(13))
            assert kv.fast_path.stats.gpu_ipc_reads == 1

    asyncio.run(scenario())


def test_a_dram_value_is_copied_host_to_device_on_the_callers_stream(kv, fake_cupy, releases_logged):
    kv.put_tensor("t", tensor_of(4))
    into = fake_cupy.zeros(SHAPE, np.float32)
    with fake_cupy.cuda.Stream() as stream:
        del fake_cupy.calls[:]
        assert kv.get_tensor_into("t", into) is True
        assert kv.get_tensor_into("absent", into) is False  # its lease request carries the release
    order = calls_named(fake_cupy, "memcpyAsync", "eventRecord", "eventSynchronize", fp.KV_RELEASE)
    assert order == [("memcpyAsync", fake_cupy.runtime.memcpyHostToDevice, stream.ptr, 0),
                     ("eventRecord", stream.ptr, 0), ("eventSynchronize", 0), (fp.KV_RELEASE,)]
    assert np.array_equal(fake_cupy.asnumpy(into), tensor_of(4))
    assert kv.fast_path.stats.gpu_ipc_reads == 0


def test_the_handle_is_opened_on_this_processs_device_of_the_nodes_pci_bus_id(kv, fake_cupy):
    fake_cupy.devices[:] = ["0000:07:00.0", NODE_BUS_ID]      # the node's device 0 is our device 1
    put_on_gpu(kv, "t", tensor_of(5))
    with fake_cupy.cuda.Device(1):
        into = fake_cupy.zeros(SHAPE, np.float32)
    assert kv.get_tensor_into("t", into) is True
    assert calls_named(fake_cupy, "ipcOpenMemHandle") == [("ipcOpenMemHandle", 1)]
    assert kv.fast_path.stats.gpu_ipc_reads == 1
    elsewhere = fake_cupy.zeros(SHAPE, np.float32)           # on our device 0: staged through host
    assert kv.get_tensor_into("t", elsewhere) is True
    assert np.array_equal(fake_cupy.asnumpy(elsewhere), tensor_of(5))
    assert kv.fast_path.stats.gpu_ipc_reads == 1


@pytest.mark.parametrize("failure", ["open", "device"])
def test_an_open_failure_falls_back_to_host_staging_once(kv, fake_cupy, failure):
    if failure == "open":
        fake_cupy.fail_open = "cudaErrorMapBufferObjectFailed: IPC is not allowed here"
    else:
        fake_cupy.devices[:] = ["0000:07:00.0"]               # the node's device is not visible here
    put_on_gpu(kv, "t", tensor_of(6))
    for _ in range(3):
        into = fake_cupy.zeros(SHAPE, np.float32)
        assert kv.get_tensor_into("t", into) is True
        assert np.array_equal(fake_cupy.asnumpy(into), tensor_of(6))
    stats = kv.fast_path.stats
    assert (stats.gpu_fallbacks, stats.gpu_ipc_reads) == (1, 0)
    assert len(calls_named(fake_cupy, "ipcOpenMemHandle")) == (failure == "open")


def test_a_stale_gpu_generation_opens_the_gpu_arena_again(kv, fake_cupy, monkeypatch):
    put_on_gpu(kv, "t", tensor_of(7))
    into = fake_cupy.zeros(SHAPE, np.float32)
    assert kv.get_tensor_into("t", into) is True
    send, stale = connection.Connection.round_trip, [True]

    def once_stale(self, requests, sinks=None):
        if stale[0] and requests[-1][0] == fp.KV_LEASEGPU:
            stale[0] = False
            requests = [*requests[:-1], (*requests[-1][:2], b"an older generation", *requests[-1][3:])]
        return send(self, requests, sinks)

    monkeypatch.setattr(connection.Connection, "round_trip", once_stale)
    into.fill(0)
    assert kv.get_tensor_into("t", into) is True
    assert np.array_equal(fake_cupy.asnumpy(into), tensor_of(7))
    assert kv.fast_path.stats.gpu_reopens == 1 and kv.fast_path.stats.remaps == 0
    assert [call[0] for call in calls_named(fake_cupy, "ipcOpenMemHandle", "ipcCloseMemHandle")] == [
        "ipcOpenMemHandle", "ipcCloseMemHandle", "ipcOpenMemHandle"]


def test_closing_during_a_copy_unmaps_only_after_it(kv, fake_cupy, releases_logged):
    put_on_gpu(kv, "t", tensor_of(8))
    into = fake_cupy.zeros(SHAPE, np.float32)
    assert kv.get_tensor_into("t", into) is True               # opened
    into.fill(0)
    fake_cupy.gate.clear()
    del fake_cupy.calls[:]
    results = []
    reader = threading.Thread(target=lambda: results.append(kv.get_tensor_into("t", into)))
    reader.start()
    wait_until(lambda: calls_named(fake_cupy, "eventRecord"), what="the copy to be queued")
    kv.fast_path.close()                                       # as a remap from another thread would
    assert not calls_named(fake_cupy, "ipcCloseMemHandle"), "unmapped under a queued copy"
    fake_cupy.gate.set()
    reader.join(10)
    assert results == [True] and np.array_equal(fake_cupy.asnumpy(into), tensor_of(8))
    names = [call[0] for call in fake_cupy.calls]
    assert names.index("ipcCloseMemHandle") > len(names) - 1 - names[::-1].index("eventSynchronize")


def test_the_clients_of_one_process_share_one_mapping(node, kv, fake_cupy):
    put_on_gpu(kv, "t", tensor_of(9))
    with KVClient(unix_socket=node.unix_socket, fast_path="required") as other:
        for client in (kv, other):
            into = fake_cupy.zeros(SHAPE, np.float32)
            assert client.get_tensor_into("t", into) is True
            assert client.fast_path.stats.gpu_ipc_reads == 1
    assert len(calls_named(fake_cupy, "ipcOpenMemHandle")) == 1      # CUDA opens a handle once per process
    assert not calls_named(fake_cupy, "ipcCloseMemHandle")          # kv still holds it
    kv.close()
    assert len(calls_named(fake_cupy, "ipcCloseMemHandle")) == 1


def active_leases(kv: KVClient) -> int:
    stats = kv.execute("KV.LEASES")
    return dict(zip(map(bytes, stats[::2]), stats[1::2]))[b"leases_active"]


def test_a_mismatch_or_a_cuda_error_releases_its_lease(kv, fake_cupy, monkeypatch):
    put_on_gpu(kv, "t", tensor_of(10))
    before = active_leases(kv)                 # the gets that promoted it may keep cached leases
    with pytest.raises(TensorMismatch):
        kv.get_tensor_into("t", fake_cupy.zeros(SHAPE, np.float16))

    def broken(*args):
        raise fake_cupy.CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access")

    monkeypatch.setattr(fake_cupy.runtime, "memcpyAsync", broken)
    with pytest.raises(fake_cupy.CUDARuntimeError, match="IllegalAddress"):
        kv.get_tensor_into("t", fake_cupy.zeros(SHAPE, np.float32))
    assert active_leases(kv) <= before


def test_a_node_restart_under_a_live_client_opens_the_new_nodes_gpu_arena(kvstore_factory, node, kv, fake_cupy):
    put_on_gpu(kv, "t", tensor_of(11))
    into = fake_cupy.zeros(SHAPE, np.float32)
    assert kv.get_tensor_into("t", into) is True
    kvstore_factory.restart(node, signal.SIGKILL)
    assert kv.get_tensor_into("t", into) is False                   # the new node is empty
    assert kv.fast_path.stats.remaps == 1
    put_on_gpu(kv, "t", tensor_of(12))
    into.fill(0)
    assert kv.get_tensor_into("t", into) is True
    assert np.array_equal(fake_cupy.asnumpy(into), tensor_of(12))
    assert kv.fast_path.stats.gpu_ipc_reads == 2
    assert [call[0] for call in calls_named(fake_cupy, "ipcOpenMemHandle", "ipcCloseMemHandle")] == [
        "ipcOpenMemHandle", "ipcCloseMemHandle", "ipcOpenMemHandle"]


def test_a_reader_racing_deletes_overwrites_and_promotions_gets_whole_versions(node, kv, fake_cupy):
    """Each version is a constant fill; a torn copy would mix two of them (or zeros)."""
    shape, versions = (256, 1024), 12
    put_on_gpu(kv, "t", np.full(shape, 1, np.int32))
    seen, stop = [], threading.Event()

    def rewrite() -> None:
        with KVClient(unix_socket=node.unix_socket) as writer:
            for version in range(2, versions + 1):
                put_on_gpu(writer, "t", np.full(shape, version, np.int32), overwrite=True)
        stop.set()

    writer = threading.Thread(target=rewrite)
    writer.start()
    into = fake_cupy.zeros(shape, np.int32)
    deadline = time.monotonic() + 60
    while not stop.is_set() and time.monotonic() < deadline:
        into.fill(-1)
        if kv.get_tensor_into("t", into):
            values = np.unique(fake_cupy.asnumpy(into))
            assert len(values) == 1 and 1 <= values[0] <= versions, f"a torn read: {values[:8]}"
            seen.append(int(values[0]))
    writer.join(10)
    assert stop.is_set() and len(set(seen)) > 1
    assert kv.fast_path.stats.gpu_ipc_reads > 0
