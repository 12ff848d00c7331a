"""The sans-I/O core: which path carries an operation, and the retries around it.

Both clients hand every operation to a transport, which drives `Core.run`
(see `steps` for the vocabulary). An operation is a `Call` from
`operations` (one pipelined round trip over the wire; a get or a put also
says which bytes it moves, so the arena can carry it) or a tensor or layer
operation from `layers`. For each one the core decides:

- the arena or the wire: an operation the local fast path can carry goes
  through the node's shared-memory arena, mapped on first use (`arena_reads`,
  `arena_writes`, `layers` and `gpu` hold those procedures); everything else, and everything
  when the arena cannot be mapped in "auto" mode, goes over the wire;
- mapping again: a node that restarted has a new arena, and every fast-path
  command carries the token of the arena the client mapped, so a stale
  mapping is answered STALEARENA before any byte moves; the core then maps
  the arena again and runs the operation once more (then the wire);
- the wire instead: a node that cannot serve a value from its arena (it is
  staged outside it) answers NOTINARENA, and the operation goes over the wire;
  what the fast path owes the node (reads served from the shared index to
  report, leases and spares to give back) rides ahead of a wire call too, so
  the node's counters are current by the time it answers the client's next
  request of any kind;
- retries: a connection that broke under a procedure is replaced and the
  procedure started again, where `RetryPolicy` allows (always before the
  request left, and after only for idempotent operations).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from client import arena_reads, arena_writes, layers
from client.fastpath import OVER_WIRE, REMAPPED, FastPath
from client.operations import Call, LocalRead, LocalWrite
from client.retry import RetryPolicy
from client.steps import THREAD_COPY_MIN, Borrow, Broken, Local, Pause, Steps

ARENA_ATTEMPTS = 2               # mappings tried for one operation before it goes over the wire


class Core:
    """The fast path's state and the retry policy, and the operations run with them.

    ``offloading``: the transport runs `Local` steps on a worker thread (asyncio),
    so large copies are handed to it as steps; a blocking transport would only run
    them in place, so the procedures make every copy themselves.
    """

    def __init__(self, fast: FastPath, retry: RetryPolicy, offloading: bool):
        self.fast = fast
        self.retry = retry
        self.offloading = offloading

    def offloads(self, nbytes: int) -> bool:
        """Whether a copy of ``nbytes`` is a `Local` step (else the procedure makes it)."""
        return self.offloading and nbytes >= THREAD_COPY_MIN

    def copy(self, run: Callable[[], Any], nbytes: int) -> Steps:
        """Make a copy of ``nbytes``: here, or as a `Local` step when it is worth a thread."""
        return (yield Local(run)) if self.offloads(nbytes) else run()

    def run(self, op: Any) -> Steps:
        """The steps of one operation, through the arena where it can go, else over the wire."""
        if isinstance(op, layers.Each):
            results = []
            for one in op.ops:
                results.append((yield from self.run(one)))
            return results
        fast = self.fast
        for _ in range(ARENA_ATTEMPTS):
            direct = self._arena_steps(op)
            if direct is None:
                break
            if fast.needs_mapping():
                yield Local(fast.arena)
            if fast.mapping is None:
                break
            outcome = yield from direct
            if outcome is OVER_WIRE:
                break
            if outcome is not REMAPPED:
                return outcome
        fast.stats.wire_calls += 1
        if isinstance(op, Call) and op.requests and fast.has_housekeeping():
            op = _after(fast.housekeeping(), op)
        return (yield from op.over_wire(self))

    def on_connection(self, start: Callable[[Any], Steps], idempotent: bool) -> Steps:
        """Run the procedure ``start(conn)`` makes on a pooled connection: its result;
        on a fresh connection again after one broke, where the retry policy allows."""
        attempt = 0
        while isinstance(outcome := (yield Borrow(start)), Broken):
            if not self.retry.should_retry(attempt, outcome.sent, idempotent):
                raise outcome.error
            yield Pause(self.retry.delay(attempt))
            attempt += 1
        return outcome.result()

    def _arena_steps(self, op: Any) -> Steps | None:
        """The steps that move ``op``'s bytes through the arena (not started: no I/O yet);
        None when only the wire can carry it."""
        if self.fast.unavailable is not None:
            return None
        if not isinstance(op, Call):
            return op.through_arena(self)
        if isinstance(op.local, LocalRead):
            return arena_reads.read(self, op)
        if isinstance(op.local, LocalWrite) and arena_writes.worth_writing(op.local):
            return arena_writes.write(self, op)
        return None


def _after(ahead: list[tuple], call: Call) -> Call:
    """``call`` with the requests ``ahead`` pipelined before its own (their replies ignored)."""
    skip = len(ahead)
    return replace(call, requests=[*ahead, *call.requests],
                   sinks=None if call.sinks is None else [None] * skip + list(call.sinks),
                   finish=lambda replies: call.finish(replies[skip:]))
