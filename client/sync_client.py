"""KVClient: the blocking SDK for putting and getting KV-cache blocks.

Each method builds an operation (a `Call` from `operations`, or a tensor or
layer operation from `layers`) and hands it to the blocking transport, which
runs it through the sans-I/O `core` on connections borrowed from a
thread-safe pool, so one client can be shared by many threads. Batches are
pipelined: all requests are written with one `sendmsg`, then all replies are
read.
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

from client import arena_reads, layers
from client import operations as ops
from client.base import BaseClient
from client.buffers import Key
from client.hashing import BlockHasher
from client.operations import Items, Location, Value
from client.transport import Transport


class KVClient(BaseClient):
    """A blocking client of one store node, shared safely by many threads."""

    transport_class = Transport

    def put(self, key: Key, value: Value, *, parent: Key | None = None, overwrite: bool = False) -> bool:
        """Store value under key (KV.PUT); False when the key existed and overwrite is False."""
        self._settled((key,))
        return self._transport.execute(ops.put(key, value, parent, overwrite))

    def get(self, key: Key) -> bytearray | None:
        """The value of key, or None when it is not cached."""
        self._settled((key,))
        return self._transport.execute(ops.get(key))

    def get_into(self, key: Key, buffer: Any) -> int | None:
        """Receive key's value into a writable buffer; its length, or None when not cached.

        Raises BufferTooSmall (the connection stays usable) when the value does not fit.
        """
        self._settled((key,))
        served = arena_reads.get_into_here(self.fast_path, key, buffer)     # no round trip needed
        return self._transport.execute(ops.get_into(key, buffer)) if served is arena_reads.ASK_NODE else served

    def exists(self, *keys: Key) -> int:
        """How many of keys are cached (a key named twice counts twice, as in Redis)."""
        self._settled(keys)
        return self._transport.execute(ops.exists(keys))

    def delete(self, *keys: Key) -> int:
        """Remove keys; how many existed."""
        self._settled(keys)
        return self._transport.execute(ops.delete(keys))

    def batch_put(self, items: Items, *, parents: Sequence[Key | None] | None = None,
                  overwrite: bool = False, chain_links: Sequence[tuple[Key, Key]] = ()) -> list[bool]:
        """put() for many (key, value) pairs (a mapping or pairs) in one round trip.

        parents, when given, holds one parent key (or None) per item. chain_links: (parent, child)
        pairs a cluster node records (KV.LINK) in the same round trip, as `KVClusterClient` sends them.
        """
        self._settled(None)
        return self._transport.execute(ops.batch_put(items, parents, overwrite, chain_links))

    def put_nowait(self, key: Key, value: Value, *, parent: Key | None = None, overwrite: bool = False) -> None:
        """Store value under key without waiting for the commit: returns once the bytes are in the
        node's memory (copied into a reserved arena extent) or sent; `flush` waits for the commits
        and reports failures. This client's own reads of key wait for its commit."""
        self._puts.put(key, value, parent, overwrite)

    def batch_put_nowait(self, items: Items, *, parents: Sequence[Key | None] | None = None,
                         overwrite: bool = False) -> None:
        """put_nowait() for many (key, value) pairs (a mapping or pairs)."""
        pairs, links = ops.with_parents(items, parents)
        self._puts.batch_put(pairs, links, overwrite)

    def flush(self) -> int:
        """Wait for every put_nowait commit so far: how many were acknowledged since the last flush.

        Raises PutsFailed (``.keys``, ``.failures``) naming the keys whose commit failed: an error
        reply (OOM, ...) or a connection that broke before their acknowledgement."""
        return self._puts.flush()

    def batch_get(self, keys: Sequence[Key]) -> list[bytearray | None]:
        """get() for many keys in one round trip."""
        self._settled(keys)
        return self._transport.execute(ops.batch_get(keys))

    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int | None]:
        """get_into() for many keys, one buffer each, in one round trip."""
        self._settled(keys)
        return self._transport.execute(ops.batch_get_into(keys, buffers))

    # -------------------------------------------------------- tensors and layers

    def put_tensor(self, key: Key, tensor: Any, *, parent: Key | None = None) -> bool:
        """Store a numpy array, torch tensor or cupy array with its dtype and shape (put-once)."""
        return self._transport.execute(layers.put_tensor(key, tensor, parent))

    def get_tensor(self, key: Key, *, framework: str = "numpy") -> Any:
        """The tensor stored under key ("numpy", "torch" or "cupy"), or None when not cached."""
        self._settled((key,))
        return self._transport.execute(layers.get_tensor(key, framework))

    def get_tensor_into(self, key: Key, tensor: Any) -> bool:
        """Copy the stored tensor into ``tensor`` (contiguous); False when not cached.

        Raises TensorMismatch when the dtype or shape differ (nothing is copied).
        """
        self._settled((key,))
        return self._transport.execute(layers.get_tensor_into(key, tensor))

    def batch_put_tensors(self, items: Items, *, parents: Sequence[Key | None] | None = None) -> list[bool]:
        """put_tensor() for many (key, tensor) pairs (a mapping or pairs), one after another."""
        return self._transport.execute(layers.batch_put_tensors(items, parents))

    def batch_get_tensors_into(self, keys: Sequence[Key], tensors: Sequence[Any]) -> list[bool]:
        """get_tensor_into() for many keys, one tensor each, one after another."""
        return self._transport.execute(layers.batch_get_tensors_into(keys, tensors))

    def put_layer(self, key: Key, layer: int, data: Any, *, n_layers: int, parent: Key | None = None,
                  timeout_ms: int | None = None) -> bool:
        """Write layer ``layer`` of a block of ``n_layers`` equal layers shaped like ``data``.

        The block becomes visible (GET, KV.MATCH) when its last layer is in; one left
        unfinished for ``timeout_ms`` (30 s by default) after its last progress is dropped.
        False when the block is already cached.
        """
        return self._transport.execute(layers.put_layer(key, layer, data, n_layers, parent, timeout_ms))

    def get_layers(self, key: Key, start: int = 0, stop: int | None = None, *, into: Any = None,
                   wait: float | None = None, framework: str = "numpy") -> Any:
        """Layers start..stop-1 of a block (shape (stop-start, *layer shape)), or None when absent.

        ``into`` receives them (a contiguous tensor of that shape, or of one layer's shape
        for a single layer); ``wait`` seconds waits for a writer still at work (an error on
        timeout; keep it under the client's ``timeout``, which bounds every reply).
        """
        self._settled((key,))
        return self._transport.execute(layers.get_layers(key, start, stop, into, wait, framework))

    def batch_put_layers(self, items: Sequence[tuple[Key, int, Any]], *, n_layers: int,
                         parents: Sequence[Key | None] | None = None, timeout_ms: int | None = None) -> list[bool]:
        """put_layer() for many (key, layer, data) slots of blocks of ``n_layers`` layers, in a fixed
        number of round trips (not one a slot); parents, when given, holds one parent key (or None) per item.

        One result per item: True written, False when its block is already cached. Every item is
        tried; the first error reply (a slot another writer marked, OOM) is raised after the batch.
        """
        return self._transport.execute(layers.batch_put_layers(items, n_layers, parents, timeout_ms))

    def batch_get_layers(self, keys: Sequence[Key], start: int = 0, stop: int | None = None, *,
                         into: Sequence[Any] | None = None, wait: float | None = None,
                         framework: str = "numpy") -> list[Any]:
        """get_layers() for many blocks (the same range of layers), in a fixed number of round trips.

        One result per key: its tensor (``into[i]`` when given), or None when absent. Every key is
        tried; the first error (a mismatch, a wait that timed out) is raised after the batch.
        """
        return self._transport.execute(layers.batch_get_layers(keys, start, stop, into, wait, framework))

    def match_prefix(self, keys: Sequence[Key]) -> int:
        """How many leading keys of a chain are cached (KV.MATCH, one round trip)."""
        self._settled(keys)
        return self._transport.execute(ops.match_prefix(keys))

    def match_tokens(self, hasher: BlockHasher, token_ids: Any) -> int:
        """How many leading tokens of a prompt are cached (whole blocks only)."""
        self._settled(None)
        return self._transport.execute(ops.match_tokens(hasher, token_ids))

    def locate(self, keys: Sequence[Key]) -> list[Location | None]:
        """Per key, its tier and size, or None when not cached (KV.LOCATE)."""
        self._settled(keys)
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
        """Close the pooled connections; the client cannot be used afterwards (unflushed put_nowait
        commits are read first, their failures dropped: call flush to see them)."""
        self._puts.settle()
        self._puts.close()
        self._transport.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
