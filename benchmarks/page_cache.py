"""Dropping files from the kernel's page cache, and telling how much of them is still cached.

A cold start is only cold if the checkpoint is not already in memory. `drop_page_cache` asks the kernel to
forget the files' clean pages (`posix_fadvise(POSIX_FADV_DONTNEED)`: no privileges needed, unlike
/proc/sys/vm/drop_caches), after writing back dirty ones, which it would otherwise keep (a folder just written
is all dirty pages). Pages another process has mapped stay. `cached_fraction` checks the result with
`mincore` on a mapping of each file (mapping faults nothing in).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

_PAGE_BYTES = mmap.PAGESIZE


def drop_page_cache(paths: Iterable[Path]) -> bool:
    """Ask the kernel to drop the files' pages from the page cache. False where the platform cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages are never dropped: write them back first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def cached_fraction(paths: Iterable[Path]) -> float | None:
    """The fraction of the files' pages that are in the page cache (0.0: cold), or None where `mincore`
    cannot be called."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    total = cached = 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        with open(path, "rb") as f:
            # a private (copy) mapping is writable for ctypes and never writes the file; nothing is faulted in
            mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            window = (ctypes.c_char * size).from_buffer(mapping)
            num_pages = (size + _PAGE_BYTES - 1) // _PAGE_BYTES
            vec = (ctypes.c_ubyte * num_pages)()
            rc = mincore(ctypes.addressof(window), size, vec)
            del window  # the mapping cannot close while a ctypes view exports it
            if rc != 0:
                return None
            raw = bytes(vec)
            total += num_pages
            cached += num_pages - raw.count(0)
        finally:
            mapping.close()
    return cached / total if total else 0.0
