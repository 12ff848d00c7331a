"""Store traffic shared by the vLLM-shaped connectors: layer-slot puts on a background thread, block
reads, and the store's health as the engine sees it.

Both connectors (`vllm_v1.StoreKVConnector` over a transformers cache, `vllm_paged.VllmStoreConnector`
over vLLM's paged cache) store a block the same way: one value of `n_layers` equal slots, slot l
written as soon as layer l has run, with the block's parent key so the store keeps the chain; a reader
takes all layers of its blocks with one `batch_get_layers`. Only the slot's contents differ
(each engine's own bytes for the block; the namespace keeps different layouts apart, and the tensor
header makes a reader with another shape or dtype get a mismatch, never reinterpreted bytes).

The store is a cache: when it is down, slow or full the engine goes on without it. `StoreHealth` logs
one line when the store stops answering and one when it is back, and between them tells callers to
skip it for `retry_s` (a lookup then finds nothing at once, instead of waiting out a timeout per
request). Saves are dropped, not queued without bound, while the store is away or the queue holds
more than `max_queued_bytes`.

Round trips, not bytes, are what a save costs, so the saver thread takes every job queued when it wakes
(up to `SAVE_BATCH_BYTES`) and writes their slots with one `batch_put_layers`: through the arena of a
node on this host that is one round trip opening the blocks, the copies, and one round trip marking the
slots written (over the wire, one pipelined round trip). Slots are still written and marked layer by
layer in the order the engine produced them, so a reader waiting on a block sees its layers arrive as
before; a job is one layer of some blocks, and a batch is never held back to wait for more.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from client import ConnectionError, KVClient, KVError, ResponseError, TimeoutError
from client.connectors import store_health

log = logging.getLogger(__name__)

LOAD_WAIT_S = 2.0                      # longest wait for a layer another writer is still putting
RETRY_S = 1.0                          # how long an unreachable store is skipped before the next try
MAX_QUEUED_SAVE_BYTES = 256 << 20      # saves waiting for the store beyond this are dropped
SAVE_BATCH_BYTES = 64 << 20            # slots one batch of the saver writes at most


class StoreHealth(store_health.StoreHealth):
    """The store's health as the vLLM-shaped connectors see it, and a put refused for room, logged once."""

    def __init__(self, name: str, retry_s: float = RETRY_S):
        super().__init__(f"KV store {name}", log, "serving without the cache", retry_s)
        self._full_logged = False

    def full(self, exc: ResponseError) -> None:
        """A put refused for lack of room (OOM): logged once; the engine keeps its KV to itself."""
        if not self._full_logged:
            self._full_logged = True
            log.warning("%s refuses puts (%s): new blocks are not cached", self.name, exc.message)


def is_outage(exc: BaseException) -> bool:
    """A failure of the store as a whole (connection, timeout), not an answer about one key."""
    return isinstance(exc, (ConnectionError, TimeoutError))


@dataclass
class SaveJob:
    """Layer ``layer`` of some blocks of one request: ``slot(i)`` is block i's slot (built on the thread)."""

    request_id: str
    layer: int
    n_layers: int
    keys: Sequence[str]
    parents: Sequence[str | None]
    slot: Callable[[int], Any]
    nbytes: int = 0
    release: Callable[[], None] | None = None      # called once the slots are no longer read


class BlockSaver:
    """One thread putting layer slots in the order they were submitted; per-request bookkeeping."""

    def __init__(self, store: KVClient, health: StoreHealth, max_queued_bytes: int = MAX_QUEUED_SAVE_BYTES,
                 on_request_done: Callable[[str], None] | None = None):
        self.store = store
        self._on_request_done = on_request_done
        self.health = health
        self.max_queued_bytes = max_queued_bytes
        self._jobs: queue.Queue[SaveJob | None] = queue.Queue()
        self._queued_bytes = 0
        self._saving: dict[str, int] = {}              # request -> jobs not yet done
        self._opened: dict[str, threading.Event] = {}  # request -> set once its layer-0 job is done
        self._lock = threading.Condition()
        self._dropped_logged = False
        self._thread = threading.Thread(target=self._loop, name="kv-saver", daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob) -> bool:
        """Queue a job; False (and the job's release called) when it is dropped: store away or queue full."""
        with self._lock:
            over = self._queued_bytes + job.nbytes > self.max_queued_bytes and self._queued_bytes > 0
            if not over:
                self._queued_bytes += job.nbytes
                self._saving[job.request_id] = self._saving.get(job.request_id, 0) + 1
                if job.layer == 0:
                    self._opened.setdefault(job.request_id, threading.Event())
        if over or not self.health.usable():
            if not over:
                self._done(job)
            elif job.release is not None:
                job.release()
            if over and not self._dropped_logged:
                self._dropped_logged = True
                log.warning("%s is slower than the engine: saves beyond %d queued bytes are dropped",
                            self.health.name, self.max_queued_bytes)
            return False
        self._jobs.put(job)
        return True

    def saving(self, request_id: str) -> bool:
        with self._lock:
            return self._saving.get(request_id, 0) > 0

    def wait_opened(self, request_id: str, timeout: float | None = None) -> bool:
        event = self._opened.get(request_id)
        return True if event is None else event.wait(timeout)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every queued job is done (True), or ``timeout`` passed (False)."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._saving, timeout)

    def close(self, timeout: float = 5.0) -> None:
        self.wait_idle(timeout)
        self._jobs.put(None)

    def _loop(self) -> None:
        while True:
            jobs, stop = self._next_batch()
            if jobs:
                self._save(jobs)
            if stop:
                return

    def _next_batch(self) -> tuple[list[SaveJob], bool]:
        """The jobs queued now (at least one: waits for it), up to `SAVE_BATCH_BYTES`; and whether the
        saver is closing."""
        job = self._jobs.get()
        if job is None:
            return [], True
        jobs, nbytes = [job], job.nbytes
        while nbytes < SAVE_BATCH_BYTES:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                return jobs, True
            jobs.append(job)
            nbytes += job.nbytes
        return jobs, False

    def _save(self, jobs: list[SaveJob]) -> None:
        try:
            if self.health.usable():
                self._put(jobs)
        except KVError as exc:
            if is_outage(exc):
                self.health.failed(exc)
            else:
                log.warning("saving layers %s of %s failed: %s", _layers(jobs), _requests(jobs), exc)
        except Exception:                            # a bad slot must not stop the thread
            log.exception("saving layers %s of %s failed", _layers(jobs), _requests(jobs))
        finally:
            for job in jobs:
                self._done(job)

    def _put(self, jobs: list[SaveJob]) -> None:
        """Every slot of ``jobs`` in one `batch_put_layers` per block size (one in practice)."""
        groups: dict[int, tuple[list, list]] = {}
        for job in jobs:
            items, parents = groups.setdefault(job.n_layers, ([], []))
            for i, key in enumerate(job.keys):
                items.append((key, job.layer, job.slot(i)))
                parents.append(job.parents[i])
        for n_layers, (items, parents) in groups.items():
            try:
                self.store.batch_put_layers(items, n_layers=n_layers, parents=parents)
            except ResponseError as exc:
                if exc.code == "OOM":
                    self.health.full(exc)
                    return
                # Another writer holds one of these blocks (the same prefix computed twice at once):
                # theirs wins; every other slot of the batch was written.
                log.debug("layers %s of %s: %s", _layers(jobs), _requests(jobs), exc)
        self.health.answered()

    def _done(self, job: SaveJob) -> None:
        if job.release is not None:
            job.release()
        finished = False
        with self._lock:
            self._queued_bytes -= job.nbytes
            if job.layer == 0 and job.request_id in self._opened:
                self._opened.pop(job.request_id).set()
            left = self._saving.get(job.request_id, 1) - 1
            if left:
                self._saving[job.request_id] = left
            else:
                self._saving.pop(job.request_id, None)
                finished = True
            self._lock.notify_all()
        if finished and self._on_request_done is not None:
            self._on_request_done(job.request_id)


def read_blocks(store: KVClient, health: StoreHealth, keys: Sequence[str], n_layers: int, buffer: Any,
                wait_s: float = LOAD_WAIT_S) -> int:
    """Read every layer of each block into ``buffer[i]``, in order; how many leading blocks arrived whole.

    A block that is gone (evicted, node lost), unfinished past ``wait_s``, or stored with another shape
    or dtype ends the read there: the caller recomputes from that block on. A store that stops
    answering does too (and is reported to ``health``)."""
    if not health.usable() or not keys:
        return 0
    try:
        got = store.batch_get_layers(keys, 0, n_layers, into=[buffer[i] for i in range(len(keys))], wait=wait_s)
    except KVError as exc:
        if is_outage(exc):
            health.failed(exc)
            return 0
        log.info("a block could not be read (%s): recomputed from there", exc)
        return _whole_now(store, keys, n_layers, buffer)
    health.answered()
    return next((i for i, block in enumerate(got) if block is None), len(keys))


def _whole_now(store: KVClient, keys: Sequence[str], n_layers: int, buffer: Any) -> int:
    """After a batch read that failed on some block: the leading blocks readable whole now (no waiting)."""
    for i, key in enumerate(keys):
        try:
            if store.get_layers(key, 0, n_layers, into=buffer[i]) is None:
                return i
        except KVError:
            return i
    return len(keys)


def _layers(jobs: Sequence[SaveJob]) -> str:
    layers = sorted({job.layer for job in jobs})
    return str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"


def _requests(jobs: Sequence[SaveJob]) -> str:
    return ", ".join(dict.fromkeys(job.request_id for job in jobs))


def matched_tokens(store: KVClient, health: StoreHealth, keys: Sequence[str], block_tokens: int) -> int:
    """Tokens of the longest cached prefix of ``keys`` (one KV.MATCH); 0 when the store does not answer
    (or answers with an error: the engine serves on without the cache)."""
    if not keys or not health.usable():
        return 0
    try:
        hit = store.match_prefix(keys)
    except KVError as exc:
        health.failed(exc)
        return 0
    health.answered()
    return hit * block_tokens
