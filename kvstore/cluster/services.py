"""What a cluster node runs besides membership: its links to the other nodes, hot-block copies
and slot moves, started and stopped together by the server.

Membership (node.py) decides who owns what; these act on it: `HotCopies`
(replication.py) copies hot blocks and keeps the copies right, `Migrator`
(migration.py) moves values with their slots, `Cascade` (cascade.py) drops
the blocks a final drop leaves unreachable, and all speak to other nodes
through one `Peers` pool (peer.py). The server makes one `ClusterServices`
after joining, calls ``drain`` before it leaves (a clean leave moves its
values) and ``close`` after.
"""
from __future__ import annotations

import asyncio
import logging

from kvstore.cluster.cascade import Cascade
from kvstore.cluster.migration import Migrator
from kvstore.cluster.node import ClusterState
from kvstore.cluster.peer import Peers
from kvstore.cluster.replication import HotCopies
from kvstore.cluster.simclock import loop_time

log = logging.getLogger("kvstore.cluster")


class ClusterServices:
    """Peers, hot copies and slot moves of one node, wired to its engine and its ClusterState."""

    def __init__(self, server, cluster: ClusterState, peers: Peers | None = None):
        def config():
            return server.config            # CONFIG SET replaces it: always read the one in force

        self.server = server
        self.cluster = cluster
        # A simulation passes in-process links; with tls-cluster, nodes reach each other over TLS.
        self.peers = peers or Peers(server.config.requirepass, tls_context=server.cluster_tls_context())
        self.moves = Migrator(server.engine, cluster, self.peers, config, self._recent_reads)
        self.copies = HotCopies(server.engine, cluster, self.peers, config, self.moves.rescue)
        self.cascade = Cascade(server.engine, cluster, self.peers)
        self.copies.attach()
        self.moves.attach()
        self.cascade.attach()
        cluster.move_budget = server.config.cluster_move_budget
        self._ticker = asyncio.get_running_loop().create_task(self._tick())

    def _recent_reads(self) -> dict[bytes, int]:
        return self.copies.recent_reads()

    async def _tick(self) -> None:
        """Every heat window: replication's renewals and cooling; settings changed by CONFIG SET."""
        while True:
            await self.copies.run_once()
            self.cluster.move_budget = self.server.config.cluster_move_budget
            self.moves.guard.expire(loop_time())
            self.peers.keep_only(set(self.cluster.map.nodes.values()) | set(self.cluster.nodes.values()))

    async def drain(self) -> None:
        """Move this node's slots away before it leaves; a failure here must not stop the leave."""
        try:
            await self.moves.drain()
        except Exception:
            log.exception("Draining failed: leaving without moving values")

    def close(self) -> None:
        self._ticker.cancel()
        self.copies.close()
        self.moves.close()
        self.cascade.close()
        self.peers.close()

    def info(self) -> dict:
        return {**self.copies.info(), **self.moves.info(), **self.cascade.info()}
