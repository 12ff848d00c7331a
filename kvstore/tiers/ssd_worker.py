"""Runs an SSDTier off the event loop: reads on a small pool, puts and deletes on
one writer thread.

Why one writer: queued puts share one WriteBatch (group commit: one WAL append
for many values), and a delete queued after a put of the same key always lands
after it, so a deleted or overwritten value never comes back after a crash.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from kvstore.tiers.record import RecordHeader
from kvstore.tiers.ssd import SSDTier

T = TypeVar("T")
log = logging.getLogger(__name__)
RECLAIM_IDLE_S = 1.0          # the writer idle this long reclaims a segment (kvstore/tiers/segments.py)
# A batch's write holds the GIL (rocksdict does not release it), so the event loop waits for it:
# 2 MiB is ~2-4 ms of WAL and memtable copies; 16 MiB held the loop for tens of milliseconds.
MAX_BATCH_BYTES = 2 << 20


class SSDWorker:
    """Runs an SSDTier off the event loop; queued puts share one WriteBatch.

    Reads and deletes go to a small thread pool (``submit``). Puts go to one
    writer thread that takes everything queued, up to ``max_batch_bytes``,
    and stores it with one ``put_batch``; if the batch as a whole fails, the
    items are retried one by one so each caller gets its own result or error.
    A put's value buffer must stay unchanged until its future is done.
    """

    def __init__(self, tier: SSDTier, *, readers: int = 2, max_batch_bytes: int = MAX_BATCH_BYTES):
        self.tier = tier
        self.readers = readers
        self.max_batch_bytes = max_batch_bytes
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="ssd-read")
        self._queue: queue.SimpleQueue[_PendingPut | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="ssd-write", daemon=True)
        self._writer.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run ``fn(*args)`` on a reader thread; await the result."""
        return asyncio.get_running_loop().run_in_executor(self._readers, fn, *args)

    def put(self, key: bytes, value, parent: bytes | None = None,
            tenant: bytes | None = None) -> asyncio.Future[RecordHeader]:
        """Queue a put (`SSDTier.put`); the future gives the header written or the tier's error."""
        loop = asyncio.get_running_loop()
        pending = _PendingPut(key, value, parent, tenant, loop, loop.create_future())
        self._queue.put(pending)
        return pending.future

    def delete(self, key: bytes) -> asyncio.Future[bool]:
        """Queue a delete behind every put already queued (so it never undoes a later put)."""
        loop = asyncio.get_running_loop()
        pending = _PendingPut(key, None, None, None, loop, loop.create_future())
        self._queue.put(pending)
        return pending.future

    def _next(self) -> _PendingPut | None:
        """The next queued write; while none comes for `RECLAIM_IDLE_S`, reclaim one
        mostly dead segment of the tier's value files at a time."""
        while True:
            try:
                return self._queue.get(timeout=RECLAIM_IDLE_S)
            except queue.Empty:
                pass
            reclaim = getattr(self.tier, "reclaim", None)
            if reclaim is None:
                return self._queue.get()
            try:
                reclaim(1)
            except Exception:   # a reclaim that fails leaves the values where they are
                log.exception("SSD segment reclaim failed")

    def _write_loop(self) -> None:
        held: _PendingPut | None = None
        while (first := held or self._next()) is not None:
            held = None
            if first.value is None:
                first.settle(self.tier.delete, first.key)
                continue
            batch, size = [first], len(memoryview(first.value).cast("B"))
            while size < self.max_batch_bytes:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)       # finish this batch, then stop
                    break
                if item.value is None:
                    held = item                 # a delete: after this batch, in order
                    break
                batch.append(item)
                size += len(memoryview(item.value).cast("B"))
            self._store(batch)
            time.sleep(0)                       # hand the GIL to a loop that waited for it

    def _store(self, batch: list[_PendingPut]) -> None:
        try:
            headers = self.tier.put_batch([(p.key, p.value, p.parent, p.tenant) for p in batch])
        except Exception:
            for pending in batch:
                pending.settle(lambda *item: self.tier.put_batch([item])[0], pending.key, pending.value,
                               pending.parent, pending.tenant)
            return
        for pending, header in zip(batch, headers):
            pending.resolve(header, None)

    def close(self) -> None:
        """Finish queued puts and stop the threads (the tier stays open)."""
        self._queue.put(None)
        self._writer.join()
        self._readers.shutdown(wait=True)


@dataclass(slots=True)
class _PendingPut:
    """A queued write: a put, or a delete when ``value`` is None."""

    key: bytes
    value: Any
    parent: bytes | None
    tenant: bytes | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    def settle(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self.resolve(fn(*args), None)
        except Exception as exc:
            self.resolve(None, exc)

    def resolve(self, result: Any, error: BaseException | None) -> None:
        """Hand the outcome to the caller's loop; a loop already closed has no one to tell
        (raising here would end the writer thread, and every later put would wait forever)."""
        try:
            self.loop.call_soon_threadsafe(_set_future, self.future, result, error)
        except RuntimeError:
            pass


def _set_future(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():        # the caller gave up waiting
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


