"""What a chaos run checks around each fault: every slot answers, and what was stored is still right.

- `SlotProbe` holds one key in each of the 16,384 slots, written once.
  After a fault ends it reads them in chunks of consecutive slots, all
  chunks at once, until every chunk has been answered once by its slots'
  owners (a dead, paused or cut-off owner, or a slot without one, fails a
  chunk, which is asked again; a value lost is no failure): the time until
  the last chunk's answer is the time until every slot is served again.
  Chunks keep a chunk whose slots are moving (answered key by key after
  ``ASK``) from holding up the others' answer.
  Writes are checked by the load and the ledger.
- `Ledger` writes sealed values across all slots before a fault and reads
  them back after it: those missing are values lost (a cache may lose
  values); those that do not verify are wrong bytes (it may never serve one).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from client import KVClusterClient
from client.errors import KVError
from loadtest.sealed import PayloadPool, verify
from proto.slots import SLOTS, keyslot

PROBE_VALUE_BYTES = 32
ROUND_PAUSE_S = 0.05
CHUNKS = 32                      # of 512 slots each, read at once: one slowed by redirections delays no other


def one_key_per_slot(prefix: bytes = b"chaos:probe:") -> list[bytes]:
    """A key in every slot, in slot order."""
    keys: dict[int, bytes] = {}
    for n in itertools.count():
        key = prefix + b"%d" % n
        keys.setdefault(keyslot(key), key)
        if len(keys) == SLOTS:
            return [keys[slot] for slot in range(SLOTS)]
    raise AssertionError("unreachable")


class SlotProbe:
    """Reads of a key in every slot, in chunks of consecutive slots; the values are written once at the start."""

    def __init__(self, addrs: list[str], timeout: float = 1.0):
        self.kv = KVClusterClient(addrs, fast_path="off", timeout=timeout, retries=0, parallelism=CHUNKS,
                                  pool_size=CHUNKS)
        self._threads = ThreadPoolExecutor(CHUNKS, thread_name_prefix="slot-probe")
        self.keys = one_key_per_slot()
        pool = PayloadPool(PROBE_VALUE_BYTES)
        self.kv.batch_put([(key, pool.sealed(key, PROBE_VALUE_BYTES, i)) for i, key in enumerate(self.keys)])
        self.chunks = [self.keys[i:i + SLOTS // CHUNKS] for i in range(0, SLOTS, SLOTS // CHUNKS)]
        self.wrong_bytes = 0
        self._count_lock = threading.Lock()
        self.last_error = ""
        self.rounds: list[str] = []

    def read(self, keys: list[bytes]) -> bool:
        """One read of ``keys``; True when every one's owner answered."""
        try:
            got = self.kv.batch_get(keys)
        except KVError as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"[:160]
            with contextlib.suppress(KVError):
                self.kv.refresh()
            return False
        wrong = sum(len(v) for k, v in zip(keys, got) if not verify(k, v))
        with self._count_lock:
            self.wrong_bytes += wrong
        return True

    def served_after(self, since: float, limit_s: float) -> float | None:
        """Seconds from ``since`` until every slot has answered once (None: not within ``limit_s``).

        All chunks are read at once; a chunk that answered is not asked again, one that failed
        is asked again in the next round; the answer is when the last chunk's read ended.
        ``rounds`` keeps each round's start, its slowest chunk and its failures, for a row that
        missed its target.
        """
        pending = list(range(len(self.chunks)))
        self.rounds = []
        while time.monotonic() - since < limit_s:
            started = time.monotonic()
            answered = dict(zip(pending, self._threads.map(self._timed_read, pending)))
            pending = [chunk for chunk, ended in answered.items() if ended is None]
            last = max((ended for ended in answered.values() if ended is not None), default=started)
            self.rounds.append(f"{started - since:.2f}+{last - started:.2f}s "
                               + (f"{len(pending)} chunks failed: {self.last_error}" if pending else "ok"))
            if not pending:
                return last - since
            time.sleep(ROUND_PAUSE_S)
        return None

    def _timed_read(self, chunk: int) -> float | None:
        """When the read of a chunk ended, or None when it failed."""
        return time.monotonic() if self.read(self.chunks[chunk]) else None

    def close(self) -> None:
        self._threads.shutdown()
        self.kv.close()


class Ledger:
    """Sealed values written before a fault, read back after it."""

    def __init__(self, kv: KVClusterClient, count: int, value_bytes: int = 1024):
        self.kv, self.count, self.value_bytes = kv, count, value_bytes
        self.pool = PayloadPool(value_bytes)
        self.keys: list[bytes] = []

    def write(self, tag: str, attempts: int = 20) -> None:
        """Store ``count`` fresh values under keys named after ``tag``; only those acknowledged are kept."""
        keys = [b"chaos:ledger:%s:%d" % (tag.encode(), i) for i in range(self.count)]
        for _ in range(attempts):
            try:
                stored = self.kv.batch_put([(k, self.pool.sealed(k, self.value_bytes, i)) for i, k in enumerate(keys)],
                                           overwrite=True)
            except KVError:
                with contextlib.suppress(KVError):
                    self.kv.refresh()
                time.sleep(0.5)
                continue
            self.keys = [k for k, ok in zip(keys, stored) if ok]
            return
        raise RuntimeError(f"the ledger for {tag!r} could not be written: the cluster does not take writes")

    def check(self, attempts: int = 20) -> tuple[int, int]:
        """(values lost, wrong bytes) among the ledger's values."""
        for _ in range(attempts):
            try:
                got = self.kv.batch_get(self.keys)
            except KVError:
                with contextlib.suppress(KVError):
                    self.kv.refresh()
                time.sleep(0.5)
                continue
            lost = sum(v is None for v in got)
            wrong = sum(len(v) for k, v in zip(self.keys, got) if not verify(k, v))
            return lost, wrong
        raise RuntimeError("the ledger could not be read back: the cluster does not answer reads")
