"""Block transports: how a cluster client moves block bytes to and from one node.

`KVClusterClient` reads and writes every block through the `BlockTransport`
of the block's node, so the way bytes cross the network can change without
touching routing, redirections, hot copies or chain links. Today there is
one implementation, `RespTransport`: the bytes travel in RESP replies and
requests on the node's `KVClient` (which takes the node's shared-memory arena
instead when the node runs on this host). The interface exists for the
second one, one-sided RDMA reads and writes over Mooncake's Transfer Engine
(docs/transport.md has its design; these machines have no RDMA NIC to
build it on), so its methods are shaped after the engine's calls:

    read_into / batch_read_into   transfer_sync_read / batch_transfer_sync_read
    write / batch_write           transfer_sync_write / batch_transfer_sync_write

with the node's RESP connection (``client``) left for what is not block
bytes: finding a block (the engine moves bytes between addresses, it knows
no keys), reserving and committing an extent, prefix matches, tensors,
layers and administration. The whole-value ``read`` forms exist because a
caller of ``get`` does not know the size to allocate.

Not to be confused with `client.transport`, the I/O shells that drive the
sans-I/O core of one `KVClient`: a block transport sits above a client.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Iterator, Sequence

from client.buffers import Key
from client.operations import Items, Value, match_prefix as match_call
from client.sync_client import KVClient


class BlockTransport(ABC):
    """Block bytes to and from one node; ``client`` is that node's RESP client for everything else.

    Every method has the semantics of the `KVClient` method it is named
    after: a missing key is None (never an error), ``read_into`` raises
    `BufferTooSmall` for a value larger than its buffer, ``TypeError`` for a
    buffer that cannot be written in place, ``ValueError`` for batches of
    unequal lengths, `ConnectionError` for a node that cannot be reached.
    """

    def __init__(self, client: KVClient):
        self.client = client

    @abstractmethod
    def read(self, key: Key) -> bytearray | None:
        """The value of key, in a buffer of its exact size, or None when not cached."""

    @abstractmethod
    def read_into(self, key: Key, buffer: Any) -> int | None:
        """Receive key's value into the caller's buffer: its length, or None when not cached."""

    @abstractmethod
    def batch_read(self, keys: Sequence[Key]) -> list[bytearray | None]:
        """read() for many keys of this node, in one round."""

    @abstractmethod
    def batch_read_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int | None]:
        """read_into() for many keys of this node, one buffer each, in one round."""

    @abstractmethod
    def write(self, key: Key, value: Value, *, parent: Key | None = None, overwrite: bool = False) -> bool:
        """Store value under key, linked to parent; False when the key existed (put-once)."""

    @abstractmethod
    def batch_write(self, items: Items, *, parents: Sequence[Key | None] | None = None,
                    overwrite: bool = False, chain_links: Sequence[tuple[Key, Key]] = ()) -> list[bool]:
        """write() for many (key, value) pairs; ``chain_links`` (parent, child) ride with the commit."""

    @abstractmethod
    def match_prefix(self, keys: Sequence[Key]) -> int:
        """How many leading keys of this node's part of a chain are cached."""

    @abstractmethod
    def match_sent(self, keys: Sequence[Key]) -> AbstractContextManager[Callable[[], int]]:
        """match_prefix() in two halves: the question sent on entry, the answer read by the
        function the block is given (at most once).

        A cluster's prefix match sends to every node before it reads from
        any, so the nodes answer at once while one thread waits once.
        """

    def close(self) -> None:
        """Close the node's connections; the transport cannot be used afterwards."""
        self.client.close()

    def __enter__(self) -> BlockTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class RespTransport(BlockTransport):
    """Blocks in RESP requests and replies (GET, KV.PUT) on the node's client: received with
    ``recv_into`` straight into the caller's buffer, sent with one ``sendmsg`` from it."""

    def read(self, key: Key) -> bytearray | None:
        return self.client.get(key)

    def read_into(self, key: Key, buffer: Any) -> int | None:
        return self.client.get_into(key, buffer)

    def batch_read(self, keys: Sequence[Key]) -> list[bytearray | None]:
        return self.client.batch_get(keys)

    def batch_read_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int | None]:
        return self.client.batch_get_into(keys, buffers)

    def write(self, key: Key, value: Value, *, parent: Key | None = None, overwrite: bool = False) -> bool:
        return self.client.put(key, value, parent=parent, overwrite=overwrite)

    def batch_write(self, items: Items, *, parents: Sequence[Key | None] | None = None,
                    overwrite: bool = False, chain_links: Sequence[tuple[Key, Key]] = ()) -> list[bool]:
        return self.client.batch_put(items, parents=parents, overwrite=overwrite, chain_links=chain_links)

    def match_prefix(self, keys: Sequence[Key]) -> int:
        return self.client.match_prefix(keys)

    @contextmanager
    def match_sent(self, keys: Sequence[Key]) -> Iterator[Callable[[], int]]:
        """On a connection borrowed from the client's pool until the block ends. An error in the
        block closes it (the pool's rule); an answer the block did not read is read and dropped,
        so the connection goes back with no reply in flight."""
        with self.client._transport.connection() as conn:
            call = match_call(keys)
            conn.send(call.requests)
            replies: list[list[Any]] = []

            def answer() -> int:
                replies.append(conn.receive([None] * len(call.requests)))
                return call.finish(replies[0])
            yield answer
            if not replies:
                conn.receive([None] * len(call.requests))
