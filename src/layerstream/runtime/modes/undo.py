"""The undo stack of `enable_offload`: every applied step pushes how to take it back."""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


class UndoStack:
    """Undo steps; `unwind` runs them newest first and logs their errors: the caller sees the first one."""

    def __init__(self):
        self._steps: list[Callable[[], None]] = []

    def push(self, step: Callable[[], None]) -> None:
        self._steps.append(step)

    def unwind(self) -> None:
        for step in reversed(self._steps):
            try:
                step()
            except Exception:  # keep undoing; the first error is the one to report
                logger.exception("undo step failed while rolling back enable_offload")
        self._steps.clear()
