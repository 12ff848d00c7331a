"""The load a chaos run keeps on the cluster: engines replaying the trace, on plain threads.

Each thread is one engine (`loadtest.kv_workload.KVCacheEngine`) on a
`KVClusterClient` of its own, as separate engine processes would be. Every operation's outcome is counted into the
current `Window`; the run takes the window at the end of each fault
(`take`), so each row counts only what happened during its fault and the
recovery after it. A short pause between requests leaves the 2-core host's
CPU to the nodes and the probes.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from client import KVClusterClient
from loadtest.kv_workload import KVCacheEngine, TraceCursor, WrongValue
from loadtest.sealed import PayloadPool


@dataclass
class Window:
    """What the load saw between two takes."""

    ops: int = 0
    errors: int = 0
    wrong_bytes: int = 0
    first_error: str = ""


class TraceLoad:
    """``threads`` engines replaying ``cursor`` on the cluster until `stop`."""

    def __init__(self, addrs: list[str], cursor: TraceCursor, *, threads: int, block_bytes: int,
                 pause_s: float = 0.005, timeout: float = 2.0):
        self.cursor = cursor
        self.pause_s = pause_s
        self.pool = PayloadPool(block_bytes)
        self.engines = [KVCacheEngine(KVClusterClient(addrs, fast_path="off", timeout=timeout, retries=1),
                                      self.pool, block_bytes) for _ in range(threads)]
        self.window = Window()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(e,), name=f"engine-{i}", daemon=True)
                         for i, e in enumerate(self.engines)]

    def start(self) -> "TraceLoad":
        for thread in self._threads:
            thread.start()
        return self

    def take(self) -> Window:
        """The window so far; a new one starts."""
        with self._lock:
            window, self.window = self.window, Window()
        return window

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(30)
        for engine in self.engines:
            engine.kv.close()

    def _run(self, engine: KVCacheEngine) -> None:
        while not self._stopping.is_set():
            try:
                engine.serve(self.cursor.next(), self._record)
            except Exception as exc:            # a failure the SDK did not classify still counts, and the engine goes on
                self._record("request", 0.0, 0, exc)
            self._stopping.wait(self.pause_s)

    def _record(self, name: str, seconds: float, nbytes: int, error: BaseException | None) -> None:
        with self._lock:
            self.window.ops += 1
            if error is None:
                return
            self.window.errors += 1
            if isinstance(error, WrongValue):
                self.window.wrong_bytes += error.nbytes
            if not self.window.first_error:
                self.window.first_error = f"{name}: {type(error).__name__}: {error}"[:160]
