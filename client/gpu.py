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
GPU tier (or without cupy and a device) `GPUPath.open` returns None and the
callers stage through host memory as before.
"""
from __future__ import annotations

from typing import Any

from client import tensors
from client.errors import KVError, LeaseExpired
from client.fastpath import LEASE_RETRIES, FastPath
from proto import fastpath as fp


class GPUPath:
    """The node's device arena opened in this process, and reads from it."""

    def __init__(self, cupy, device: int, base_ptr: int, size: int):
        self._cupy = cupy
        self.device = device
        self.base_ptr = base_ptr
        self.size = size

    @classmethod
    def open(cls, wire, fast: FastPath) -> GPUPath | None:
        """Open the node's GPU arena; None when the node has no GPU tier or this process no GPU."""
        try:
            import cupy
            if not cupy.is_available():
                return None
        except Exception:   # cupy missing, or a CUDA install that fails to import
            return None
        reply = wire.run(lambda conn: _value(conn.round_trip([(fp.KV_GPUARENA,)])[0]), True)
        if reply is None or isinstance(reply, KVError):
            return None
        device, handle, size = reply
        with cupy.cuda.Device(device):
            base = cupy.cuda.runtime.ipcOpenMemHandle(bytes(handle))
        return cls(cupy, device, base, size)

    def read_into(self, wire, fast: FastPath, key, tensor: Any) -> bool:
        """Copy the tensor value of ``key`` into the CUDA ``tensor``; False when absent."""
        arena = fast.arena()
        for _ in range(LEASE_RETRIES):
            entry = wire.run(lambda conn: _value(conn.round_trip(
                [(fp.KV_LEASEGPU, arena.token, fast.lease_ttl_ms, key)])[0]), True)
            if isinstance(entry, KVError):
                raise entry
            if entry[0] is None:
                return False
            lease_id, tier, offset, size = entry[0]
            self._copy(tier, offset, size, arena, tensor)
            valid = wire.run(lambda conn: _value(conn.round_trip([(fp.KV_RELEASE, lease_id)])[0]), True)
            if valid == [1]:
                return True
            fast.stats.lease_retries += 1
        raise LeaseExpired(f"the value of {key!r} moved during {LEASE_RETRIES} copies in a row")

    def _copy(self, tier: bytes, offset: int, size: int, arena, tensor: Any) -> None:
        header_end = offset + fp.HEADER_SIZE
        if bytes(tier) == b"dram":
            spec = tensors.parse_header(arena.view(offset, fp.HEADER_SIZE))
            tensors.check_matches(spec, tensor)
            tensors.from_host(tensor, arena.view(header_end, size - fp.HEADER_SIZE))
            return
        runtime = self._cupy.cuda.runtime
        header = bytearray(fp.HEADER_SIZE)
        runtime.memcpy(_host_ptr(header), self.base_ptr + offset, fp.HEADER_SIZE, runtime.memcpyDeviceToHost)
        tensors.check_matches(tensors.parse_header(header), tensor)
        runtime.memcpy(_device_ptr(tensor), self.base_ptr + header_end, size - fp.HEADER_SIZE,
                       runtime.memcpyDeviceToDevice)

    def close(self) -> None:
        with self._cupy.cuda.Device(self.device):
            self._cupy.cuda.runtime.ipcCloseMemHandle(self.base_ptr)


def _value(reply: Any):
    return lambda: reply


def _host_ptr(buffer: bytearray) -> int:
    import ctypes
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _device_ptr(tensor: Any) -> int:
    return tensor.data_ptr() if tensors.kind_of(tensor) == "torch:cuda" else tensor.data.ptr
