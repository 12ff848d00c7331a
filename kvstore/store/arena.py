"""The DRAM arena: one shared-memory mapping that holds every DRAM value.

Why one memfd mapping: values live here rather than in Python objects, so a
value costs no allocator churn and no per-value page faults (a fresh 4 KiB
page costs ~2 us here, which would cap any path that allocates per value near
2 GB/s). The memory comes from ``memfd_create``, so its file descriptor can be
handed to a local client over the Unix socket (SCM_RIGHTS) for the zero-copy
path, with nothing named in /dev/shm to leak after a crash. The whole mapping
is faulted in once at start-up.

Who owns which byte is the allocator's business (kvstore.store.allocator); the arena
only hands out views.
"""
from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass

import numpy as np

from proto import hugepages

PAGE = mmap.PAGESIZE


@dataclass(slots=True)
class Extent:
    """A piece of the arena: reserved for an incoming value, or holding one."""

    offset: int
    size: int
    view: memoryview
    committed: bool = False
    owner: int = 0              # the tenant writing it (kvstore/store/quotas.py)


class Arena:
    """A shared, pre-faulted mapping of ``size`` bytes."""

    def __init__(self, size: int, name: str = "kvstore-dram", prefault: bool = True):
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self._map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.hugepages = hugepages.advise(self._map)        # before the pages are faulted in
        self.page_size = hugepages.page_size(self.hugepages)
        self.view = memoryview(self._map)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.prefault_seconds = self._prefault() if prefault else 0.0

    def _prefault(self) -> float:
        """Touch every page once so no request pays for the first fault."""
        start = time.perf_counter()
        populate = getattr(mmap, "MADV_POPULATE_WRITE", None)
        try:
            if populate is None:
                raise OSError
            self._map.madvise(populate)
        except OSError:
            self.array[::PAGE] = 0
        return time.perf_counter() - start

    def close(self) -> None:
        self.view.release()
        del self.array
        try:
            self._map.close()
        except BufferError:
            # A view is still exported (a reply in flight at shutdown); the
            # mapping goes with the process.
            pass
        os.close(self.fd)
