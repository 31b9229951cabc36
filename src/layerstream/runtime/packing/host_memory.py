"""Giving freed host memory back to the operating system while a model is staged: glibc keeps memory freed in
its heap counted in the process until the heap is trimmed, so staging would hold the freed originals beside the
packed copies, up to twice the model. Elsewhere (another libc, not Linux) nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc (musl has no malloc_trim)
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_freed_memory() -> None:
    """Return the heap's free pages to the operating system, where the C library can."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
