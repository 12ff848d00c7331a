"""The GPU tier: one device arena carved into extents by the buddy allocator.

Why one arena: ``cudaMalloc`` per value costs far more than the copy of a KV
block and fragments device memory, so the tier allocates its whole size once
at start-up and hands out extents with the same
:class:`kvstore.store.allocator.BuddyAllocator` as the DRAM arena. The tier manager
(kvstore/tiers/manager.py) asks for an extent (``alloc``), copies in (``write``) and
out (``read_into``) on its worker threads, and gives it back (``free``).

Why ``cupy.cuda.Memory`` and not ``cupy.empty``: ``cupy.empty`` draws from
cupy's memory pool, whose underlying allocation may start before the array.
A CUDA IPC handle names a whole allocation, so a peer process opening
``ipc_handle()`` must find the arena at offset 0 of it; a direct allocation
guarantees that.

Copies run on a dedicated non-blocking stream, and every call synchronizes
that stream before it returns (a device-to-host ``get`` included: cupy's
blocking default is not relied on), so they can be issued from the tier
manager's worker threads without queueing behind other work on the default
stream, and the caller may use or reuse its host buffer at once. Host buffers
are ordinary (pageable) memory; the driver stages them. ``device_view`` gives
a cupy view of an extent for device-to-device copies. Every call that touches
the device selects the tier's device first, so ``--gpu-device N`` never
creates a context on device 0.

What local clients map: KV.GPUARENA hands out the arena's IPC handle with the
device's PCI bus id (device numbers differ between processes that see
different ``CUDA_VISIBLE_DEVICES``) and a generation token, fresh for every
allocation; KV.LEASEGPU carries the token back, so a client whose mapping is
not of this arena is told so before it is given an offset. ``close`` stops
serving (the token is withdrawn) but keeps the allocation until the process
exits: a client may still have it mapped, and CUDA does not promise that
memory another process has open stays out of the next ``cudaMalloc``.

Without a usable GPU (cupy not installed, no driver, no device)
``gpu_available()`` says why, without raising, and ``GPUTier.open`` raises
:class:`TierError` with that reason: the daemon turns it into a startup error
when the operator asked for the tier, and into one log line otherwise.
"""
from __future__ import annotations

import secrets
import threading

import numpy as np

from kvstore.store.allocator import BuddyAllocator
from kvstore.tiers import TierError

GENERATION_BYTES = 16
_RETIRED: list = []               # closed arenas' allocations, kept until the process exits


def gpu_available() -> tuple[bool, str]:
    """Whether a CUDA device is usable through cupy, and a one-line reason."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA install that breaks the import
        return False, f"cupy is not importable ({exc})"
    try:
        if not cupy.is_available():
            return False, "cupy finds no usable CUDA device (no GPU, or no driver)"
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: driver missing or too old
        return False, f"CUDA runtime error: {exc}"
    return True, f"{count} CUDA device(s)"


class GPUTier:
    """Extents of one device arena; copies to and from host buffers."""

    def __init__(self, cupy, device_id: int, memory, stream, min_unit: int, pci_bus_id: str):
        self.device_id = device_id
        self.pci_bus_id = pci_bus_id
        self.generation: bytes | None = secrets.token_bytes(GENERATION_BYTES)   # None once closed
        self._cupy = cupy
        self._memory = memory
        self._stream = stream
        self._arena = cupy.ndarray((memory.size,), dtype=cupy.uint8,
                                   memptr=cupy.cuda.MemoryPointer(memory, 0))
        self._handle: bytes | None = None
        self.allocator = BuddyAllocator(memory.size, min_unit)
        self._lock = threading.Lock()     # guards the allocator

    @classmethod
    def open(cls, size: int, device: int = 0, *, min_unit: int = 4096) -> GPUTier:
        """Allocate a ``size``-byte arena on CUDA device ``device``; TierError says why not."""
        usable, reason = gpu_available()
        if not usable:
            raise TierError(f"GPU tier unavailable: {reason}")
        if size <= 0:
            raise ValueError(f"GPU tier size must be positive, not {size}")
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
        if not 0 <= device < count:
            raise TierError(f"GPU tier: no CUDA device {device} (this machine has {count})")
        try:
            with cupy.cuda.Device(device):
                memory = cupy.cuda.Memory(size)
                stream = cupy.cuda.Stream(non_blocking=True)
            pci_bus_id = cupy.cuda.runtime.deviceGetPCIBusId(device)
        except Exception as exc:  # CUDARuntimeError: out of memory, device busy, ...
            raise TierError(f"GPU tier: cannot allocate {size} bytes on device {device}: {exc}") from exc
        return cls(cupy, device, memory, stream, min_unit, pci_bus_id)

    # -- extents -------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.capacity

    @property
    def used_bytes(self) -> int:
        return self.allocator.used

    def alloc(self, size: int) -> int | None:
        """Offset of a free extent of ``size`` bytes, or None when full."""
        with self._lock:
            return self.allocator.alloc(size)

    def free(self, offset: int, size: int) -> None:
        with self._lock:
            self.allocator.free(offset, size)

    # -- copies --------------------------------------------------------------

    def write(self, offset: int, host_buffer) -> int:
        """Copy ``host_buffer`` into the arena at ``offset``; bytes copied."""
        source = np.frombuffer(memoryview(host_buffer).cast("B"), dtype=np.uint8)
        with self._on_device():
            self.device_view(offset, len(source)).set(source, stream=self._stream)
            self._stream.synchronize()
        return len(source)

    def read_into(self, offset: int, size: int, host_buffer) -> int:
        """Copy ``size`` bytes at ``offset`` into ``host_buffer``; bytes copied, all landed."""
        target = np.frombuffer(memoryview(host_buffer).cast("B"), dtype=np.uint8)
        if len(target) < size:
            raise ValueError(f"buffer of {len(target)} bytes cannot hold {size} bytes")
        with self._on_device():
            self.device_view(offset, size).get(stream=self._stream, out=target[:size])
            self._stream.synchronize()
        return size

    def _on_device(self):
        """A fresh device context per call: a cupy Device keeps a per-object
        stack of previous devices, so one shared across threads would race."""
        return self._cupy.cuda.Device(self.device_id)

    def device_view(self, offset: int, size: int):
        """A cupy uint8 array over the extent, for device-to-device copies."""
        if self._arena is None:
            raise TierError("GPU tier is closed")
        if offset < 0 or size < 0 or offset + size > self._arena.size:
            raise ValueError(f"extent [{offset}, {offset + size}) is outside the "
                             f"{self._arena.size}-byte arena")
        return self._arena[offset:offset + size]

    def ipc_handle(self) -> bytes:
        """CUDA IPC handle of the arena (made on the tier's device); offsets in it equal the tier's."""
        if self._arena is None:
            raise TierError("GPU tier is closed")
        if self._handle is None:
            with self._on_device():
                self._handle = bytes(self._cupy.cuda.runtime.ipcGetMemHandle(self._memory.ptr))
        return self._handle

    def close(self) -> None:
        """Wait for pending copies and stop serving: no more copies, handles or leases (the
        generation is withdrawn). The allocation stays until the process exits, since
        clients may still have it mapped."""
        if self._arena is None:
            return
        with self._on_device():
            self._stream.synchronize()
        _RETIRED.append(self._memory)
        self._arena = self._memory = self._stream = None
        self.generation = None
