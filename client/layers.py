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

The layer batches (`batch_put_layers`, `batch_get_layers`) move many slots
with a fixed number of round trips: over the wire, one pipelined round trip
(KV.BLOCK once per block, then a KV.PUTLAYER per slot; a KV.GETLAYERS per
block); through the arena, one round trip opening every block, the copies,
and one round trip of KV.LAYERDONEs (a KV.LEASELAYERS per block, the copies,
releases riding with the next request). Every item is tried; the first error
reply is raised once the batch is done, as `batch_put` does.
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

    def open_request(self, token: bytes | None = None, header: bytes | None = None) -> tuple:
        return (fp.KV_BLOCK, self.key, header or self.spec.header(),
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


@dataclass
class LayerWrites:
    """Several layer slots (of one or more blocks) in a fixed number of round trips; a result per slot:
    True written, False when its block is cached already."""

    writes: list[LayerWrite]

    def over_wire(self, core) -> Steps:
        views = yield from self._staged()
        if not self.writes:
            return []
        return (yield from core.on_connection(partial(self._send, views), True))

    def through_arena(self, core) -> Steps:
        views = yield from self._staged()
        if not self.writes:
            return []
        return (yield from core.on_connection(partial(_open_copy_mark_many, core, self, views), True))

    def _staged(self) -> Steps:
        if not any(tensors.is_cuda(write.data) for write in self.writes):
            return [tensors.host_view(write.data) for write in self.writes]
        views = []
        for write in self.writes:
            views.append((yield from write._staged()))
        return views

    def _send(self, views: list[memoryview], conn) -> Steps:
        """KV.BLOCK before each block's first slot, a KV.PUTLAYER per slot: one round trip."""
        requests, opened_at, put_at, header = [], {}, [], _headers()
        for write, view in zip(self.writes, views):
            if write.key not in opened_at:
                opened_at[write.key] = len(requests)
                requests.append(write.open_request(header=header(write.spec)))
            put_at.append(len(requests))
            requests.append((fp.KV_PUTLAYER, write.key, write.layer, view))
        replies = yield RoundTrip(requests)
        results, errors = [], []
        for write, at in zip(self.writes, put_at):
            opened = replies[opened_at[write.key]]
            if opened == 0:
                results.append(False)       # cached already: the slot was refused, as it should be
                continue
            error = opened if isinstance(opened, KVError) else replies[at]
            if isinstance(error, KVError):
                errors.append(error)
                results.append(False)
            else:
                results.append(True)
        return _raise_first(errors, results)


def _open_copy_mark_many(core, op: LayerWrites, views: list[memoryview], conn) -> Steps:
    """Open every block (one round trip), copy the slots into their extents, mark them written
    (one round trip)."""
    fast = core.fast
    arena = fast.mapping
    if arena is None:
        return REMAPPED
    opened_at: dict[Any, int] = {}
    opens, header = [], _headers()
    for write in op.writes:
        if write.key not in opened_at:
            opened_at[write.key] = len(opens)
            opens.append(write.open_request(arena.token, header(write.spec)))
    ahead = fast.housekeeping()
    replies = (yield RoundTrip([*ahead, *opens]))[len(ahead):]
    errors: list[KVError] = []
    blocks: list[Any] = []
    for reply in replies:
        try:
            if (detour := fast.detour(reply)) is not None:
                return detour               # nothing copied yet: run again (re-opening is idempotent)
        except KVError as exc:
            errors.append(exc)
            reply = exc
        blocks.append(reply)
    results: list[bool] = [False] * len(op.writes)
    copies, marks, marked = [], [], []
    for i, (write, view) in enumerate(zip(op.writes, views)):
        block = blocks[opened_at[write.key]]
        if block == 0 or isinstance(block, KVError):
            continue
        offset, n_layers, layer_bytes = block
        if not 0 <= write.layer < n_layers or layer_bytes != view.nbytes:
            errors.append(KVError(f"the block holds {n_layers} layers of {layer_bytes} bytes, "
                                  f"not layer {write.layer} of {view.nbytes} bytes"))
            continue
        copies.append((offset + fp.HEADER_SIZE + write.layer * layer_bytes, view))
        marks.append((fp.KV_LAYERDONE, arena.token, write.key, write.layer))
        marked.append(i)
    if not marks:
        return _raise_first(errors, results)

    def copy_all() -> None:
        for at, view in copies:
            arena.write(at, view)
    yield from core.copy(copy_all, sum(view.nbytes for _, view in copies))
    for i, reply in zip(marked, (yield RoundTrip(marks))):
        try:
            if (detour := fast.detour(reply)) is not None:
                return detour               # the node restarted: nothing was marked in its new arena
            results[i] = True
        except KVError as exc:              # e.g. another writer of the same block marked this slot
            errors.append(exc)
    return _raise_first(errors, results)


def _contiguous(data: Any) -> bool:
    return data.is_contiguous() if hasattr(data, "is_contiguous") else bool(data.flags.c_contiguous)


def _headers() -> Any:
    """A header per spec, packed once for all the blocks of a batch that share it."""
    packed: dict[int, bytes] = {}

    def header(spec: TensorSpec) -> bytes:
        got = packed.get(id(spec))
        if got is None:
            got = packed[id(spec)] = spec.header()
        return got
    return header


def _raise_first(errors: list[KVError], results: list) -> list:
    if errors:
        raise errors[0]
    return results


def put_tensor(key: Key, tensor: Any, parent: Key | None) -> LayerWrite:
    return LayerWrite(key, tensor, tensors.spec_of(tensor), 0, parent)


def put_layer(key: Key, layer: int, data: Any, n_layers: int, parent: Key | None,
              timeout_ms: int | None) -> LayerWrite:
    if n_layers < 1 or not 0 <= layer < n_layers:
        raise ValueError(f"layer index {layer} is out of range for a block of {n_layers} layers")
    return LayerWrite(key, data, tensors.spec_of(data, n_layers, layered=True), layer, parent, timeout_ms)


def batch_put_layers(items: Sequence[tuple[Key, int, Any]], n_layers: int,
                     parents: Sequence[Key | None] | None, timeout_ms: int | None) -> LayerWrites:
    items = list(items)
    links = [None] * len(items) if parents is None else list(parents)
    if len(links) != len(items):
        raise ValueError(f"{len(items)} items but {len(links)} parents")
    specs: dict[tuple, TensorSpec] = {}          # slots of one batch are mostly alike: one spec each kind
    writes = []
    for (key, layer, data), parent in zip(items, links):
        if n_layers < 1 or not 0 <= layer < n_layers:
            raise ValueError(f"layer index {layer} is out of range for a block of {n_layers} layers")
        kind = (type(data), str(data.dtype), tuple(data.shape))
        spec = specs.get(kind)
        if spec is None:
            spec = specs[kind] = tensors.spec_of(data, n_layers, layered=True)
        elif not _contiguous(data):
            tensors.spec_of(data, n_layers, layered=True)      # raises: not contiguous
        writes.append(LayerWrite(key, data, spec, layer, parent, timeout_ms))
    return LayerWrites(writes)


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


@dataclass
class LayerReads:
    """The same range of layers of several blocks in a fixed number of round trips; a result per block
    (its tensor, or None when absent)."""

    reads: list[LayerRead]

    def over_wire(self, core) -> Steps:
        if not self.reads:
            return []
        return (yield from core.on_connection(partial(self._fetch, core), True))

    def through_arena(self, core) -> Steps:
        if not self.reads:
            return []
        return (yield from core.on_connection(partial(_lease_and_copy_many, core, self), True))

    def _fetch(self, core, conn) -> Steps:
        replies = yield RoundTrip([(fp.KV_GETLAYERS, r.key, r.start, r.stop, *r._wait()) for r in self.reads])
        results, errors = [], []
        for read, reply in zip(self.reads, replies):
            result = None
            try:
                if isinstance(reply, KVError):
                    raise reply
                if reply is not None:
                    header, data = reply
                    spec, layers = read.checked_spec(header, len(data))
                    result = yield from core.copy(partial(read.copy_out, spec, layers, data), len(data))
            except KVError as exc:
                errors.append(exc)
            results.append(result)
        return _raise_first(errors, results)


def _lease_and_copy_many(core, op: LayerReads, conn) -> Steps:
    """Lease every block's layers (one round trip), copy them out, check each copy; a block whose
    lease expired under its copy is read again on its own."""
    fast = core.fast
    arena = fast.mapping
    if arena is None:
        return REMAPPED
    ahead = fast.housekeeping()
    replies = (yield RoundTrip([*ahead, *(r.lease_request(fast, arena.token) for r in op.reads)]))[len(ahead):]
    leased = [reply[0] for reply in replies if isinstance(reply, list)]
    for reply in replies:
        detour = None
        try:
            detour = fast.detour(reply)
        except KVError:
            pass
        if detour is not None:
            if leased:
                yield RoundTrip([(fp.KV_RELEASE, *leased)])
            return detour
    results, errors, done = [], [], []
    for read, reply in zip(op.reads, replies):
        result = None
        try:
            if isinstance(reply, KVError):
                raise reply
            if reply is not None:
                lease_id, offset, nbytes, header, word, tag = reply
                done.append(lease_id)
                spec, layers = read.checked_spec(header, nbytes)
                result = yield from core.copy(partial(read.copy_out, spec, layers, arena.view(offset, nbytes)),
                                              nbytes)
                if not arena.still_valid(word, tag):
                    fast.stats.lease_retries += 1
                    result = yield from _lease_and_copy(core, read, conn)
                    if isinstance(result, Detour):
                        fast.release_later(done)
                        return result
        except KVError as exc:
            errors.append(exc)
        results.append(result)
    if done:
        fast.release_later(done)
    return _raise_first(errors, results)


def batch_get_layers(keys: Sequence[Key], start: int, stop: int | None, into: Sequence[Any] | None,
                     wait_s: float | None, framework: str) -> LayerReads:
    if into is not None and len(into) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(into)} destinations")
    return LayerReads([LayerRead(key, start, -1 if stop is None else stop, None if into is None else into[i],
                                 wait_s, framework) for i, key in enumerate(keys)])


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
