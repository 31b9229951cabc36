"""Reading the checkpoint ahead while diffusers builds the pipeline (its first second or so reads only headers):
the kernel is asked to read the largest files into the page cache (`POSIX_FADV_WILLNEED`), up to a budget well
below the memory available. Where `posix_fadvise` does not exist it does nothing."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from pathlib import Path

from layerstream.procfs import mem_available_nbytes

CHUNK_BYTES = 64 * 2**20
MAX_BYTES = 4 * 2**30
"""At most this much is read ahead: about what a disk reads while the pipeline is built, and then some."""


class Readahead:
    """Reads `files` ahead into the page cache on a thread until `budget` bytes or `stop()`."""

    def __init__(self, files: list[Path], budget: int | None = None):
        self._files = files
        self._budget = min(MAX_BYTES, (mem_available_nbytes() or 0) // 4) if budget is None else budget
        self._stop = threading.Event()
        self.bytes_requested = 0
        self._thread: threading.Thread | None = None
        if hasattr(os, "posix_fadvise") and self._budget > 0 and files:
            self._thread = threading.Thread(target=self._run, name="layerstream-readahead", daemon=True)
            self._thread.start()

    @classmethod
    def for_pipeline_folder(cls, folder: Path, skip: Iterable[str] = ()) -> Readahead:
        """The folder's safetensors files (not those of `skip`), largest component first."""
        components = [d for d in folder.iterdir() if d.is_dir() and d.name not in skip]
        sizes = {d: sum(f.stat().st_size for f in d.glob("*.safetensors")) for d in components}
        files = [f for d in sorted(components, key=lambda d: -sizes[d]) for f in sorted(d.glob("*.safetensors"))]
        return cls(files)

    def wait(self) -> None:
        """Wait until every request is made (the kernel reads them in the background after)."""
        if self._thread is not None:
            self._thread.join()

    def stop(self) -> None:
        self._stop.set()
        self.wait()

    def _run(self) -> None:
        for path in self._files:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue  # the loader names a missing file itself
            try:
                size = os.fstat(fd).st_size
                for offset in range(0, size, CHUNK_BYTES):
                    if self._stop.is_set() or self.bytes_requested >= self._budget:
                        return
                    length = min(CHUNK_BYTES, size - offset)
                    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
                    self.bytes_requested += length
            except OSError:
                return  # advice only: a failure changes nothing
            finally:
                os.close(fd)
