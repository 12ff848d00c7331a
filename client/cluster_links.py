"""Chain links of single-key cluster puts, sent to the parents' nodes off the caller's path.

A cluster batch put carries its chain links (``KV.LINK``) to each parent's
node in the batch that node receives anyway. A single-key put (``put``,
``put_tensor``, a block's last ``put_layer``: how engine connectors store a
prompt, block by block) whose chain parent lives on another node has no such
round, so its link waits here, batched per node, and one background task per
node sends what has gathered while the caller goes on. A link is a hint for
the node's eviction cascade (kvstore/cluster/cascade.py): a failed send, or a
backlog past ``PENDING_MAX``, loses links, never a put.
"""
from __future__ import annotations

import threading
from concurrent.futures import Executor
from typing import Callable

from client.buffers import Key
from client.errors import KVError
from client.sync_client import KVClient
from proto.wire import KV_LINK_MAX

PENDING_MAX = 4096          # links waiting, over all nodes


class LinkSender:
    """Links waiting per node address, sent on ``pool`` by at most one task per node."""

    def __init__(self, pool: Executor, client_of: Callable[[str], KVClient]):
        self._pool = pool
        self._client_of = client_of
        self._lock = threading.Lock()
        self._pending: dict[str, list[tuple[Key, Key]]] = {}
        self._sending: set[str] = set()
        self._count = 0
        self.lost = 0               # links dropped: backlog full, send failed, client closed

    def add(self, addr: str, parent: Key, child: Key) -> None:
        """Send ``KV.LINK parent child`` to ``addr`` soon."""
        with self._lock:
            if self._count >= PENDING_MAX:
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
                try:
                    self._client_of(addr).batch_put([], chain_links=chunk)
                except KVError:
                    with self._lock:
                        self.lost += len(chunk)

    def _give_up(self, addr: str) -> None:
        with self._lock:
            links = self._pending.pop(addr, [])
            self._count -= len(links)
            self.lost += len(links)
            self._sending.discard(addr)
