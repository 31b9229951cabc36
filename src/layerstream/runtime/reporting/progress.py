"""Progress of staging a model into the host store (minutes for a 60 GB model: it must never look frozen): a bar
on a terminal, for at least `MIN_BAR_BYTES`, and everywhere one INFO line that sums up.
"""

from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger(__name__)

MIN_BAR_BYTES = 256 * 2**20  # below this, staging is over before a bar would help


class StagingProgress:
    def __init__(self, what: str, total_bytes: int, num_blocks: int, *, unit: str = "blocks"):
        self.what = what
        self.unit = unit
        self.total_bytes = total_bytes
        self.num_blocks = num_blocks
        self.done_bytes = 0
        self.start = time.perf_counter()
        self._bar = None
        if total_bytes >= MIN_BAR_BYTES and sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm  # comes with diffusers and transformers; the core does not need it
            except ModuleNotFoundError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=what, leave=False)  # decimal units

    def advance(self, nbytes: int) -> None:
        self.done_bytes += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)

    def close(self, bytes_from_files: int) -> None:
        if self._bar is not None:
            self._bar.close()
        seconds = time.perf_counter() - self.start
        rate = self.done_bytes / seconds / 1e9 if seconds > 0 else float("inf")
        logger.info(
            "%s: %d %s, %.2f GB in %.1f s (%.2f GB/s), %.2f GB read straight from the checkpoint files",
            self.what,
            self.num_blocks,
            self.unit,
            self.done_bytes / 1e9,
            seconds,
            rate,
            bytes_from_files / 1e9,
        )
