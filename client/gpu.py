"""The GPU fast path: device-to-device reads from the node's GPU tier over CUDA IPC.

When the node keeps a value in its GPU arena and the caller's destination is
a CUDA tensor on the same host, the bytes need not visit host memory: the
node hands out a CUDA IPC handle of its whole device arena (KV.GPUARENA), the
client opens it once, and each read is a lease (KV.LEASEGPU: the value's tier,
offset and tensor header, so the destination is checked before a byte moves)
and one copy into the caller's tensor. While a lease lives its bytes stay
put (a GPU extent is neither freed nor reused), so a copy finished while the
lease's validity word still holds its tag is whole, and the lease is released
with the client's next request; otherwise the release's answer says whether
the lease lasted (0: the copy may be torn, and the read is retried). A value
that lives in DRAM comes back from KV.LEASEGPU as a DRAM lease and is copied
host-to-device from the arena mapping: one copy either way.

Which stream, and when the tensor is ready: every copy is issued on the
caller's current stream of the destination's device (torch's
``torch.cuda.current_stream()`` for a torch tensor, cupy's current stream for
a cupy array), so it is ordered after the work the caller already queued
there, and an event recorded after it is waited for before the lease's
validity is read and before it is released. The node may free or rewrite the
extent as soon as the lease ends, so neither may overtake the copy. When the
call returns the data is in the tensor, ready on every stream.

Which device: the node sends its device's PCI bus id, and the client opens
the handle on its own device of that bus id (device numbers differ between
processes that see different ``CUDA_VISIBLE_DEVICES``). A destination on
another device is staged through host memory as before.

Opened once per process: CUDA lets a process open a given IPC handle only
once, so every client of the node in this process shares one `GPUPath`,
counted; it is unmapped when the last one closes it and no copy out of it is
in flight (a close during a copy waits for the copy's end).

What can go wrong:
- Opening fails (the device is not visible here, no peer access, a container
  that forbids CUDA IPC): the client stages through host memory from then on
  (until it maps a restarted node's arena), counts it in
  ``stats.gpu_fallbacks`` and logs it once; it does not try again per read.
- The node restarted: KV.LEASEGPU carries the DRAM arena's token, the node
  answers STALEARENA, and the fast path drops its mappings, this one
  included, so the next read maps the new node's arenas.
- The GPU arena is not the one this client opened (KV.LEASEGPU carries its
  generation: a GPU tier closed, or opened anew): STALEGPU, and this mapping
  alone is dropped and opened again.
- A header that does not match the destination (`TensorMismatch`), or a CUDA
  error during the copy: the lease is released before the error is raised.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from functools import partial
from typing import Any

from client import tensors
from client.arena import Arena
from client.errors import KVError, LeaseExpired, ResponseError
from client.fastpath import LEASE_RETRIES, REMAPPED, FastPath
from client.steps import Local, RoundTrip, Steps
from proto import fastpath as fp

log = logging.getLogger("kvstore.client")


class Unmapped(Exception):
    """The mapping was closed (the client closed, or another thread dropped it) before a copy began."""


@dataclass(frozen=True)
class GPUArena:
    """What KV.GPUARENA says of the node's device arena that a client uses."""

    pci_bus_id: str
    handle: bytes
    generation: bytes

    @classmethod
    def from_reply(cls, reply: list) -> GPUArena:
        _node_device, pci_bus_id, handle, _size, generation = reply    # the node's number is not ours
        return cls(bytes(pci_bus_id).decode(), bytes(handle), bytes(generation))


_open_paths: dict[bytes, GPUPath] = {}        # IPC handle -> its mapping in this process
_open_lock = threading.Lock()                 # guards _open_paths and every path's counters


class GPUPath:
    """The node's device arena opened in this process, and copies out of it."""

    def __init__(self, cupy, device: int, base_ptr: int, arena: GPUArena):
        self._cupy = cupy
        self.device = device                  # this process's number of the node's device
        self.base_ptr = base_ptr
        self.generation = arena.generation
        self._handle = arena.handle
        self._users = 0                       # clients holding this mapping
        self._copying = 0                     # copies in flight out of it
        self._unmapped = False

    @classmethod
    def open(cls, cupy, reply: list) -> GPUPath:
        """The mapping of the arena KV.GPUARENA describes: opened on our device of its
        PCI bus id, or shared with the other clients in this process that opened it.
        Raises cupy's CUDARuntimeError when it cannot be opened here."""
        arena = GPUArena.from_reply(reply)
        with _open_lock:
            path = _open_paths.get(arena.handle)
            if path is None:
                runtime = cupy.cuda.runtime
                device = runtime.deviceGetByPCIBusId(arena.pci_bus_id)
                with cupy.cuda.Device(device):
                    base = runtime.ipcOpenMemHandle(arena.handle)
                path = _open_paths[arena.handle] = cls(cupy, device, base, arena)
            path._users += 1
        return path

    def serves(self, tensor: Any) -> bool:
        """Whether ``tensor`` lives on this arena's device (else it is staged through host memory)."""
        if tensors.kind_of(tensor) == "torch:cuda":
            return tensor.device.index == self.device
        return tensor.device.id == self.device

    def stream_of(self, tensor: Any) -> int:
        """The caller's current stream for ``tensor`` (a raw cudaStream_t), read in the caller's
        thread: the asyncio client copies on a worker thread, whose current stream is another."""
        if tensors.kind_of(tensor) == "torch:cuda":
            import torch
            return torch.cuda.current_stream(tensor.device).cuda_stream
        with self._cupy.cuda.Device(self.device):
            return self._cupy.cuda.get_current_stream().ptr

    def copy(self, tier: bytes, offset: int, size: int, arena: Arena, tensor: Any, stream: int) -> None:
        """The value's data (after its header) into the CUDA ``tensor`` on ``stream``: one copy,
        finished when this returns."""
        start, nbytes = offset + fp.HEADER_SIZE, size - fp.HEADER_SIZE
        runtime = self._cupy.cuda.runtime
        if bytes(tier) == b"dram":
            source, kind = arena.view(start, nbytes).ctypes.data, runtime.memcpyHostToDevice
        else:
            source, kind = self.base_ptr + start, runtime.memcpyDeviceToDevice
        self._copy_and_wait(_device_ptr(tensor), source, nbytes, kind, stream)

    def _copy_and_wait(self, destination: int, source: int, nbytes: int, kind: int, stream: int) -> None:
        """Queue the copy on ``stream``, record an event after it and wait for that event,
        with the mapping held open meanwhile."""
        self._begin()
        try:
            runtime = self._cupy.cuda.runtime
            with self._cupy.cuda.Device(self.device):
                event = runtime.eventCreateWithFlags(runtime.eventDisableTiming)
                try:
                    runtime.memcpyAsync(destination, source, nbytes, kind, stream)
                    runtime.eventRecord(event, stream)
                    runtime.eventSynchronize(event)
                finally:
                    runtime.eventDestroy(event)
        finally:
            self._end()

    def _begin(self) -> None:
        with _open_lock:
            if self._unmapped:
                raise Unmapped("the GPU arena was closed in this process")
            self._copying += 1

    def _end(self) -> None:
        with _open_lock:
            self._copying -= 1
            unmap = self._take_unmap()
        if unmap:
            self._unmap()

    def close(self) -> None:
        """This client is done with the mapping; the last one unmaps it, after any copy in flight."""
        with _open_lock:
            self._users -= 1
            unmap = self._take_unmap()
        if unmap:
            self._unmap()

    def _take_unmap(self) -> bool:
        """With the lock held: whether the caller must unmap now (no user and no copy left)."""
        if self._users or self._copying or self._unmapped:
            return False
        self._unmapped = True
        del _open_paths[self._handle]
        return True

    def _unmap(self) -> None:
        with self._cupy.cuda.Device(self.device):
            self._cupy.cuda.runtime.ipcCloseMemHandle(self.base_ptr)


def opened(core, tensor: Any) -> Steps:
    """The node's GPU arena, opened on first use, when it can serve ``tensor``; None when the
    node has no GPU tier, this process cannot open it, or ``tensor`` is on another device."""
    fast: FastPath = core.fast
    if fast.gpu is False:
        yield from _look_for_arena(core)
    path = fast.gpu
    return path if path and path.serves(tensor) else None


def _look_for_arena(core) -> Steps:
    """Ask the node for its GPU arena and open it; remember the outcome, a failure included."""
    fast: FastPath = core.fast
    cupy = yield Local(_usable_cupy)
    reply = None if cupy is None else (yield from core.on_connection(_gpu_arena, True))
    outcome = None if reply is None else (yield Local(partial(_open_or_failure, cupy, reply)))
    failure = outcome if isinstance(outcome, Exception) else None
    path = None if failure is not None else outcome
    with fast.lock:
        keep = fast.gpu is False and fast.mapping is not None
        if keep:
            fast.gpu = path
            fast.stats.gpu_fallbacks += failure is not None
    if keep and failure is not None:
        log.warning("cannot open the node's GPU arena here (%s); CUDA destinations are staged through "
                    "host memory", failure)
    if path is not None and not keep:
        path.close()


def _open_or_failure(cupy, reply: list) -> GPUPath | Exception:
    try:
        return GPUPath.open(cupy, reply)
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return exc


def read_into(core, path: GPUPath, key, tensor: Any) -> Steps:
    """Copy the tensor value of ``key`` into the CUDA ``tensor``: the tensor, or None when absent."""
    stream = path.stream_of(tensor)
    return (yield from core.on_connection(partial(_lease_copy_release, core.fast, path, key, tensor, stream),
                                          True))


def _lease_copy_release(fast: FastPath, path: GPUPath, key, tensor: Any, stream: int, conn) -> Steps:
    arena = fast.mapping
    if arena is None:
        return REMAPPED
    for _ in range(LEASE_RETRIES):
        lease = (fp.KV_LEASEGPU, arena.token, path.generation, fast.lease_ttl_ms, key)
        reply = (yield RoundTrip([*fast.housekeeping(), lease]))[-1]
        if isinstance(reply, ResponseError) and reply.code == "STALEGPU":
            _drop(fast, path)
            return REMAPPED
        if (detour := fast.detour(reply)) is not None:
            return detour
        if reply[0] is None:
            return None
        lease_id, tier, offset, size, word, tag, header = reply[0]
        try:
            tensors.check_matches(tensors.parse_header(_header(tier, offset, header, arena)), tensor)
        except KVError:
            yield RoundTrip([(fp.KV_RELEASE, lease_id)])      # a mismatch leaves nothing held
            raise
        failure = yield Local(partial(_failure_of, path.copy, tier, offset, size, arena, tensor, stream))
        if failure is None and arena.still_valid(word, tag):  # read after the copy finished
            fast.release_later([lease_id])
            return _copied(fast, tier, tensor)
        valid = (yield RoundTrip([(fp.KV_RELEASE, lease_id)]))[0] == [1]   # only now: the copy is done
        if isinstance(failure, Unmapped):
            return REMAPPED
        if failure is not None:
            raise failure
        if valid:
            return _copied(fast, tier, tensor)
        fast.stats.lease_retries += 1
    raise LeaseExpired(f"the value of {key!r} moved during {LEASE_RETRIES} copies in a row")


def _header(tier: bytes, offset: int, header: bytes, arena: Arena) -> bytes:
    """The value's tensor header: a GPU value's comes with its lease, a DRAM value's is in the mapping."""
    return bytes(arena.view(offset, fp.HEADER_SIZE)) if bytes(tier) == b"dram" else bytes(header)


def _copied(fast: FastPath, tier: bytes, tensor: Any) -> Any:
    if bytes(tier) == b"gpu":
        fast.stats.gpu_ipc_reads += 1
    return tensor


def _failure_of(run, *args) -> Exception | None:
    """Run a copy; the exception it raised, as a value (the lease is released before it is raised)."""
    try:
        run(*args)
    except Exception as exc:
        return exc
    return None


def _drop(fast: FastPath, path: GPUPath) -> None:
    """Forget a GPU mapping the node no longer serves, so the next read opens its arena again."""
    with fast.lock:
        mine = fast.gpu is path
        if mine:
            fast.gpu = False
            fast.stats.gpu_reopens += 1
    if mine:
        path.close()


def _usable_cupy():
    try:
        import cupy
        return cupy if cupy.is_available() else None
    except Exception:   # cupy missing, or a CUDA install that fails to import
        return None


def _gpu_arena(conn) -> Steps:
    reply = (yield RoundTrip([(fp.KV_GPUARENA,)]))[0]
    return None if reply is None or isinstance(reply, KVError) else reply


def _device_ptr(tensor: Any) -> int:
    return tensor.data_ptr() if tensors.kind_of(tensor) == "torch:cuda" else tensor.data.ptr
