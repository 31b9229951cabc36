"""Ctrl-C on the command line: the phase a command is in and the files it has put in place, so that an
interrupt ends it with one line saying both (``layerstream: interrupted during generation; nothing was
written``) and exit code 130."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path

EXIT_INTERRUPTED = 130
"""128 + SIGINT: what a shell reports for a command ended by Ctrl-C."""


class Phase(StrEnum):
    """What a command is doing, worded to follow "interrupted during"."""

    STARTING = "start-up"
    LOADING = "loading the model"
    GENERATING = "generation"
    WRITING_OUTPUT = "writing the output"
    WRITING_TRACE = "writing the trace"
    COMPARING = "the run on the resident model"
    REPORTING = "the summary"


class PhaseLog:
    """The current phase and the files written so far; `interrupted_line` words them."""

    def __init__(self) -> None:
        self.phase = Phase.STARTING
        self.written: list[Path] = []
        self._pending: dict[Path, tuple[int, int] | None] = {}

    def enter(self, phase: Phase) -> None:
        self.phase = phase

    @contextlib.contextmanager
    def writing(self, phase: Phase, *paths: Path) -> Iterator[None]:
        """Enter `phase` to write `paths`; they count as written once the block ends.

        An interrupt inside the block may land just after a file was renamed into place: the file system is
        asked then (a new file, or another one than was there before), never assumed either way.
        """
        self.phase = phase
        self._pending = {path: _identity(path) for path in paths}
        yield
        self.written.extend(paths)
        self._pending = {}

    def interrupted_line(self) -> str:
        written = self.written + [path for path, before in self._pending.items() if _identity(path) != before]
        if not written:
            return f"layerstream: interrupted during {self.phase}; nothing was written"
        verb = "was" if len(written) == 1 else "were"
        return f"layerstream: interrupted during {self.phase}; {', '.join(map(str, written))} {verb} written"


def report_interrupt(log: PhaseLog) -> int:
    """Print the one line for an interrupt and return the exit code."""
    print(log.interrupted_line(), file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def _identity(path: Path) -> tuple[int, int] | None:
    """The file at `path` as (device, inode), None if there is none: a rename into place changes the inode."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino
