"""Tensor values and layer-wise blocks: what `KVClient.put_tensor`, `put_layer`,
`get_tensor`, `get_layers` and their relatives do.

A tensor value is a one-layer block, so both use the same commands: a writer
opens the block with its header (KV.BLOCK, idempotent, so every layer's
writer may send it) and then writes layer slots; the node commits the block
when the last slot is in. A reader asks for a range of layers, optionally
waiting for a writer that is still at work, and gets the header with them, so
the dtype and shape are checked before a byte lands in the caller's tensor.

Through the fast path a layer is one memcpy into the block's extent followed
by KV.LAYERDONE, and a read is a lease (KV.LEASELAYERS) with one memcpy out,
whole when the lease's validity word still holds its tag after the copy
(the release rides along with the next request);
over the wire the layer travels as a KV.PUTLAYER argument pipelined with
KV.BLOCK, and a read is KV.GETLAYERS. CUDA tensors are staged through host
memory here (the GPU fast path is `gpu`).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from client import tensors
from client.errors import KVError, LeaseExpired
from client.fastpath import LEASE_RETRIES, FastPath
from client.tensors import TensorSpec
from proto import fastpath as fp


class LayerIO:
    """Tensor and layer operations over a client's wire transport and fast path."""

    def __init__(self, wire, fast: FastPath | None):
        self.wire = wire
        self.fast = fast

    def _arena(self):
        return None if self.fast is None or self.fast.unavailable is not None else self.fast.arena()

    # ------------------------------------------------------------ writes

    def put(self, key, data: Any, spec: TensorSpec, layer: int, parent=None, timeout_ms: int | None = None) -> bool:
        """Write slot ``layer`` of the block ``key`` described by ``spec``; False when the key is cached."""
        host = tensors.to_host(data) if tensors.is_cuda(data) else tensors.host_view(data)
        view = memoryview(host).cast("B") if not isinstance(host, memoryview) else host
        if view.nbytes != spec.layer_bytes:
            raise ValueError(f"layer data is {view.nbytes} bytes, the block's layers are {spec.layer_bytes}")
        opened = (fp.KV_BLOCK, key, spec.header(), *(("PARENT", parent) if parent is not None else ()),
                  *(("TIMEOUT", timeout_ms) if timeout_ms is not None else ()))
        arena = self._arena()
        if arena is None:
            return self.wire.run(lambda conn: _finish_put(conn.round_trip([opened, (fp.KV_PUTLAYER, key, layer, view)])),
                                 True)

        def direct(conn) -> Callable[[], bool]:
            block = conn.round_trip([opened])[0]
            if isinstance(block, KVError) or block == 0:
                return _finish_put([block])
            offset, n_layers, layer_bytes = block
            if not 0 <= layer < n_layers:
                return _raise(KVError(f"layer index {layer} is out of range for a block of {n_layers} layers"))
            arena.write(offset + fp.HEADER_SIZE + layer * layer_bytes, view)
            return _finish_put([block, conn.round_trip([(fp.KV_LAYERDONE, key, layer)])[0]])
        return self.wire.run(direct, True)

    # ------------------------------------------------------------ reads

    def read(self, key, start: int, stop: int, into: Any = None, wait_s: float | None = None,
             framework: str = "numpy") -> Any:
        """Layers start..stop-1 (stop -1: to the last), into ``into`` or a new tensor; None when absent."""
        wait = () if wait_s is None else ("WAIT", max(1, int(wait_s * 1000)))
        arena = self._arena()
        if arena is None:
            return self.wire.run(lambda conn: self._from_wire(conn.round_trip(
                [(fp.KV_GETLAYERS, key, start, stop, *wait)])[0], start, into, framework), True)
        return self.wire.run(lambda conn: self._direct_read(conn, arena, key, start, stop, wait, into, framework),
                             True)

    def _from_wire(self, reply, start: int, into, framework: str) -> Callable[[], Any]:
        if isinstance(reply, KVError):
            return _raise(reply)
        if reply is None:
            return lambda: None
        spec, data = tensors.parse_header(reply[0]), reply[1]
        layers = len(data) // spec.layer_bytes if spec.layer_bytes else spec.n_layers - start
        if into is None:
            return lambda: tensors.from_bytes(spec, data, framework, layers)
        tensors.check_matches(spec, into, layers)
        _copy_into(into, np.frombuffer(data, np.uint8))
        return lambda: into

    def _direct_read(self, conn, arena, key, start, stop, wait, into, framework) -> Callable[[], Any]:
        fast = self.fast
        for _ in range(LEASE_RETRIES):
            reply = conn.round_trip([*fast.housekeeping(), (fp.KV_LEASELAYERS, arena.token, fast.lease_ttl_ms,
                                                            key, start, stop, *wait)])[-1]
            if isinstance(reply, KVError) or reply is None:
                return _raise(reply) if reply is not None else (lambda: None)
            lease_id, offset, nbytes, header, word, tag = reply
            spec = tensors.parse_header(header)
            layers = nbytes // spec.layer_bytes if spec.layer_bytes else 1
            if into is not None:
                tensors.check_matches(spec, into, layers)
                _copy_into(into, arena.view(offset, nbytes))
                result = into
            else:
                out = bytearray(nbytes)
                arena.read_into(offset, nbytes, memoryview(out))
                result = tensors.from_bytes(spec, out, framework, layers)
            if arena.still_valid(word, tag):
                fast.release_later([lease_id])
                return lambda: result
            if word < 0 and conn.round_trip([(fp.KV_RELEASE, lease_id)])[0] == [1]:
                return lambda: result
            fast.stats.lease_retries += 1
        return _raise(LeaseExpired(f"leases expired during {LEASE_RETRIES} copies in a row"))


def _copy_into(tensor: Any, data: np.ndarray) -> None:
    if tensors.is_cuda(tensor):
        tensors.from_host(tensor, data)
    else:
        np.copyto(np.frombuffer(tensors.host_view(tensor), np.uint8), data)


def _finish_put(replies: list) -> Callable[[], bool]:
    """KV.BLOCK's reply says whether the key was cached already; a layer's reply says it went in."""
    def finish() -> bool:
        for reply in replies:
            if isinstance(reply, KVError):
                raise reply
        return replies[0] != 0
    if replies[0] == 0:
        return lambda: False
    return finish


def _raise(error: KVError) -> Callable[[], Any]:
    def fail() -> Any:
        raise error
    return fail
