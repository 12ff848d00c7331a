"""When a failed round trip is tried again on a fresh connection.

Only connection errors are retried (a timeout means the server is slow or
gone, and waiting again would double the caller's wait). A call that failed
before its request was written (the connect itself failed) is always safe to
retry; one that failed after is retried only when the operation is
idempotent (see `operations`). Waits grow exponentially, so a node that is
restarting gets time to come back.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 3
    first_delay: float = 0.05
    max_delay: float = 1.0

    def should_retry(self, attempt: int, sent: bool, idempotent: bool) -> bool:
        """Whether attempt number `attempt` (0 for the first) may be followed by another."""
        return attempt < self.retries and (idempotent or not sent)

    def delay(self, attempt: int) -> float:
        """Seconds to wait before the attempt after `attempt`."""
        return min(self.max_delay, self.first_delay * 2 ** attempt)
