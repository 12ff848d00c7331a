"""The steps the sans-I/O core asks a transport to take, and what it hands back.

Everything the SDK decides (which commands an operation sends, which path
carries it, how replies and lease state become its result, when to map the
arena again, when to retry) is written once, as generators (`core`, and the
procedures in `arena_reads`, `arena_writes`, `layers` and `gpu`). A generator
yields a step and is sent the step's outcome; the blocking and the asyncio
transport (`transport`) differ only in how they take each step, as the two
connections differ only in how they feed `resp.ReplyReader`.

- `RoundTrip`: send these requests on the connection the procedure runs on
  and read one reply per request (error replies come back as values).
- `Local`: blocking work in this process (a large copy to or from the arena,
  a device copy, mapping the arena); the asyncio transport runs it on a
  worker thread, so the event loop keeps other calls moving. Small copies
  are not worth a thread, and a blocking transport has none: there the
  procedures make their copies themselves (`core.Core.offloads`).
- `Borrow`: run the procedure that `start(conn)` makes on a pooled
  connection (``conn`` is opaque to the core: it names the owner of spare
  reservations, and its `peer` watch says whether the node closed it). The
  outcome is the procedure's `Ended`, or `Broken` when the connection failed
  under it.
- `Pause`: wait this long before retrying.

An exception the core raises between steps leaves its connection in step
(every round trip was read to the end), so the transports hand it back as an
`Ended` and the connection returns to its pool; an exception from the I/O
itself closes the connection.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator

from client import resp
from client.errors import ConnectionError

THREAD_COPY_MIN = 1 << 20        # the asyncio transport copies at least this much off the loop


@dataclass(slots=True)
class RoundTrip:
    requests: list[tuple]
    sinks: list[resp.Sink] | None = None


@dataclass(slots=True)
class Local:
    run: Callable[[], Any]


@dataclass(slots=True)
class Borrow:
    start: Callable[[Any], Generator]


@dataclass(slots=True)
class Pause:
    seconds: float


Step = RoundTrip | Local | Borrow | Pause
Steps = Generator[Step, Any, Any]


@dataclass(slots=True)
class Ended:
    """How a procedure ended: its value, or the exception it raised."""

    value: Any = None
    error: Exception | None = None

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


@dataclass(slots=True)
class Broken:
    """The connection failed under a procedure; ``sent`` once a request may have left."""

    error: ConnectionError
    sent: bool


def advance(steps: Steps, outcome: Any) -> Step | Ended:
    """Send ``outcome`` into the core: its next step, or how it ended."""
    try:
        return steps.send(outcome)
    except StopIteration as done:
        return Ended(done.value)
    except Exception as exc:        # raised by the core between steps: connections stay in step
        return Ended(error=exc)
