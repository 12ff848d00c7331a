"""A stand-in for cupy on a machine without a GPU: "device" memory is host memory.

With it the node's GPU tier (kvstore/tiers/gpu.py) and the SDK's CUDA IPC path
(client/gpu.py) run in CPU tests, across processes, and every call they make
can be watched. A node gets it through PYTHONPATH (this folder first); a test
process loads it under the name ``cupy`` for the length of one test
(tests/gpu_fakes.py). It models what the code under test depends on, and
nothing else (no kernels, no memory pool):

- devices, by PCI bus id: ``FAKE_CUDA_DEVICES`` (comma-separated bus ids, in
  this process's device order; default one device) or the ``devices`` list;
  ``Device(n)`` fails for a device that is not there, as ``cudaSetDevice`` does;
- streams as queues: a copy given a stream (``memcpyAsync``, ``ndarray.set``
  and ``ndarray.get`` with ``stream=``) lands only when its stream is
  synchronized, or when an event recorded after it is waited for; a copy with
  no stream lands at once (cupy's blocking defaults), so code that forgets to
  wait reads stale bytes here;
- CUDA IPC: an allocation (``cuda.Memory``) is a memfd; its handle names the
  exporting process and fd, and another process maps it through /proc. A
  process may not open its own handle, nor open a handle it holds open
  already (CUDA's rules); closing unmaps it, so a copy from it afterwards fails;
- failures on demand: ``fail_open`` (a message) makes ``ipcOpenMemHandle``
  raise; ``gate`` (an Event, set by default) holds ``eventSynchronize`` back;
- ``calls``: what was done, in order, each with the device current then.
"""
from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import struct
import threading
import weakref
from types import SimpleNamespace

import numpy as np

uint8, int32, float16, float32, float64 = np.uint8, np.int32, np.float16, np.float32, np.float64

devices: list[str] = os.environ.get("FAKE_CUDA_DEVICES", "0000:01:00.0").split(",")
calls: list[tuple] = []
fail_open: str | None = None
gate = threading.Event()
gate.set()

_local = threading.local()
_regions: dict[int, int] = {}                 # start address -> size of live "device" memory
allocations: weakref.WeakValueDictionary = weakref.WeakValueDictionary()   # address -> live Memory
_mapped: dict[bytes, tuple] = {}              # handle -> (pointer, mmap, numpy view) opened here
_ids = itertools.count(0x1000)
IPC_MAGIC = b"FAKEIPC\0"


class CUDARuntimeError(RuntimeError):
    pass


def is_available() -> bool:
    return bool(devices)


def _device() -> int:
    return getattr(_local, "device", 0)


def _record(*call) -> None:
    calls.append((*call, _device()))


def _check_device(index: int) -> None:
    if not 0 <= index < len(devices):
        raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {index}")


def _check_device_memory(ptr: int, nbytes: int) -> None:
    for start, size in _regions.items():
        if start <= ptr and ptr + nbytes <= start + size:
            return
    raise CUDARuntimeError(f"cudaErrorInvalidValue: {nbytes} bytes at {ptr:#x} are not device memory")


def _address(array: np.ndarray) -> int:
    return array.ctypes.data


# ------------------------------------------------------------------ devices and streams

class Device:
    def __init__(self, device: int | None = None):
        self.id = _device() if device is None else device

    def __enter__(self) -> Device:
        _check_device(self.id)
        stack = _local.__dict__.setdefault("stack", [])
        stack.append(_device())
        _local.device = self.id
        return self

    def __exit__(self, *exc) -> None:
        _local.device = _local.stack.pop()


class Stream:
    _by_ptr: dict[int, Stream] = {}

    def __init__(self, non_blocking: bool = False, *, ptr: int | None = None):
        self.ptr = next(_ids) if ptr is None else ptr
        self.device_id = _device()
        self._pending: list = []
        self._issued = self._done = 0
        self._lock = threading.Lock()
        Stream._by_ptr[self.ptr] = self

    def enqueue(self, run) -> None:
        with self._lock:
            self._issued += 1
            self._pending.append((self._issued, run))

    def run_until(self, mark: int) -> None:
        with self._lock:
            while self._pending and self._pending[0][0] <= mark:
                self._done, run = self._pending.pop(0)
                run()

    def synchronize(self) -> None:
        _record("streamSynchronize", self.ptr)
        self.run_until(self._issued)

    def __enter__(self) -> Stream:
        _local.__dict__.setdefault("streams", []).append(get_current_stream())
        _local.stream = self
        return self

    def __exit__(self, *exc) -> None:
        _local.stream = _local.streams.pop()


Stream.null = Stream(ptr=0)


def get_current_stream() -> Stream:
    return getattr(_local, "stream", Stream.null)


def _stream(ptr: int) -> Stream:
    if ptr not in Stream._by_ptr:
        raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: no stream {ptr:#x}")
    return Stream._by_ptr[ptr]


# ------------------------------------------------------------------ memory

class Memory:
    """A device allocation: a memfd, so another process can map it from its IPC handle."""

    def __init__(self, size: int):
        _check_device(_device())
        self.size = size
        self.device_id = _device()
        self.fd = os.memfd_create("fake-cuda")
        os.ftruncate(self.fd, max(size, 1))
        self._map = mmap.mmap(self.fd, max(size, 1))
        self.array = np.frombuffer(self._map, np.uint8)[:size]
        self.ptr = _address(self.array)
        _regions[self.ptr] = size
        allocations[self.ptr] = self
        weakref.finalize(self, _free, self.ptr, self.fd)


def _free(ptr: int, fd: int) -> None:
    """An allocation went away (its memory with it): copies from it fail from now on."""
    _regions.pop(ptr, None)
    os.close(fd)


class MemoryPointer:
    def __init__(self, mem, offset: int):
        self.mem = mem
        self.ptr = mem.ptr + offset


class ndarray:
    """A "device" array over host memory (a view of a Memory, or its own buffer)."""

    def __init__(self, shape, dtype=float, memptr: MemoryPointer | None = None, *, _host=None):
        if _host is None:
            dtype = np.dtype(dtype)
            count = int(np.prod(shape))
            if memptr is None:
                _host = np.zeros(count, dtype).reshape(shape)
                _regions[_address(_host)] = _host.nbytes
            else:
                offset = memptr.ptr - memptr.mem.ptr
                _host = memptr.mem.array[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)
        self._host = _host
        self.device = SimpleNamespace(id=_device())
        self.data = SimpleNamespace(ptr=_address(_host))

    shape = property(lambda self: self._host.shape)
    dtype = property(lambda self: self._host.dtype)
    size = property(lambda self: self._host.size)
    nbytes = property(lambda self: self._host.nbytes)
    flags = property(lambda self: SimpleNamespace(c_contiguous=self._host.flags.c_contiguous))

    def _like(self, host: np.ndarray) -> ndarray:
        view = ndarray(None, _host=host)
        view.device = self.device
        return view

    def __getitem__(self, index) -> ndarray:
        return self._like(self._host[index])

    def reshape(self, *shape) -> ndarray:
        return self._like(self._host.reshape(*shape))

    def view(self, dtype) -> ndarray:
        return self._like(self._host.view(dtype))

    def fill(self, value) -> None:
        self._host.fill(value)

    def set(self, source, stream: Stream | None = None) -> None:
        copy = partial_copy(self._host.reshape(-1).view(np.uint8), np.asarray(source).reshape(-1).view(np.uint8))
        _record("set", None if stream is None else stream.ptr)
        copy() if stream is None else stream.enqueue(copy)

    def get(self, stream: Stream | None = None, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty(self.shape, self.dtype) if out is None else out
        copy = partial_copy(out.reshape(-1).view(np.uint8), self._host.reshape(-1).view(np.uint8))
        _record("get", None if stream is None else stream.ptr)
        copy() if stream is None else stream.enqueue(copy)
        return out


def partial_copy(target: np.ndarray, source: np.ndarray):
    def copy() -> None:
        target[:] = source
    return copy


def empty(shape, dtype=float) -> ndarray:
    return ndarray(shape, dtype)


def zeros(shape, dtype=float) -> ndarray:
    return ndarray(shape, dtype)


def asarray(host) -> ndarray:
    array = ndarray(np.shape(host), np.asarray(host).dtype)
    array._host[...] = host
    return array


def asnumpy(array: ndarray) -> np.ndarray:
    return array._host.copy()


# ------------------------------------------------------------------ the runtime API

memcpyHostToHost, memcpyHostToDevice, memcpyDeviceToHost, memcpyDeviceToDevice, memcpyDefault = range(5)
eventDisableTiming = 2
_events: dict[int, tuple[Stream, int]] = {}


def getDeviceCount() -> int:
    return len(devices)


def getDevice() -> int:
    return _device()


def deviceGetPCIBusId(device: int) -> str:
    _check_device(device)
    return devices[device]


def deviceGetByPCIBusId(bus_id: str) -> int:
    if bus_id not in devices:
        raise CUDARuntimeError(f"cudaErrorInvalidDevice: no device with PCI bus id {bus_id}")
    return devices.index(bus_id)


def memcpy(dst: int, src: int, size: int, kind: int) -> None:
    _record("memcpy", kind)
    _copier(dst, src, size, kind)()


def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:
    _record("memcpyAsync", kind, stream)
    _stream(stream).enqueue(_copier(dst, src, size, kind))


def _copier(dst: int, src: int, size: int, kind: int):
    if kind in (memcpyDeviceToDevice, memcpyDeviceToHost):
        _check_device_memory(src, size)
    if kind in (memcpyDeviceToDevice, memcpyHostToDevice):
        _check_device_memory(dst, size)
    return lambda: ctypes.memmove(dst, src, size)


def streamSynchronize(stream: int) -> None:
    _stream(stream).synchronize()


def eventCreateWithFlags(flags: int) -> int:
    event = next(_ids)
    _events[event] = (Stream.null, 0)
    return event


def eventRecord(event: int, stream: int) -> None:
    _record("eventRecord", stream)
    recorded = _stream(stream)
    _events[event] = (recorded, recorded._issued)


def eventSynchronize(event: int) -> None:
    if not gate.wait(30):
        raise CUDARuntimeError("the test never opened the gate")
    _record("eventSynchronize")
    recorded, mark = _events[event]
    recorded.run_until(mark)


def eventDestroy(event: int) -> None:
    del _events[event]


def ipcGetMemHandle(ptr: int) -> bytes:
    _record("ipcGetMemHandle")
    memory = allocations[ptr]
    return struct.pack("<8sqqq", IPC_MAGIC, os.getpid(), memory.fd, memory.size).ljust(64, b"\0")


def ipcOpenMemHandle(handle: bytes, flags: int = 1) -> int:
    _record("ipcOpenMemHandle")
    _check_device(_device())
    if fail_open:
        raise CUDARuntimeError(fail_open)
    magic, pid, fd, size = struct.unpack_from("<8sqqq", handle)
    if magic != IPC_MAGIC:
        raise CUDARuntimeError("cudaErrorInvalidValue: not an IPC handle")
    if pid == os.getpid():
        raise CUDARuntimeError("cudaErrorDeviceUninitialized: a process cannot open its own handle")
    if handle in _mapped:
        raise CUDARuntimeError("cudaErrorAlreadyMapped: the handle is open in this process already")
    with open(f"/proc/{pid}/fd/{fd}", "r+b") as file:
        mapping = mmap.mmap(file.fileno(), max(size, 1))
    view = np.frombuffer(mapping, np.uint8)[:size]
    ptr = _address(view)
    _mapped[handle] = (ptr, mapping, view)
    _regions[ptr] = size
    return ptr


def ipcCloseMemHandle(ptr: int) -> None:
    _record("ipcCloseMemHandle")
    handle = next((h for h, opened in _mapped.items() if opened[0] == ptr), None)
    if handle is None:
        raise CUDARuntimeError(f"cudaErrorInvalidValue: {ptr:#x} is not an opened IPC mapping")
    _, mapping, view = _mapped.pop(handle)
    del _regions[ptr], view
    mapping.close()


runtime = SimpleNamespace(
    CUDARuntimeError=CUDARuntimeError, getDeviceCount=getDeviceCount, getDevice=getDevice,
    deviceGetPCIBusId=deviceGetPCIBusId, deviceGetByPCIBusId=deviceGetByPCIBusId, memcpy=memcpy,
    memcpyAsync=memcpyAsync, streamSynchronize=streamSynchronize, eventCreateWithFlags=eventCreateWithFlags,
    eventRecord=eventRecord, eventSynchronize=eventSynchronize, eventDestroy=eventDestroy,
    ipcGetMemHandle=ipcGetMemHandle, ipcOpenMemHandle=ipcOpenMemHandle, ipcCloseMemHandle=ipcCloseMemHandle,
    memcpyHostToHost=memcpyHostToHost, memcpyHostToDevice=memcpyHostToDevice,
    memcpyDeviceToHost=memcpyDeviceToHost, memcpyDeviceToDevice=memcpyDeviceToDevice,
    memcpyDefault=memcpyDefault, eventDisableTiming=eventDisableTiming)
cuda = SimpleNamespace(runtime=runtime, Device=Device, Stream=Stream, Memory=Memory, MemoryPointer=MemoryPointer,
                       get_current_stream=get_current_stream)
