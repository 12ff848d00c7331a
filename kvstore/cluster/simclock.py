"""An asyncio event loop on virtual time, for simulating a cluster in one process.

Cluster code waits with ``asyncio.sleep`` and reads ``loop.time()`` (keep-alive
intervals, lease deadlines, settle delays). On this loop, whenever nothing is
ready to run the clock jumps straight to the next timer instead of sleeping,
so minutes of cluster life (leases expiring, leaders taking over) pass in the
milliseconds the code itself takes, and a run is deterministic. Real I/O
still works (the selector is polled without blocking), but a simulation has
none: `FakeEtcd` stands in for etcd.

Cluster code that measures time itself (copy leases, move budgets) reads
`loop_time`, the running loop's clock: the monotonic clock in a server, the
virtual one in a simulation.
"""
from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Coroutine


def loop_time() -> float:
    """The running event loop's clock (``time.monotonic()`` when no loop runs)."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


class SimulationStalled(RuntimeError):
    """Nothing is scheduled and nothing can wake the loop: the simulation would wait forever."""


class _JumpingSelector(selectors.DefaultSelector):
    """Polls without blocking; a wait for the next timer moves the loop's clock instead."""

    loop: "VirtualClockLoop"

    def select(self, timeout: float | None = None):
        ready = super().select(0)
        if not ready:
            if timeout is None:
                raise SimulationStalled("no timer is pending and nothing is ready")
            self.loop.now += timeout
        return ready


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """``time()`` starts at 0 and advances only by jumping to timers."""

    def __init__(self):
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0

    def time(self) -> float:
        return self.now


def run_simulated(main: Coroutine):
    """Run ``main`` to completion on a fresh virtual-time loop and return its result."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
