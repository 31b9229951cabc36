"""Writing a file so that it is whole or absent, whatever interrupts it: the one way layerstream writes its
outputs (generated images and videos, the command line's trace files)."""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

PARTIAL_MARK = ".partial-"
"""In every temporary name (``.fox.partial-1a2b3c4d.mp4``): with the leading dot, it cannot pass for an output."""

PAUSE_ENV_VAR = "LAYERSTREAM_TEST_WRITE_PAUSE_SECONDS"
"""Tests only: seconds to hold a complete temporary file before renaming it, so that an interrupt lands there."""


@contextlib.contextmanager
def write_atomically(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside `path` (with its suffix, which writers pick a format by); on a clean exit,
    flush it to the disk and rename it onto `path` in one step; on any exception (KeyboardInterrupt included)
    remove it, `path` untouched. A symlink at `path` is written through, as a plain write would."""
    target = Path(path)
    if target.is_symlink():
        target = target.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    names = _partial_names(target)
    partial = next(names)
    try:
        # created inside the try: a Ctrl-C that lands the moment the file exists (before a helper could hand
        # its name back) still removes it
        while not _create_exclusively(partial):
            partial = next(names)
        yield partial
        if pause := os.environ.get(PAUSE_ENV_VAR):
            time.sleep(float(pause))
        _fsync(partial)  # the data reaches the disk before the rename makes it the output
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _fsync_folder(target.parent)  # makes the rename itself survive a power loss


def _partial_names(target: Path) -> Iterator[Path]:
    """Temporary names beside `target`, each new: 2**32 tokens, so a name another call holds is rare."""
    while True:
        yield target.with_name(f".{target.stem}{PARTIAL_MARK}{secrets.token_hex(4)}{target.suffix}")


def _create_exclusively(partial: Path) -> bool:
    """Create `partial` empty if no file has that name; False if one has. Not mkstemp: its private 0600 mode
    would become the output's, where this honours the umask as any plain write does."""
    try:
        os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except FileExistsError:
        return False
    return True


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform (Windows) or file system that cannot open folders: the rename is done anyway
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the file itself is already on the disk
    finally:
        os.close(fd)
