"""Tensor values and layer-wise blocks: what `put_tensor`, `put_layer`, `get_tensor`,
`get_tensor_into`, `get_layers` and the tensor batches send, over the wire or through the arena.

A tensor value is a one-layer block, so both use the same commands: a writer
opens the block with its header (KV.BLOCK, idempotent, so every layer's
writer may send it) and then writes layer slots; the node commits the block
when the last slot is in. A reader asks for a range of layers, optionally
waiting for a writer that is still at work, and gets the header with them, so
the dtype and shape are checked before a byte lands in the caller's tensor.

Over the wire a layer travels as a KV.PUTLAYER argument pipelined with
KV.BLOCK, and a read is KV.GETLAYERS. Through the fast path a layer is one
memcpy into the block's extent between KV.BLOCK and KV.LAYERDONE, both
carrying the token of the mapping (a restarted node answers STALEARENA, and
the core maps its new arena before anything is marked written), and a read is
a lease (KV.LEASELAYERS) with one memcpy out, whole when the lease's validity
word still holds its tag after the copy. A CUDA source is staged through host
memory; a CUDA destination of a whole tensor is read device to device where
the node has a GPU tier (`gpu`), else staged too. Destinations must be
contiguous (a strided view would be written past, or a temporary written
instead) and are refused before anything is sent.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Sequence

import numpy as np

from client import gpu, tensors
from client.buffers import Key, readable_view
from client.errors import KVError, LeaseExpired
from client.fastpath import LEASE_RETRIES, REMAPPED, Detour, FastPath
from client.operations import Items, with_parents
from client.steps import Local, RoundTrip, Steps
from client.tensors import TensorSpec
from proto import fastpath as fp


@dataclass
class Each:
    """Operations run one after another as one call (the tensor batches)."""

    ops: list


# ------------------------------------------------------------------ writes

@dataclass
class LayerWrite:
    """Slot ``layer`` of the block ``key`` that ``spec`` describes, from ``data``."""

    key: Key
    data: Any
    spec: TensorSpec
    layer: int
    parent: Key | None = None
    timeout_ms: int | None = None
    _host: memoryview | None = field(default=None, init=False, repr=False)

    def over_wire(self, core) -> Steps:
        view = yield from self._staged()
        return (yield from core.on_connection(partial(self._send, view), True))

    def through_arena(self, core) -> Steps:
        view = yield from self._staged()
        return (yield from core.on_connection(partial(_open_copy_mark, core, self, view), True))

    def open_request(self, token: bytes | None = None) -> tuple:
        return (fp.KV_BLOCK, self.key, self.spec.header(),
                *(("PARENT", self.parent) if self.parent is not None else ()),
                *(("TIMEOUT", self.timeout_ms) if self.timeout_ms is not None else ()),
                *(("TOKEN", token) if token is not None else ()))

    def _staged(self) -> Steps:
        """The layer as a flat host byte view (a CUDA tensor is copied to host memory once)."""
        if self._host is None:
            if tensors.is_cuda(self.data):
                self._host = readable_view((yield Local(partial(tensors.to_host, self.data))))
            else:
                self._host = tensors.host_view(self.data)
        return self._host

    def _send(self, view: memoryview, conn) -> Steps:
        opened, written = yield RoundTrip([self.open_request(), (fp.KV_PUTLAYER, self.key, self.layer, view)])
        if opened == 0:
            return False                    # cached already: the layer was refused, as it should be
        for reply in (opened, written):
            if isinstance(reply, KVError):
                raise reply
        return True


def _open_copy_mark(core, op: LayerWrite, view: memoryview, conn) -> Steps:
    """Open the block, copy the layer into its slot, mark it written; False when cached."""
    fast = core.fast
    arena = fast.mapping
    if arena is None:
        return REMAPPED
    block = (yield RoundTrip([*fast.housekeeping(), op.open_request(arena.token)]))[-1]
    if (detour := fast.detour(block)) is not None:
        return detour
    if block == 0:
        return False
    offset, n_layers, layer_bytes = block
    if not 0 <= op.layer < n_layers or layer_bytes != view.nbytes:
        raise KVError(f"the block holds {n_layers} layers of {layer_bytes} bytes, "
                      f"not layer {op.layer} of {view.nbytes} bytes")
    write = partial(arena.write, offset + fp.HEADER_SIZE + op.layer * layer_bytes, view)
    yield from core.copy(write, view.nbytes)
    marked = (yield RoundTrip([(fp.KV_LAYERDONE, arena.token, op.key, op.layer)]))[0]
    if (detour := fast.detour(marked)) is not None:
        return detour
    return True


def put_tensor(key: Key, tensor: Any, parent: Key | None) -> LayerWrite:
    return LayerWrite(key, tensor, tensors.spec_of(tensor), 0, parent)


def put_layer(key: Key, layer: int, data: Any, n_layers: int, parent: Key | None,
              timeout_ms: int | None) -> LayerWrite:
    if n_layers < 1 or not 0 <= layer < n_layers:
        raise ValueError(f"layer index {layer} is out of range for a block of {n_layers} layers")
    return LayerWrite(key, data, tensors.spec_of(data, n_layers, layered=True), layer, parent, timeout_ms)


def batch_put_tensors(items: Items, parents: Sequence[Key | None] | None) -> Each:
    pairs, links = with_parents(items, parents)
    return Each([put_tensor(key, tensor, parent) for (key, tensor), parent in zip(pairs, links)])


# ------------------------------------------------------------------ reads

@dataclass
class LayerRead:
    """Layers start..stop-1 (stop -1: to the last) of ``key``, into ``into`` or a new tensor.

    ``found_only``: the result is whether the value was there (get_tensor_into),
    and a CUDA ``into`` may be read device to device."""

    key: Key
    start: int
    stop: int
    into: Any = None
    wait_s: float | None = None
    framework: str = "numpy"
    found_only: bool = False

    def __post_init__(self) -> None:
        if self.into is not None:
            tensors.check_destination(self.into)

    def over_wire(self, core) -> Steps:
        return self._result((yield from core.on_connection(partial(self._fetch, core), True)))

    def through_arena(self, core) -> Steps:
        if self.found_only and tensors.is_cuda(self.into):
            device = yield from gpu.opened(core, self.into)
            if device is not None:
                return self._result((yield from gpu.read_into(core, device, self.key, self.into)))
        return self._result((yield from core.on_connection(partial(_lease_and_copy, core, self), True)))

    def lease_request(self, fast: FastPath, token: bytes) -> tuple:
        return (fp.KV_LEASELAYERS, token, fast.lease_ttl_ms, self.key, self.start, self.stop, *self._wait())

    def copy_out(self, spec: TensorSpec, layers: int, source: Any) -> Any:
        """The layers from ``source`` (host bytes) into ``into`` or a new tensor."""
        if self.into is None:            # a reply's bytearray is ours already; arena bytes are copied out
            owned = source if isinstance(source, bytearray) else bytearray(source)
            return tensors.from_bytes(spec, owned, self.framework, layers)
        if tensors.is_cuda(self.into):
            tensors.from_host(self.into, np.frombuffer(source, np.uint8))
        else:
            np.copyto(np.frombuffer(tensors.host_view(self.into), np.uint8), np.frombuffer(source, np.uint8))
        return self.into

    def checked_spec(self, header: Any, nbytes: int) -> tuple[TensorSpec, int]:
        """The stored spec and how many layers ``nbytes`` hold, after checking ``into`` against them."""
        spec = tensors.parse_header(header)
        layers = nbytes // spec.layer_bytes if spec.layer_bytes else spec.layers_in(self.start, self.stop)
        if self.into is not None:
            tensors.check_matches(spec, self.into, layers)
        return spec, layers

    def _fetch(self, core, conn) -> Steps:
        reply = (yield RoundTrip([(fp.KV_GETLAYERS, self.key, self.start, self.stop, *self._wait())]))[0]
        if isinstance(reply, KVError):
            raise reply
        if reply is None:
            return None
        header, data = reply
        spec, layers = self.checked_spec(header, len(data))
        return (yield from core.copy(partial(self.copy_out, spec, layers, data), len(data)))

    def _wait(self) -> tuple:
        return () if self.wait_s is None else ("WAIT", max(1, int(self.wait_s * 1000)))

    def _result(self, value: Any) -> Any:
        if isinstance(value, Detour) or not self.found_only:
            return value
        return value is not None


def _lease_and_copy(core, op: LayerRead, conn) -> Steps:
    """Lease the layers, copy them out, and check the copy; None when the block is absent."""
    fast = core.fast
    arena = fast.mapping
    if arena is None:
        return REMAPPED
    for _ in range(LEASE_RETRIES):
        reply = (yield RoundTrip([*fast.housekeeping(), op.lease_request(fast, arena.token)]))[-1]
        if (detour := fast.detour(reply)) is not None:
            return detour
        if reply is None:
            return None
        lease_id, offset, nbytes, header, word, tag = reply
        try:
            spec, layers = op.checked_spec(header, nbytes)
        except KVError:
            yield RoundTrip([(fp.KV_RELEASE, lease_id)])      # a mismatch leaves nothing held
            raise
        result = yield from core.copy(partial(op.copy_out, spec, layers, arena.view(offset, nbytes)), nbytes)
        if arena.still_valid(word, tag):
            fast.release_later([lease_id])
            return result
        if word < 0 and (yield RoundTrip([(fp.KV_RELEASE, lease_id)]))[0] == [1]:
            return result
        fast.stats.lease_retries += 1
    raise LeaseExpired(f"leases expired during {LEASE_RETRIES} copies in a row")


def get_layers(key: Key, start: int, stop: int | None, into: Any, wait_s: float | None,
               framework: str) -> LayerRead:
    return LayerRead(key, start, -1 if stop is None else stop, into, wait_s, framework)


def get_tensor(key: Key, framework: str) -> LayerRead:
    return LayerRead(key, 0, -1, framework=framework)


def get_tensor_into(key: Key, tensor: Any) -> LayerRead:
    return LayerRead(key, 0, -1, tensor, found_only=True)


def batch_get_tensors_into(keys: Sequence[Key], tensors_: Sequence[Any]) -> Each:
    if len(keys) != len(tensors_):
        raise ValueError(f"{len(keys)} keys but {len(tensors_)} tensors")
    return Each([get_tensor_into(key, tensor) for key, tensor in zip(keys, tensors_)])
