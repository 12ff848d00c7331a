"""Chain links of single-key cluster puts, sent to the parents' nodes off the caller's path.

A cluster batch put carries its chain links (``KV.LINK``) to each parent's
node in the batch that node receives anyway. A single-key put (``put``,
``put_tensor``, a block's last ``put_layer``: how engine connectors store a
prompt, block by block) whose chain parent lives on another node has no such
round, so its link waits here, batched per node, and one background task per
node sends what has gathered while the caller goes on. A link is a hint for
the node's eviction cascade (kvstore/cluster/cascade.py): a failed send (of
whatever cause: the next links to that node still go), a backlog past
``PENDING_MAX`` or a closed client loses links, never a put.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Executor
from typing import Callable

from client.buffers import Key
from client.errors import KVError
from client.sync_client import KVClient
from proto.wire import KV_LINK_MAX

PENDING_MAX = 4096          # links waiting, over all nodes

log = logging.getLogger(__name__)


class LinkSender:
    """Links waiting per node address, sent on ``pool`` by at most one task per node."""

    def __init__(self, pool: Executor, client_of: Callable[[str], KVClient]):
        self._pool = pool
        self._client_of = client_of
        self._lock = threading.Lock()
        self._pending: dict[str, list[tuple[Key, Key]]] = {}
        self._sending: set[str] = set()
        self._count = 0
        self._closed = False
        self.lost = 0               # links dropped: backlog full, send failed, client closed

    def add(self, addr: str, parent: Key, child: Key) -> None:
        """Send ``KV.LINK parent child`` to ``addr`` soon."""
        with self._lock:
            if self._closed or self._count >= PENDING_MAX:
                self.lost += 1
                return
            self._pending.setdefault(addr, []).append((parent, child))
            self._count += 1
            if addr in self._sending:
                return
            self._sending.add(addr)
        try:
            self._pool.submit(self._send, addr)
        except RuntimeError:                    # the client is closing: its pool takes no more
            self._give_up(addr)

    def close(self) -> None:
        """Send nothing more (a send under way ends with its chunk): the links waiting are lost."""
        with self._lock:
            self._closed = True
            self.lost += self._count
            self._pending.clear()
            self._count = 0

    def _send(self, addr: str) -> None:
        while True:
            with self._lock:
                links = self._pending.pop(addr, [])
                self._count -= len(links)
                if not links:
                    self._sending.discard(addr)
                    return
            for start in range(0, len(links), KV_LINK_MAX):
                chunk = links[start:start + KV_LINK_MAX]
                with self._lock:
                    if self._closed:
                        self.lost += len(links) - start
                        break
                self._send_chunk(addr, chunk)

    def _send_chunk(self, addr: str, chunk: list[tuple[Key, Key]]) -> None:
        """One KV.LINK batch. Any failure loses only it: an exception left to the pool would
        end this node's task unseen, and its links would wait forever."""
        try:
            self._client_of(addr).batch_put([], chain_links=chunk)
        except Exception as exc:
            if not isinstance(exc, KVError):
                log.warning("Sending %d chain links to %s failed: %r", len(chunk), addr, exc)
            with self._lock:
                self.lost += len(chunk)

    def _give_up(self, addr: str) -> None:
        with self._lock:
            links = self._pending.pop(addr, [])
            self._count -= len(links)
            self.lost += len(links)
            self._sending.discard(addr)
