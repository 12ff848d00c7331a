"""ClusterServices' tick loop (kvstore/cluster/services.py), on a virtual-time loop with in-process links:
a step that raises is logged and the loop keeps ticking."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from kvstore.cluster.node import ClusterState
from kvstore.cluster.services import ClusterServices
from kvstore.cluster.simclock import run_simulated
from kvstore.cluster.slots import SLOTS, SlotMap
from kvstore.admin.config import Config
from kvstore.store.engine import Engine
from loadtest.sim_network import NicModel, SimNetwork

A = "a" * 40
ADDRS = {A: "10.0.0.1:7000"}


def test_a_tick_step_that_raises_is_logged_and_the_loop_keeps_ticking(caplog):
    async def scenario():
        net = SimNetwork(NicModel(nic_bytes_per_s=1e9, latency_s=0.0))
        cluster = ClusterState(A, ADDRS[A])
        cluster.apply(SlotMap.build(1, ADDRS, [A] * SLOTS))
        server = SimpleNamespace(cluster=cluster, engine=Engine(1 << 20, prefault=False), tiers=None, config=Config())
        services = ClusterServices(server, cluster, net.peers_of(ADDRS[A]))
        real_run_once, runs, expiries = services.copies.run_once, [], []

        async def run_once_failing_twice():
            runs.append(1)
            if len(runs) <= 2:
                raise RuntimeError("renewal broke")
            await real_run_once()

        services.copies.run_once = run_once_failing_twice
        services.moves.guard.expire = expiries.append
        await asyncio.sleep(10)
        services.close()
        return services.tick_failures, len(expiries)

    with caplog.at_level(logging.ERROR, logger="kvstore.cluster"):
        failures, expiries = run_simulated(scenario())
    assert failures == 2
    assert expiries >= 5                        # the import guard still expires every window after them
    logged = [r for r in caplog.records if "Cluster tick failed" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None      # rate-limited, with the traceback
