"""Copy engines still open when the interpreter exits are closed before it finalises: CPython ends a daemon
thread that takes the GIL back then with `pthread_exit`, whose unwind through a torch op's C++ frames calls
`std::terminate` (exit code 134 after the work is done), and a copy is in flight whenever a script ends without
`disable()` (the last block prefetches the first).
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
