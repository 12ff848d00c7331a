"""Tests for the GPU tier (kvstore/tiers/gpu.py).

The no-GPU behaviour runs everywhere: ``gpu_available()`` must explain itself
without raising, and ``GPUTier.open`` must raise TierError with that reason.
So do the tests on the fake cupy (tests/fakecuda), whose copies land only when
their stream is synchronized and which records the device each call ran on:
a read waits for its own stream, the IPC handle is made on the tier's device,
and a closed tier keeps its allocation. Tests marked ``gpu`` need a CUDA
device and cupy; they are skipped, with the reason, on a machine without one.
The IPC test starts a second Python process that maps the arena through its
IPC handle.
"""
from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from gpu_fakes import fake_cupy  # noqa: F401  (a fixture)
from kvstore.tiers import TierError
from kvstore.tiers.gpu import GPUTier, gpu_available

REPO = Path(__file__).resolve().parents[1]
GPU_USABLE, GPU_REASON = gpu_available()
GPU_MARK = pytest.mark.gpu
SKIP_WITHOUT_GPU = pytest.mark.skipif(not GPU_USABLE, reason=f"no usable GPU: {GPU_REASON}")


def on_gpu(test):
    """Mark ``test`` as needing a GPU and skip it, with the reason, without one."""
    return GPU_MARK(SKIP_WITHOUT_GPU(test))


def payload(index: int, size: int) -> bytes:
    return np.random.default_rng(index).bytes(size)


def test_gpu_available_explains_itself():
    usable, reason = gpu_available()
    assert isinstance(usable, bool)
    assert reason and "\n" not in reason


@pytest.mark.skipif(GPU_USABLE, reason="this machine has a usable GPU")
def test_open_without_a_gpu_is_a_clear_error():
    with pytest.raises(TierError, match="GPU tier unavailable") as caught:
        GPUTier.open(64 << 20)
    assert GPU_REASON in str(caught.value)


def test_missing_cupy_is_reported_not_raised():
    code = """
        import sys
        sys.modules["cupy"] = None          # what an environment without cupy looks like
        from kvstore.tiers import TierError
        from kvstore.tiers.gpu import GPUTier, gpu_available
        print(gpu_available())
        try:
            GPUTier.open(1 << 20)
        except TierError as exc:
            print("TierError:", exc)
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert "(False, 'cupy is not importable" in result.stdout, result.stderr
    assert "TierError: GPU tier unavailable: cupy is not importable" in result.stdout


# ------------------------------------------------------------------ on the fake cupy

def test_a_read_waits_for_its_own_stream_before_it_returns(fake_cupy):
    tier = GPUTier.open(1 << 20)
    offset = tier.alloc(8192)
    tier.write(offset, payload(5, 8192))
    out = bytearray(8192)
    assert tier.read_into(offset, 8192, out) == 8192
    assert bytes(out) == payload(5, 8192), "the copy had not landed when read_into returned"
    copies = [call for call in fake_cupy.calls if call[0] in ("get", "streamSynchronize")]
    assert copies[-2:] == [("get", tier._stream.ptr, 0), ("streamSynchronize", tier._stream.ptr, 0)]
    tier.close()


def test_the_ipc_handle_is_made_on_the_tiers_device(fake_cupy):
    fake_cupy.devices[:] = ["0000:01:00.0", "0000:02:00.0"]
    tier = GPUTier.open(1 << 20, device=1)
    assert tier.pci_bus_id == "0000:02:00.0"
    handle = tier.ipc_handle()
    assert len(handle) == 64 and tier.ipc_handle() == handle
    assert [call for call in fake_cupy.calls if call[0] == "ipcGetMemHandle"] == [("ipcGetMemHandle", 1)]
    tier.close()


def test_every_opened_arena_has_its_own_generation(fake_cupy):
    first, second = GPUTier.open(1 << 20), GPUTier.open(1 << 20)
    assert len(first.generation) == 16 and first.generation != second.generation
    first.close()
    second.close()


def test_a_closed_tier_stops_serving_but_keeps_its_allocation(fake_cupy):
    tier = GPUTier.open(1 << 20)
    pointer = tier._memory.ptr
    tier.close()
    gc.collect()
    assert pointer in fake_cupy.allocations, "clients may still have the arena mapped"
    assert tier.generation is None
    with pytest.raises(TierError, match="closed"):
        tier.ipc_handle()
    with pytest.raises(TierError, match="closed"):
        tier.read_into(0, 1, bytearray(1))


def test_a_device_that_is_not_there_is_a_clear_error(fake_cupy):
    with pytest.raises(TierError, match=r"no CUDA device 1 \(this machine has 1\)"):
        GPUTier.open(1 << 20, device=1)


# ------------------------------------------------------------------ on a real GPU

@pytest.fixture
def tier():
    opened = GPUTier.open(64 << 20)
    yield opened
    opened.close()


@on_gpu
def test_extents_round_trip_through_the_device(tier):
    sizes = [1, 4095, 4096, 100_000, 1 << 20, 3 << 20]
    placed = []
    for index, size in enumerate(sizes):
        offset = tier.alloc(size)
        assert offset is not None
        assert tier.write(offset, payload(index, size)) == size
        placed.append((offset, size))
    assert tier.used_bytes >= sum(sizes)
    for index, (offset, size) in enumerate(placed):
        out = bytearray(size + 16)
        assert tier.read_into(offset, size, out) == size
        assert out[:size] == payload(index, size)
        assert out[size:] == bytes(16)
    for offset, size in placed:
        tier.free(offset, size)
    assert tier.used_bytes == 0


@on_gpu
def test_write_accepts_views_of_host_memory(tier):
    host = bytearray(payload(1, 10_000))
    offset = tier.alloc(4000)
    tier.write(offset, memoryview(host)[1000:5000])
    tensor = np.empty(2000, dtype=np.uint16)
    tier.read_into(offset, 4000, tensor)
    assert tensor.tobytes() == bytes(host[1000:5000])


@on_gpu
def test_device_view_copies_between_extents(tier):
    first, second = tier.alloc(8192), tier.alloc(8192)
    tier.write(first, payload(2, 8192))
    tier.device_view(second, 8192)[...] = tier.device_view(first, 8192)
    out = bytearray(8192)
    tier.read_into(second, 8192, out)
    assert bytes(out) == payload(2, 8192)


@on_gpu
def test_extents_outside_the_arena_are_refused(tier):
    with pytest.raises(ValueError):
        tier.write(tier.capacity_bytes - 10, bytes(11))
    with pytest.raises(ValueError):
        tier.read_into(0, 100, bytearray(99))
    assert tier.alloc(tier.capacity_bytes + 1) is None
    assert not tier.allocator.fits(tier.capacity_bytes + 1)


@on_gpu
def test_copies_from_many_threads(tier):
    size = 256 * 1024
    offsets = [tier.alloc(size) for _ in range(32)]

    def round_trip(index: int) -> bool:
        tier.write(offsets[index], payload(index, size))
        out = bytearray(size)
        tier.read_into(offsets[index], size, out)
        return bytes(out) == payload(index, size)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(round_trip, range(32)))


@on_gpu
def test_bad_device_and_oversized_arena_are_clear_errors():
    with pytest.raises(TierError, match="no CUDA device 999"):
        GPUTier.open(1 << 20, device=999)
    with pytest.raises(TierError, match="cannot allocate"):
        GPUTier.open(1 << 50)


IPC_READER = """
    import sys
    import cupy
    handle, offset, size = bytes.fromhex(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    pointer = cupy.cuda.runtime.ipcOpenMemHandle(handle)
    memory = cupy.cuda.UnownedMemory(pointer, offset + size, owner=handle)
    view = cupy.ndarray((offset + size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    sys.stdout.write(view[offset:].get().tobytes().hex())
    sys.stdout.flush()
    cupy.cuda.runtime.ipcCloseMemHandle(pointer)
"""


@on_gpu
def test_ipc_handle_maps_the_arena_in_another_process(tier):
    offset = tier.alloc(65536)
    tier.write(offset, payload(3, 65536))
    handle = tier.ipc_handle()
    assert len(handle) == 64
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(IPC_READER), handle.hex(),
                             str(offset), "65536"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert bytes.fromhex(result.stdout) == payload(3, 65536)


@on_gpu
def test_closed_tier_refuses_copies():
    closing = GPUTier.open(1 << 20)
    closing.close()
    closing.close()
    with pytest.raises(TierError, match="closed"):
        closing.write(0, b"x")
