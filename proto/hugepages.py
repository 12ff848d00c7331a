"""Transparent huge pages for the shared DRAM arena, where the host allows them.

The arena is shared memory (a memfd), so what governs its pages is the shmem
setting, ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` (the bracketed
word): ``never`` / ``deny`` leave 4 KiB pages; ``advise`` gives 2 MiB pages to
mappings that ask with ``madvise(MADV_HUGEPAGE)``; ``always``, ``within_size``
and ``force`` give them without asking. The node advises huge pages on its
mapping before faulting it in, and so does the SDK on its own mapping (its page
tables are its own: a 2 MiB page mapped with one entry is one TLB miss where
512 small ones were 512). Both the node and the SDK use this module.
"""
from __future__ import annotations

import mmap

SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
ADVISING = ("advise", "within_size", "always")      # modes where advising huge pages is worth a call
HUGE_PAGE = 2 << 20
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)     # Linux 5.14; Python 3.13 names it


def shmem_mode(path: str | None = None) -> str:
    """The host's shmem huge-page setting (the bracketed word), or "unknown" without the file."""
    try:
        with open(path or SHMEM_ENABLED) as f:
            text = f.read()
    except OSError:
        return "unknown"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "unknown"


def wanted(path: str | None = None) -> bool:
    return shmem_mode(path) in ADVISING and hasattr(mmap, "MADV_HUGEPAGE")


def advise(mapping: mmap.mmap, path: str | None = None) -> str:
    """Advise huge pages on ``mapping`` where the setting allows them: "advised" (advise mode,
    the call made), "always" (the kernel gives them without asking; advised anyway), or "off"."""
    mode = shmem_mode(path)
    if mode not in ADVISING and mode != "force":
        return "off"
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, AttributeError):
        return "always" if mode in ("always", "within_size", "force") else "off"
    return "advised" if mode == "advise" else "always"


def page_size(state: str) -> int:
    """The page size asked for: 2 MiB with huge pages advised or always on, else the base page."""
    return HUGE_PAGE if state in ("advised", "always") else mmap.PAGESIZE


def populate(mapping: mmap.mmap, array) -> None:
    """Fault a mapping in after advising it (MAP_POPULATE would fault it before the advice)."""
    try:
        mapping.madvise(MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        array[::mmap.PAGESIZE].max()        # read a byte of every page: never writes shared data
