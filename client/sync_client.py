"""KVClient: the blocking SDK for putting and getting KV-cache blocks.

Each method builds a `Call` (see `operations`) and hands it to the transport,
which runs it as one round trip on a connection borrowed from a thread-safe
pool, so one client can be shared by many threads. Batches are pipelined: all
requests are written with one `sendmsg`, then all replies are read.
Connection errors are retried on a new connection where `RetryPolicy`
allows; server error replies are raised as `ResponseError` after the whole
round trip has been read.

Values are returned as `bytearray` (received in place at their exact size;
converting to `bytes` would copy them); `get_into` and `batch_get_into`
receive into the caller's own buffers. Either way only the first bytes of a
value, those that arrive together with its reply header, pass through the
connection's receive buffer; the rest goes straight to its destination.
"""
from __future__ import annotations

from typing import Any, Sequence

from client import operations as ops
from client.buffers import Key
from client.hashing import BlockHasher
from client import tensors
from client.fastpath import FastPath, FastTransport
from client.gpu import GPUPath
from client.layers import LayerIO
from client.operations import Items, Location, Value
from client.sockets import Endpoint
from client.transport import WireTransport
from proto.fastpath import LEASE_TTL_MS
from proto.wire import DEFAULT_HOST, DEFAULT_PORT


class KVClient:
    """A client of one store node, over TCP or a Unix socket (the socket wins when both are given)."""

    def __init__(self, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *,
                 password: str | None = None, unix_socket: str | None = None,
                 timeout: float | None = 5.0, retries: int = 3, pool_size: int = 8,
                 fast_path: str = "auto", lease_ttl_ms: int = LEASE_TTL_MS):
        self.endpoint = Endpoint(host, port, unix_socket)
        self.fast_path = FastPath(self.endpoint, password, timeout, fast_path, lease_ttl_ms)
        wire = WireTransport(self.endpoint, password=password, timeout=timeout,
                             retries=retries, pool_size=pool_size)
        self._transport = wire if fast_path == "off" else FastTransport(wire, self.fast_path)
        self._layers = LayerIO(wire, None if fast_path == "off" else self.fast_path)
        self._gpu: GPUPath | None | bool = False         # False: not looked for yet

    def put(self, key: Key, value: Value, *, parent: Key | None = None, overwrite: bool = False) -> bool:
        """Store value under key (KV.PUT); False when the key existed and overwrite is False."""
        return self._transport.execute(ops.put(key, value, parent, overwrite))

    def get(self, key: Key) -> bytearray | None:
        """The value of key, or None when it is not cached."""
        return self._transport.execute(ops.get(key))

    def get_into(self, key: Key, buffer: Any) -> int | None:
        """Receive key's value into a writable buffer; its length, or None when not cached.

        Raises BufferTooSmall (the connection stays usable) when the value does not fit.
        """
        return self._transport.execute(ops.get_into(key, buffer))

    def exists(self, *keys: Key) -> int:
        """How many of keys are cached (a key named twice counts twice, as in Redis)."""
        return self._transport.execute(ops.exists(keys))

    def delete(self, *keys: Key) -> int:
        """Remove keys; how many existed."""
        return self._transport.execute(ops.delete(keys))

    def batch_put(self, items: Items, *, parents: Sequence[Key | None] | None = None,
                  overwrite: bool = False) -> list[bool]:
        """put() for many (key, value) pairs (a mapping or pairs) in one round trip.

        parents, when given, holds one parent key (or None) per item.
        """
        return self._transport.execute(ops.batch_put(items, parents, overwrite))

    def batch_get(self, keys: Sequence[Key]) -> list[bytearray | None]:
        """get() for many keys in one round trip."""
        return self._transport.execute(ops.batch_get(keys))

    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int | None]:
        """get_into() for many keys, one buffer each, in one round trip."""
        return self._transport.execute(ops.batch_get_into(keys, buffers))

    # -------------------------------------------------------- tensors and layers

    def put_tensor(self, key: Key, tensor: Any, *, parent: Key | None = None) -> bool:
        """Store a numpy array, torch tensor or cupy array with its dtype and shape (put-once)."""
        return self._layers.put(key, tensor, tensors.spec_of(tensor), 0, parent)

    def get_tensor(self, key: Key, *, framework: str = "numpy") -> Any:
        """The tensor stored under key ("numpy", "torch" or "cupy"), or None when not cached."""
        return self._layers.read(key, 0, -1, framework=framework)

    def get_tensor_into(self, key: Key, tensor: Any) -> bool:
        """Copy the stored tensor into ``tensor``; False when not cached.

        Raises TensorMismatch when the dtype or shape differ (nothing is copied).
        """
        gpu = self._gpu_path() if tensors.is_cuda(tensor) else None
        if gpu is not None:
            return gpu.read_into(self._layers.wire, self.fast_path, key, tensor)
        return self._layers.read(key, 0, -1, into=tensor) is not None

    def _gpu_path(self) -> GPUPath | None:
        """The node's GPU arena over CUDA IPC, opened on first use (None without one)."""
        if self._gpu is False:
            local = self.fast_path.mode != "off" and self.fast_path.arena() is not None
            self._gpu = GPUPath.open(self._layers.wire, self.fast_path) if local else None
        return self._gpu

    def batch_put_tensors(self, items: Items, *, parents: Sequence[Key | None] | None = None) -> list[bool]:
        pairs = list(items.items()) if isinstance(items, dict) else list(items)
        links = parents or [None] * len(pairs)
        return [self.put_tensor(k, t, parent=p) for (k, t), p in zip(pairs, links)]

    def batch_get_tensors_into(self, keys: Sequence[Key], tensors_: Sequence[Any]) -> list[bool]:
        return [self.get_tensor_into(k, t) for k, t in zip(keys, tensors_)]

    def put_layer(self, key: Key, layer: int, data: Any, *, n_layers: int, parent: Key | None = None,
                  timeout_ms: int | None = None) -> bool:
        """Write layer ``layer`` of a block of ``n_layers`` equal layers shaped like ``data``.

        The block becomes visible (GET, KV.MATCH) when its last layer is in; one left
        unfinished for ``timeout_ms`` (30 s by default) after its last progress is dropped.
        False when the block is already cached.
        """
        if n_layers < 1 or not 0 <= layer < n_layers:
            raise ValueError(f"layer index {layer} is out of range for a block of {n_layers} layers")
        return self._layers.put(key, data, tensors.spec_of(data, n_layers, layered=True), layer, parent,
                                timeout_ms)

    def get_layers(self, key: Key, start: int = 0, stop: int | None = None, *, into: Any = None,
                   wait: float | None = None, framework: str = "numpy") -> Any:
        """Layers start..stop-1 of a block (shape (stop-start, *layer shape)), or None when absent.

        ``into`` receives them (a tensor of that shape, or of one layer's shape for a
        single layer); ``wait`` seconds waits for a writer still at work (an error on
        timeout; keep it under the client's ``timeout``, which bounds every reply).
        """
        return self._layers.read(key, start, -1 if stop is None else stop, into, wait, framework)

    def match_prefix(self, keys: Sequence[Key]) -> int:
        """How many leading keys of a chain are cached (KV.MATCH, one round trip)."""
        return self._transport.execute(ops.match_prefix(keys))

    def match_tokens(self, hasher: BlockHasher, token_ids: Any) -> int:
        """How many leading tokens of a prompt are cached (whole blocks only)."""
        return self._transport.execute(ops.match_tokens(hasher, token_ids))

    def locate(self, keys: Sequence[Key]) -> list[Location | None]:
        """Per key, its tier and size, or None when not cached (KV.LOCATE)."""
        return self._transport.execute(ops.locate(keys))

    def stats(self) -> dict[str, int]:
        """The node's cache counters (KV.STATS): hits, misses, keys, evictions, bytes per tier."""
        return self._transport.execute(ops.stats())

    def ping(self) -> bool:
        """True when the node answers PONG."""
        return self._transport.execute(ops.ping())

    def execute(self, *args: Any) -> Any:
        """Send any command; its parsed reply (never retried, errors raised)."""
        return self._transport.execute(ops.execute(args))

    def close(self) -> None:
        """Close the pooled connections; the client cannot be used afterwards."""
        if self._gpu:
            self._gpu.close()
        self._transport.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVClient({self.endpoint})"
