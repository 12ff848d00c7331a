"""Whether a connector uses the store now: one log line when it stops answering, one when it is back.

To an engine the store is a cache. While it is down every call would wait out a timeout, so after a
failure the store is left alone for `retry_s`: callers miss at once, and once the time is up one
caller probes it (the others keep missing until that probe answers or fails). Each connector logs
under its own logger and says what the outage costs its engine.
"""
from __future__ import annotations

import logging
import threading
import time


class StoreHealth:
    """An outage's start, its probes, its end, and the two log lines it costs."""

    def __init__(self, name: str, log: logging.Logger, cost: str, retry_s: float = 1.0):
        self.name = name                # "kvstore at HOST:PORT"
        self.log = log
        self.cost = cost                # what the engine does without the store
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._next_try = 0.0

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def usable(self) -> bool:
        """True while the store answers; while it is down, for one caller every `retry_s`."""
        with self._lock:
            if self._down_since is None:
                return True
            now = time.monotonic()
            if now < self._next_try:
                return False
            self._next_try = now + self.retry_s
            return True

    def failed(self, exc: BaseException, during: str = "") -> None:
        """The store did not answer (connection lost, timed out): logged once per outage."""
        with self._lock:
            now = time.monotonic()
            self._next_try = now + self.retry_s
            if self._down_since is not None:
                return
            self._down_since = now
        self.log.warning("%s cannot be used%s (%s: %s): %s while it is away; trying again every %.1f s",
                         self.name, f" during {during}" if during else "", type(exc).__name__, exc,
                         self.cost, self.retry_s)

    def answered(self) -> None:
        """The store answered (even with an error about a key): the outage, if any, is over."""
        if self._down_since is None:
            return
        with self._lock:
            since, self._down_since = self._down_since, None
        if since is not None:
            self.log.warning("%s answers again after %.1f s", self.name, time.monotonic() - since)
