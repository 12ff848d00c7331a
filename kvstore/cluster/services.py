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
import math
import time

from kvstore.cluster.cascade import Cascade
from kvstore.cluster.migration import Migrator
from kvstore.cluster.node import ClusterState
from kvstore.cluster.peer import Peers
from kvstore.cluster.heat import WINDOW
from kvstore.cluster.replication import HotCopies
from kvstore.cluster.simclock import loop_time

log = logging.getLogger("kvstore.cluster")

TICK_LOG_INTERVAL_S = 60.0      # a failing tick step logs its traceback at most this often


class ClusterServices:
    """Peers, hot copies and slot moves of one node, wired to its engine and its ClusterState."""

    def __init__(self, server, cluster: ClusterState, peers: Peers | None = None,
                 nic_bytes_per_s: float | None = None):
        def config():
            return server.config            # CONFIG SET replaces it: always read the one in force

        self.server = server
        self.cluster = cluster
        # A simulation passes in-process links; with tls-cluster, nodes reach each other over TLS.
        self.peers = peers or Peers(server.config.requirepass, tls_context=server.cluster_tls_context())
        self.moves = Migrator(server.engine, cluster, self.peers, config, lambda: self.copies.heat.recent(),
                              server.tiers, nic_bytes_per_s)     # a simulation passes its modelled NIC
        self.copies = HotCopies(server.engine, cluster, self.peers, config, self.moves.rescue)
        self.cascade = Cascade(server.engine, cluster, self.peers)
        self.copies.attach()
        self.moves.attach()
        self.cascade.attach()
        cluster.move_budget = self.moves.budget
        self.tick_failures = 0
        self._tick_logged_at = -math.inf
        self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        """Every heat window, for as long as the node runs: a step that fails is logged, and the
        window after runs them all again (ending here would stop copy renewals, import-guard
        expiry and peer clean-up for good, silently)."""
        while True:
            try:
                await self._tick_once()
            except Exception:
                self._log_tick_failure()
                await asyncio.sleep(WINDOW)     # a step that fails at once must not spin the loop

    async def _tick_once(self) -> None:
        """Replication's renewals and cooling (after waiting out the window); settings changed by CONFIG SET."""
        await self.copies.run_once()
        self.cluster.move_budget = self.moves.budget
        self.moves.guard.expire(loop_time())
        self.peers.keep_only(set(self.cluster.map.nodes.values()) | set(self.cluster.nodes.values()))

    def _log_tick_failure(self) -> None:
        """Log with its traceback at most once per TICK_LOG_INTERVAL_S: a step failing every window
        must not flood the log, but the count of the ones left out is kept."""
        self.tick_failures += 1
        now = time.monotonic()
        if now - self._tick_logged_at < TICK_LOG_INTERVAL_S:
            return
        self._tick_logged_at = now
        log.exception("Cluster tick failed (%d failures so far); ticking on", self.tick_failures)

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
