"""Which thread runs an offloaded pipeline: one at a time, from the entry of its call to the end (a call changes
shared state, the scheduler's step and the learned block order, before its first streamed block runs). A second
thread is refused where a call enters, before it reads or writes anything; the owner may re-enter.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

from layerstream.errors import ConcurrentUseError

OWNED_METHODS = ("__call__", "encode_prompt", "encode_image")  # take ownership for their whole run


class CallOwnership:
    """Re-entrant ownership by one thread, refused (not waited for) to every other thread."""

    def __init__(self, what: str = "a streamed model"):
        self.what = what
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._depth = 0

    def enter(self) -> None:
        me = threading.get_ident()
        with self._lock:
            if self._owner is None:
                self._owner, self._depth = me, 1
            elif self._owner == me:
                self._depth += 1
            else:
                raise ConcurrentUseError(
                    f"{self.what} is already running in another thread; layerstream runs one call at a time per "
                    "offloaded pipeline, and refuses the second before it touches anything (serialize calls, e.g. "
                    "with a queue or a lock; Omni.generate waits its turn)"
                )

    def exit(self) -> None:
        """Leave one level; a thread that does not own it leaves nothing."""
        with self._lock:
            if self._owner == threading.get_ident():
                self._depth -= 1
                if self._depth <= 0:
                    self._owner, self._depth = None, 0

    def held_here(self) -> bool:
        return self._owner == threading.get_ident()

    def check(self) -> None:
        """Refuse a thread that is not the owner while someone owns it."""
        owner = self._owner
        if owner is not None and owner != threading.get_ident():
            raise ConcurrentUseError(f"a streamed block of {self.what} was called from a second thread while another thread runs it")


def own_pipeline_calls_(pipeline, ownership: CallOwnership) -> Callable[[], None]:
    """Make `pipeline`'s calls take `ownership` for their whole run, through a subclass (`pipe(...)` looks
    `__call__` up on the class); returns the undo."""
    cls = type(pipeline)
    overrides: dict[str, object] = {}
    for name in OWNED_METHODS:
        original = getattr(cls, name, None)
        if callable(original) and (name != "__call__" or original is not object.__call__):
            overrides[name] = _owned(original, ownership)
    if not overrides:
        return lambda: None
    owned = type(cls.__name__, (cls,), {**overrides, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    pipeline.__class__ = owned

    def undo() -> None:
        if type(pipeline) is owned:
            pipeline.__class__ = cls

    return undo


def _owned(method: Callable, ownership: CallOwnership) -> Callable:
    @functools.wraps(method)
    def owned(self, *args, **kwargs):
        ownership.enter()  # before the method reads anything: a second thread is refused here
        try:
            return method(self, *args, **kwargs)
        finally:
            ownership.exit()

    return owned
