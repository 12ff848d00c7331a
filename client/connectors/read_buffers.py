"""Host buffers that a connector's prefix loads read into, kept for the next load.

A load reads a prompt's blocks into one buffer and the engine copies them out
into its own cache, so the buffer is scratch once the load is released. A new
buffer for every load was the slowest step of a decode's start: an array that
large (tens of MiB) is mapped fresh by the allocator each time, and on a
virtual machine the first touch of each new page can cost tens of
microseconds (likely: the host backs it only then). Measured with the 1,024-token
hand-off of `loadtest.bench_serving` at load 3-4 on 2 cores: a 5.6 MiB block
copied in 15-120 ms into a fresh buffer, 0.5-1 ms into a kept one; the first
decode step 70-180 ms after the prefill ended, against 15-22 ms.

At most `max_buffers` buffers and `max_bytes` bytes are kept; a buffer given
back beyond that is left to the garbage collector, so the memory held is
bounded whatever the prompts' lengths.
"""
from __future__ import annotations

import threading

import numpy as np


class ReadBuffers:
    """A small free list of byte buffers, handed out as arrays of the shape a load needs."""

    def __init__(self, max_buffers: int, max_bytes: int):
        self.max_buffers = max_buffers
        self.max_bytes = max_bytes
        self._free: list[np.ndarray] = []       # flat uint8 arrays
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A C-contiguous array of ``shape`` and ``dtype``: a view of a kept buffer that is large
        enough (the smallest such), else a new one. Its contents are undefined."""
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        with self._lock:                         # kept largest first: the last that fits is the smallest
            fitting = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            flat = self._free.pop(fitting[-1]) if fitting else np.empty(nbytes, np.uint8)
        return flat[:nbytes].view(dtype).reshape(shape)

    def give_back(self, array: np.ndarray) -> None:
        """Keep the memory of ``array``, which `take` made, for a later `take` (the caller no longer
        reads or writes it)."""
        flat = array.base                        # numpy keeps a view's owner there: take's flat buffer
        if not isinstance(flat, np.ndarray) or flat.dtype != np.uint8 or flat.nbytes > self.max_bytes:
            return
        with self._lock:
            self._free.append(flat)
            self._free.sort(key=lambda b: b.nbytes, reverse=True)
            while len(self._free) > self.max_buffers or sum(b.nbytes for b in self._free) > self.max_bytes:
                self._free.pop()                 # the smallest goes first: large loads gain most
