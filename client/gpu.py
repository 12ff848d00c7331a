"""The GPU fast path: device-to-device reads from the node's GPU tier over CUDA IPC.

When the node keeps a value in its GPU arena and the caller's destination is
a CUDA tensor on the same host, the bytes need not visit host memory: the
node hands out a CUDA IPC handle of its whole device arena once
(KV.GPUARENA), the client opens it (``ipcOpenMemHandle``), and each read is a
lease (KV.LEASEGPU: the value's tier and offset) followed by one
device-to-device ``cudaMemcpy`` into the caller's tensor and a release whose
answer says whether the value stayed put (a delete or a move to another tier
during the copy makes the release answer 0, and the read is retried).

A value that lives in DRAM comes back from KV.LEASEGPU as a DRAM lease and is
copied host-to-device from the arena mapping: one copy either way. Without a
GPU tier (or without cupy and a device) `opened` gives None and the callers
stage through host memory as before.

KV.LEASEGPU carries the DRAM arena's token: a node that restarted answers
STALEARENA, and the fast path drops its mappings, this one included, so the
next read maps the new node's arenas. A lease whose header does not match the
destination (`TensorMismatch`) is released before the error is raised.
"""
from __future__ import annotations

import ctypes
from functools import partial
from typing import Any

from client import tensors
from client.arena import Arena
from client.errors import KVError, LeaseExpired
from client.fastpath import LEASE_RETRIES, REMAPPED, FastPath
from client.steps import Local, RoundTrip, Steps
from proto import fastpath as fp


class GPUPath:
    """The node's device arena opened in this process, and copies out of it."""

    def __init__(self, cupy, device: int, base_ptr: int, size: int):
        self._cupy = cupy
        self.device = device
        self.base_ptr = base_ptr
        self.size = size

    @classmethod
    def open(cls, cupy, reply: list) -> GPUPath:
        device, handle, size = reply
        with cupy.cuda.Device(device):
            base = cupy.cuda.runtime.ipcOpenMemHandle(bytes(handle))
        return cls(cupy, device, base, size)

    def header(self, tier: bytes, offset: int, arena: Arena) -> bytes:
        """The value's tensor header, from the DRAM mapping or the device."""
        if bytes(tier) == b"dram":
            return bytes(arena.view(offset, fp.HEADER_SIZE))
        header = bytearray(fp.HEADER_SIZE)
        runtime = self._cupy.cuda.runtime
        runtime.memcpy(_host_ptr(header), self.base_ptr + offset, fp.HEADER_SIZE, runtime.memcpyDeviceToHost)
        return bytes(header)

    def copy(self, tier: bytes, offset: int, size: int, arena: Arena, tensor: Any) -> None:
        """The value's data (after its header) into the CUDA ``tensor``: one copy."""
        start, nbytes = offset + fp.HEADER_SIZE, size - fp.HEADER_SIZE
        if bytes(tier) == b"dram":
            tensors.from_host(tensor, arena.view(start, nbytes))
            return
        runtime = self._cupy.cuda.runtime
        runtime.memcpy(_device_ptr(tensor), self.base_ptr + start, nbytes, runtime.memcpyDeviceToDevice)

    def close(self) -> None:
        with self._cupy.cuda.Device(self.device):
            self._cupy.cuda.runtime.ipcCloseMemHandle(self.base_ptr)


def opened(core) -> Steps:
    """The node's GPU arena, opened on first use; None when it has none or this process no GPU."""
    fast: FastPath = core.fast
    if fast.gpu is False:
        cupy = yield Local(_usable_cupy)
        reply = None if cupy is None else (yield from core.on_connection(_gpu_arena, True))
        device = None if reply is None else (yield Local(partial(GPUPath.open, cupy, reply)))
        with fast.lock:
            keep = fast.gpu is False and fast.mapping is not None
            if keep:
                fast.gpu = device
        if device is not None and not keep:
            device.close()
    return fast.gpu or None


def read_into(core, device: GPUPath, key, tensor: Any) -> Steps:
    """Copy the tensor value of ``key`` into the CUDA ``tensor``: the tensor, or None when absent."""
    return (yield from core.on_connection(partial(_lease_copy_release, core.fast, device, key, tensor), True))


def _lease_copy_release(fast: FastPath, device: GPUPath, key, tensor: Any, conn) -> Steps:
    arena = fast.mapping
    if arena is None:
        return REMAPPED
    for _ in range(LEASE_RETRIES):
        entries = (yield RoundTrip([*fast.housekeeping(), (fp.KV_LEASEGPU, arena.token, fast.lease_ttl_ms, key)]))[-1]
        if (detour := fast.detour(entries)) is not None:
            return detour
        if entries[0] is None:
            return None
        lease_id, tier, offset, size = entries[0]
        header = device.header(tier, offset, arena)               # 128 bytes: not worth a thread
        try:
            tensors.check_matches(tensors.parse_header(header), tensor)
        except KVError:
            yield RoundTrip([(fp.KV_RELEASE, lease_id)])      # a mismatch leaves nothing held
            raise
        yield Local(partial(device.copy, tier, offset, size, arena, tensor))
        if (yield RoundTrip([(fp.KV_RELEASE, lease_id)]))[0] == [1]:
            return tensor
        fast.stats.lease_retries += 1
    raise LeaseExpired(f"the value of {key!r} moved during {LEASE_RETRIES} copies in a row")


def _usable_cupy():
    try:
        import cupy
        return cupy if cupy.is_available() else None
    except Exception:   # cupy missing, or a CUDA install that fails to import
        return None


def _gpu_arena(conn) -> Steps:
    reply = (yield RoundTrip([(fp.KV_GPUARENA,)]))[0]
    return None if reply is None or isinstance(reply, KVError) else reply


def _host_ptr(buffer: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _device_ptr(tensor: Any) -> int:
    return tensor.data_ptr() if tensors.kind_of(tensor) == "torch:cuda" else tensor.data.ptr
