"""Copy engines still open when the interpreter exits are closed before it finalises.

An engine's threads (the CPU copy thread, the accelerator's issuing thread) are daemons, so that a hung copy
never keeps a process alive. CPython ends a daemon thread that takes the GIL back during finalisation with
`pthread_exit`, and the forced unwind through PyTorch's C++ frames (a torch op that released the GIL, as a
lossless decode's do) calls `std::terminate`: the process aborts with exit code 134 after its work is done. The
last block of a forward always prefetches the first, so a copy is in flight whenever a script ends without
`disable()`. An `atexit` hook, which runs before finalisation while daemon threads still run, closes every
open engine: its copies in flight finish, then its threads stop. The host memory is left to the process's end.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Protocol

logger = logging.getLogger(__name__)


class _Closable(Protocol):
    def close(self) -> None: ...


_open: weakref.WeakSet[_Closable] = weakref.WeakSet()
_lock = threading.Lock()
_hooked = False


def close_at_exit(engine: _Closable) -> None:
    """Have `engine.close()` run at interpreter exit if the engine is still alive then (closing twice is a no-op)."""
    global _hooked
    with _lock:
        _open.add(engine)
        if not _hooked:  # registered with the first engine, not at import
            atexit.register(close_open_engines)
            _hooked = True


def close_open_engines() -> int:
    """Close every engine still alive; returns how many. Errors are logged: an exit hook has no caller."""
    with _lock:
        engines = list(_open)
        _open.clear()
    for engine in engines:
        try:
            engine.close()
        except Exception:  # noqa: BLE001
            logger.exception("closing a copy engine at exit failed")
    return len(engines)
