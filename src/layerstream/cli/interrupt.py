"""Ctrl-C on the command line: one line saying the phase a command was in and the files it had put in place
(``layerstream: interrupted during generation; nothing was written``), and exit code 130."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import NoReturn

EXIT_INTERRUPTED = 130
EXIT_PAUSE_ENV_VAR = "LAYERSTREAM_TEST_EXIT_PAUSE_SECONDS"
"""Tests only: hold the process this long after its command finished, so that an interrupt surely lands there."""


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
        """Enter `phase` to write `paths`; they count as written once the block ends (an interrupt inside asks
        the file system whether a file was renamed into place)."""
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


def exit_after_command(code: int) -> NoReturn:
    """End the `layerstream` process once its command returned `code`: a Ctrl-C from now on prints one line and
    exits 130. `os._exit` once the output is flushed: the interpreter's own exit would run other libraries' exit
    hooks (torch's, where a Ctrl-C printed a traceback and exited 0) and finalise modules."""
    signal.signal(signal.SIGINT, _interrupted_at_exit)
    try:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe: nothing more can reach the reader
        code = code or 1
    if pause := float(os.environ.get(EXIT_PAUSE_ENV_VAR) or 0):
        time.sleep(pause)
    os._exit(code)


def _interrupted_at_exit(signum, frame) -> NoReturn:
    print("layerstream: interrupted while exiting, after the command had finished", file=sys.stderr, flush=True)
    os._exit(EXIT_INTERRUPTED)
